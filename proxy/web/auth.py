"""Who is looking at the web page: operator keys, the session cookie, cross-site checks.

Off the data path. The page accepts the keys of the JSON operator routes, by the
same rules (`proxy.edge.operator.resolve_caller`): an admin key sees every tenant, a
tenant's proxy key only its tenant. A browser logs in once at `/recap/login`;
scripts send `Authorization: Bearer KEY`. Keys never travel in URLs.

The cookie holds no key. It is `v1.<payload>.<signature>`: the payload names the
key by an HMAC of it (so a stolen cookie does not reveal even a weak key), a random
session id, and an expiry; the signature is an HMAC-SHA256 under a random secret
made when the app is built. So a restart, or another replica, ends every session
(log in again), and a key removed from the config ends its sessions too: each
request finds the key again among the configured ones. Logging out revokes the session
itself, not only the browser's copy of the cookie: its id is kept, per app, until the
cookie would have expired anyway. At most `MAX_REVOKED` are kept; past that the one
expiring first is forgotten and every session expiring no later than it is refused (a
few sessions end early; a revoked one never comes back).

Actions (POST) are refused across sites three ways: the cookie is SameSite=Strict,
every form carries a CSRF token derived from the session id, and a request whose
`Origin` (or `Sec-Fetch-Site`) says it came from another site is rejected whatever
it carries.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import secrets
import time
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

from proxy.config import Config
from proxy.errors import RecapError
from proxy.history.identity import bearer_token

COOKIE = "recap_session"
SESSION_S = 12 * 3600
MAX_COOKIE_CHARS = 1024
MAX_REVOKED = 10_000


class Forbidden(RecapError):
    status = 403
    type = "invalid_request_error"
    code = "forbidden"


@dataclass(frozen=True)
class Credential:
    """A configured operator key presented by this request, and how it came."""

    key: str
    # The session id when the key came from the cookie; None for a Bearer header.
    session: str | None
    # When the cookie's session ends (epoch seconds); None for a Bearer header.
    expires: float | None = None

    def headers(self) -> dict[str, str]:
        """As the JSON routes would have seen it, for `resolve_caller`."""
        return {"authorization": f"Bearer {self.key}"}


class Sessions:
    """Issues and checks session cookies and CSRF tokens under one per-app secret."""

    def __init__(
        self,
        config: Config,
        secret: bytes | None = None,
        ttl_s: float = SESSION_S,
        max_revoked: int = MAX_REVOKED,
    ):
        self.config = config
        self._secret = secret if secret is not None else secrets.token_bytes(32)
        self.ttl_s = ttl_s
        self.max_revoked = max_revoked
        # Logged-out sessions, by id, with their expiry; and the expiry at or before
        # which every session is refused (raised when the set must forget one).
        self._revoked: dict[str, float] = {}
        self._floor = float("-inf")

    @property
    def revoked_count(self) -> int:
        return len(self._revoked)

    def revoke(self, credential: Credential, now: float | None = None) -> None:
        """End a cookie session for good (logout): its cookie opens nothing any more."""
        if credential.session is None or credential.expires is None:
            return
        now = time.time() if now is None else now
        self._revoked = {s: e for s, e in self._revoked.items() if e > now}
        self._revoked[credential.session] = credential.expires
        while len(self._revoked) > self.max_revoked:
            first = min(self._revoked, key=self._revoked.__getitem__)
            self._floor = max(self._floor, self._revoked.pop(first))

    def _mac(self, purpose: str, data: str) -> str:
        digest = hmac.new(self._secret, f"{purpose}\x00{data}".encode(), hashlib.sha256).digest()
        return base64.urlsafe_b64encode(digest).decode().rstrip("=")

    def _keys(self) -> list[str]:
        return [
            *self.config.admin_keys,
            *(k for t in self.config.tenants.values() for k in t.api_keys),
        ]

    def known(self, key: str) -> bool:
        """An admin key or a tenant's proxy key (the open tenant has none)."""
        return any(hmac.compare_digest(key.encode(), k.encode()) for k in self._keys())

    def issue(self, key: str, now: float | None = None) -> str:
        """A cookie value for a known key."""
        payload = {
            "k": self._mac("key", key),
            "s": secrets.token_urlsafe(16),
            "e": int((time.time() if now is None else now) + self.ttl_s),
        }
        body = base64.urlsafe_b64encode(json.dumps(payload).encode()).decode().rstrip("=")
        return f"v1.{body}.{self._mac('cookie', body)}"

    def open(self, cookie: str | None, now: float | None = None) -> Credential | None:
        """The key and session a cookie stands for, or None if it is forged, stale or unknown."""
        if not cookie or len(cookie) > MAX_COOKIE_CHARS:
            return None
        version, _, rest = cookie.partition(".")
        body, _, signature = rest.partition(".")
        if version != "v1" or not hmac.compare_digest(signature, self._mac("cookie", body)):
            return None
        try:
            payload = json.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))
            key_mac, session, expires = str(payload["k"]), str(payload["s"]), float(payload["e"])
        except (ValueError, KeyError, TypeError):
            return None
        if expires <= (time.time() if now is None else now):
            return None
        if expires <= self._floor or session in self._revoked:
            return None  # logged out
        for key in self._keys():
            if hmac.compare_digest(key_mac, self._mac("key", key)):
                return Credential(key, session, expires)
        return None

    def csrf(self, credential: Credential | None) -> str:
        """The token a form must carry; empty when no cookie session exists."""
        if credential is None or credential.session is None:
            return ""
        return self._mac("csrf", credential.session)

    def check_csrf(self, credential: Credential | None, token: str) -> None:
        """Cookie sessions must send their token back; Bearer callers carry no ambient
        credential a foreign page could use, so they need none."""
        if credential is None or credential.session is None:
            return
        if not token or not hmac.compare_digest(token, self.csrf(credential)):
            raise Forbidden("The form's CSRF token is missing or wrong; reload the page.")


def presented(
    sessions: Sessions, headers: Mapping[str, str], cookie: str | None
) -> Credential | None:
    """The Bearer key if one is sent (known or not: the caller decides), else the cookie's."""
    token = bearer_token(headers)
    if token is not None:
        return Credential(token, None)
    return sessions.open(cookie)


def check_same_origin(headers: Mapping[str, str]) -> None:
    """Refuse a state-changing request that a browser says came from another site.

    Compared with the Host header by host and port only: behind a TLS-terminating
    proxy the scheme the browser used is not the one this server sees.
    """
    site = headers.get("sec-fetch-site")
    if site is not None and site not in ("same-origin", "none"):
        raise Forbidden(f"Cross-site request refused (Sec-Fetch-Site: {site}).")
    origin = headers.get("origin")
    if origin is None:
        return
    host = headers.get("host", "")
    if origin == "null" or urlsplit(origin).netloc.lower() != host.lower():
        raise Forbidden("Cross-site request refused (its Origin is not this server).")


def cookie_attributes(secure: bool, max_age: int) -> dict[str, object]:
    """For `Response.set_cookie`: never readable by scripts, never sent cross-site."""
    return {
        "max_age": max_age,
        "path": "/recap",
        "httponly": True,
        "samesite": "strict",
        "secure": secure,
    }
