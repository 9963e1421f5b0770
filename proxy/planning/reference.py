"""The `encrypted_content` of a compaction item Recap issues: a reference to a summary version.

Codex keeps the item it got from remote compaction and sends it back in later
requests (docs/codex.md). Recap's item holds no summary text, only which summary
it stands for, authenticated so that a client cannot point it at another
conversation's summary or another tenant's:

    recap1.<payload>.<mac>
    payload = base64url(JSON {"k": conversation key, "v": version, "h": boundary hash})
    mac     = base64url(HMAC-SHA256(secret, "recap-compaction\\0" tenant "\\0" payload))

The tenant is in the MAC, not in the payload: a reference presented by another
tenant fails like an altered one. Pure: no IO, the secret is handed in.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
from dataclasses import dataclass

PREFIX = "recap1."
_DOMAIN = b"recap-compaction\x00"
# Longer than any payload Recap writes (a key is at most 256 characters): a bound on
# what is decoded from a client's string.
_MAX_CHARS = 4096


@dataclass(frozen=True)
class Reference:
    """The summary version a compaction item stands for."""

    key: str
    version: int
    boundary_hash: str


class BadReference(ValueError):
    """Not a reference this tenant may use; the message says why, for the 400."""


def is_recap_reference(token: object) -> bool:
    """Whether `token` claims to be one of Recap's (it may still fail to verify)."""
    return isinstance(token, str) and token.startswith(PREFIX)


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def _mac(secret: bytes, tenant: str, payload: str) -> str:
    message = _DOMAIN + tenant.encode("utf-8", "surrogatepass") + b"\x00" + payload.encode("ascii")
    return _b64(hmac.new(secret, message, hashlib.sha256).digest())


def issue(secret: bytes, tenant: str, ref: Reference) -> str:
    body = {"k": ref.key, "v": ref.version, "h": ref.boundary_hash}
    payload = _b64(json.dumps(body, separators=(",", ":")).encode("utf-8", "surrogatepass"))
    return f"{PREFIX}{payload}.{_mac(secret, tenant, payload)}"


def verify(secret: bytes, tenant: str, token: object) -> Reference:
    """The reference in `token` when this tenant's MAC holds; else BadReference."""
    if not isinstance(token, str) or not token:
        raise BadReference("a compaction item needs a non-empty string encrypted_content")
    if not token.startswith(PREFIX):
        raise BadReference("this compaction item was not issued by Recap")
    if len(token) > _MAX_CHARS:
        raise BadReference("this compaction item's encrypted_content is too long")
    payload, dot, mac = token[len(PREFIX) :].partition(".")
    if not dot or not payload or not mac:
        raise BadReference("this compaction item's encrypted_content is malformed")
    try:
        expected = _mac(secret, tenant, payload)
    except UnicodeEncodeError:
        raise BadReference("this compaction item's encrypted_content is malformed") from None
    if not hmac.compare_digest(expected.encode("ascii"), mac.encode("utf-8", "replace")):
        raise BadReference(
            "this compaction item was altered, or was issued to another tenant or by another"
            " Recap deployment"
        )
    try:
        body = json.loads(_unb64(payload))
        key, version, boundary = body["k"], body["v"], body["h"]
    except (binascii.Error, ValueError, KeyError, TypeError):
        raise BadReference("this compaction item's encrypted_content is malformed") from None
    if not isinstance(key, str) or not isinstance(boundary, str):
        raise BadReference("this compaction item's encrypted_content is malformed")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise BadReference("this compaction item's encrypted_content is malformed")
    return Reference(key, version, boundary)
