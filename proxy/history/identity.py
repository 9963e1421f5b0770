"""Who is asking and which conversation this is: tenant by proxy key, conversation key.

Runs right after parsing. Pure over headers and the parsed body, so it is tested
without a server. A tenant is chosen by the proxy key in `Authorization: Bearer`;
an open tenant (no api_keys) takes every request that presents no known key.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from proxy.config import Config, Tenant
from proxy.errors import BadRequest, Unauthorized
from proxy.history.conversation_ref import ConversationRef
from proxy.history.messages import PINNED_ROLES

MAX_KEY_CHARS = 256
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
# What a key from the body may not hold either: C1 controls, line and paragraph separators
# (line breaks to logs and terminals) and the bidi controls, with which `invoice<U+202E>
# gpj.exe` reads as another key in the web page, the CLI and the logs.
_FORMAT = re.compile("[\x80-\x9f\u061c\u200e\u200f\u2028-\u202e\u2066-\u2069]")
_SESSION_HEADER = re.compile(r"^x-[a-z0-9-]*session-id$")


def bearer_token(headers: Mapping[str, str]) -> str | None:
    value = headers.get("authorization", "")
    scheme, _, token = value.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def presented_keys(headers: Mapping[str, str], names: Sequence[str]) -> list[str]:
    """The keys a request presents in the headers its API carries them in (`names`, a
    dialect's `credential_headers`): a Bearer token from `authorization`, any other such
    header's value as it is (Anthropic's `x-api-key`)."""
    out: list[str] = []
    for name in names:
        token = bearer_token(headers) if name == "authorization" else headers.get(name, "").strip()
        if token:
            out.append(token)
    return out


def credentials_of(headers: Mapping[str, str], names: Sequence[str]) -> dict[str, str]:
    """The headers among `names` the request carries: the client's own credential, given
    to the summarizer's calls when the upstream has no key of its own."""
    return {name: headers[name] for name in names if headers.get(name)}


def is_admin_key(config: Config, token: str | None) -> bool:
    # compare_digest: do not leak key prefixes through timing.
    return token is not None and any(
        hmac.compare_digest(token.encode(), k.encode()) for k in config.admin_keys
    )


def resolve_tenant(
    config: Config, headers: Mapping[str, str], key_headers: Sequence[str] = ("authorization",)
) -> Tenant:
    """The tenant whose proxy key was presented, else the open tenant, else 401.

    The key is read where the route's API carries it (`key_headers`: a Bearer token by
    default; also `x-api-key` on the Messages API). An admin key is never a chat key, not
    even for the open tenant (which would otherwise take it as "some key of the client's
    own" and forward it upstream).
    """
    tokens = presented_keys(headers, key_headers)
    if any(is_admin_key(config, token) for token in tokens):
        raise Unauthorized("An admin key is for the /v1/recap/ operator routes only.")
    for token in tokens:
        for tenant in config.tenants.values():
            if any(hmac.compare_digest(token.encode(), k.encode()) for k in tenant.api_keys):
                return tenant
    for tenant in config.tenants.values():
        if tenant.is_open:
            return tenant
    raise Unauthorized("Invalid proxy API key." if tokens else "Missing proxy API key.")


def _check_sent_key(key: str, source: str, *, header: bool = False) -> str:
    """`header`: the key is a header's bytes read as latin-1 (0x80-0x9f are then bytes of
    UTF-8 characters, not controls), checked as the UTF-8 they are too."""
    if len(key) > MAX_KEY_CHARS:
        raise BadRequest(f"conversation key from {source} is over {MAX_KEY_CHARS} characters")
    text = key
    if header and max(key, default="\x00") <= "\xff":
        text = key.encode("latin-1").decode("utf-8", "ignore")
    if _CONTROL.search(key) or _FORMAT.search(text):
        raise BadRequest(f"conversation key from {source} contains control characters")
    return key


def _sent_key(
    config: Config, headers: Mapping[str, str], candidates: Sequence[tuple[str, Any]]
) -> str | None:
    configured = config.conversation_header.lower()
    for name in (configured, "x-session-id"):
        if name in headers and headers[name] != "":
            return _check_sent_key(headers[name], name, header=True)
    for name in sorted(headers):
        if _SESSION_HEADER.match(name) and headers[name] != "":
            return _check_sent_key(headers[name], name, header=True)
    # Codex CLI names its session in a plain `session-id` header (`session_id` in some versions).
    for name in ("session-id", "session_id"):
        if headers.get(name):
            return _check_sent_key(headers[name], name, header=True)
    for source, value in candidates:
        if isinstance(value, str) and value:
            # JSON may carry lone surrogates, which no store can hold as text: keep
            # them as escapes (headers cannot carry them: they are latin-1).
            value = value.encode("utf-8", "backslashreplace").decode("utf-8")
            return _check_sent_key(value, source)
    return None


def chat_key_fields(body: Any) -> list[tuple[str, Any]]:
    """The conversation key a chat body may carry: `metadata.conversation_id`."""
    metadata = body.get("metadata") if isinstance(body, Mapping) else None
    if isinstance(metadata, Mapping):
        return [("metadata.conversation_id", metadata.get("conversation_id"))]
    return []


DERIVED_PREFIX = "auto-"


def _derived_key(messages: Sequence[Any]) -> str:
    """Stable for clients that send no key: the pinned prompt and the first user message."""
    h = hashlib.sha256()
    for m in messages:
        if not isinstance(m, Mapping):
            break
        role = m.get("role")
        if not isinstance(role, str):  # e.g. a list: not even hashable
            break
        if role in PINNED_ROLES or role == "user":
            content = m.get("content")
            text = content if isinstance(content, str) else _canonical(content)
            # Length-prefixed, so two different splits of the same text differ.
            part = f"{role}\x00{len(text)}\x00{text}"
            h.update(part.encode("utf-8", "surrogatepass"))
        if role not in PINNED_ROLES:
            break
    return DERIVED_PREFIX + h.hexdigest()[:32]


def is_derived(conv: ConversationRef) -> bool:
    """A key Recap derived (the client sent none): users sharing the first messages share it."""
    return conv.key.startswith(DERIVED_PREFIX)


def _canonical(value: Any) -> str:
    try:
        return json.dumps(value, sort_keys=True)
    except (RecursionError, ValueError, TypeError):
        # Nested past what json can write back: still a stable key, just a coarser one.
        return "\x00unserialisable"


def conversation_ref(
    config: Config,
    tenant: Tenant,
    headers: Mapping[str, str],
    body: Any,
    *,
    candidates: Sequence[tuple[str, Any]] | None = None,
    messages: Sequence[Any] | None = None,
) -> ConversationRef:
    """The conversation key, always namespaced by tenant (it is part of the ref).

    In order: the configured header, `x-session-id`, any `x-*session-id` header,
    `session-id`, then what the body carries (`candidates`, the dialect's; by default
    a chat body's `metadata.conversation_id`), else a key derived from the history
    in the neutral view (`messages`, by default the body's `messages`).
    """
    fields = chat_key_fields(body) if candidates is None else candidates
    key = _sent_key(config, headers, fields)
    if key is None:
        if messages is None:
            found = body.get("messages") if isinstance(body, Mapping) else None
            messages = found if isinstance(found, list) else []
        key = _derived_key(messages)
    return ConversationRef(tenant=tenant.name, key=key)
