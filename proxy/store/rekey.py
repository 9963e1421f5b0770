"""Re-keying an archive written with the old, partial fingerprints (schema v2).

Off the data path: run once by each backend's migration to schema v2. Archives written
before v2 keyed a message by a hash of six fields only (role, content, name, tool_calls,
tool_call_id, function_call); v2 keys it by a hash of the whole message
(`messages.fingerprint`). Every stored body is the whole message as the client sent it,
so its new key is computed from the body; the old keys are then replaced wherever they
are named: the `request` event's `messages` and `sent`, the `trim` event's `originals`,
and the chain hashes summary versions are matched by (`boundary_hash`), which are
recomputed from a request that the summary covered.

Pure: one conversation's rows in, the changes out; the backends read and write them.
Messages merged under one old key before v2 stay merged (only the first body was kept).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from proxy.history.messages import PINNED_ROLES, chain_of, fingerprint

# Event payload fields that hold lists of message fingerprints.
FINGERPRINT_LISTS = {"request": ("messages", "sent"), "trim": ("originals",)}
EVENT_TYPES = tuple(FINGERPRINT_LISTS)


@dataclass
class Rekeyed:
    """What changes in one conversation: (row id, new fingerprint), (event id, new
    payload JSON), (summary version, new boundary hash); unchanged rows are left out."""

    messages: list[tuple[int, str]] = field(default_factory=list)
    events: list[tuple[int, str]] = field(default_factory=list)
    summaries: list[tuple[int, str]] = field(default_factory=list)


def rekey(
    messages: Iterable[tuple[int, str, str]],
    events: Iterable[tuple[int, str, str]],
    summaries: Iterable[tuple[int, int, str]],
) -> Rekeyed:
    """messages: (id, fingerprint, body); events: (id, type, payload) in id order;
    summaries: (version, covered, boundary_hash)."""
    out = Rekeyed()
    new_of: dict[str, str] = {}
    roles: dict[str, Any] = {}
    for row_id, old, body in messages:
        message = json.loads(body)
        new = fingerprint(message)
        new_of[old] = new
        roles[old] = message.get("role") if isinstance(message, dict) else None
        if new != old:
            out.messages.append((row_id, new))
    wanted: dict[str, list[int]] = {}
    for version, _, boundary in summaries:
        wanted.setdefault(boundary, []).append(version)
    found: dict[str, str] = {}
    for event_id, type_, text in events:
        payload = json.loads(text)
        if not isinstance(payload, dict):
            continue
        if type_ == "request" and len(found) < len(wanted):
            old_fps = payload.get("messages")
            if isinstance(old_fps, list):
                _match_boundaries(old_fps, new_of, roles, wanted, found)
        changed = False
        for name in FINGERPRINT_LISTS.get(type_, ()):
            fps = payload.get(name)
            if isinstance(fps, list):
                renamed = [new_of.get(fp, fp) if isinstance(fp, str) else fp for fp in fps]
                changed = changed or renamed != fps
                payload[name] = renamed
        if changed:
            out.events.append((event_id, _storable(payload)))
    for boundary, versions in wanted.items():
        new_hash = found.get(boundary)
        if new_hash is not None and new_hash != boundary:
            out.summaries += [(version, new_hash) for version in versions]
    return out


def _match_boundaries(
    fps: Sequence[Any],
    new_of: dict[str, str],
    roles: dict[str, Any],
    wanted: dict[str, list[int]],
    found: dict[str, str],
) -> None:
    """Note the new chain hash of every old chain hash of this request (its client's
    messages, old keys) that is a summary boundary."""
    old_fps = [fp for fp in fps if isinstance(fp, str)]
    pinned = 0
    while pinned < len(old_fps) and roles.get(old_fps[pinned]) in PINNED_ROLES:
        pinned += 1
    body_old = old_fps[pinned:]
    old_chain = chain_of(body_old)
    if not any(h in wanted for h in old_chain):
        return
    new_chain = chain_of([new_of.get(fp, fp) for fp in body_old])
    for old_hash, new_hash in zip(old_chain, new_chain, strict=True):
        if old_hash in wanted:
            found.setdefault(old_hash, new_hash)


def _storable(payload: dict[str, Any]) -> str:
    """JSON text both databases can hold: a lone surrogate (a client's model name may
    carry one) is kept escaped, never written as the invalid UTF-8 it would be."""
    text = json.dumps(payload, ensure_ascii=False)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return json.dumps(payload)
    return text
