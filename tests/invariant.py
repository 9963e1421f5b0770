"""The first law, checked: nothing the client sent is lost silently (issue 12.2).

Every message the client sent is in the forwarded body verbatim, or replaced by a
placeholder naming its archived original (`recap://message/<fingerprint>`), or covered
by a summary whose recorded coverage includes it: a session summary version whose
boundary hash is this request's chain hash at its boundary, or a loop working summary
whose covers hash is this request's chain hash through its last round. The coverage
is read from the proxy's own store (its SQLite file), as recorded, not inferred.
Only the last-resort fit may drop more, and then the response says how many and why.
"""

from __future__ import annotations

import random
import sqlite3
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from proxy.history.conversation import check_history
from proxy.history.messages import chain_hashes, fingerprint, is_pinned, split_pinned
from proxy.planning.framing import FRAME_OPEN, defuse
from proxy.planning.trim import ARCHIVE_SCHEME


def _rows(db: Path, sql: str, params: tuple[Any, ...]) -> list[tuple[Any, ...]]:
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
        return list(conn.execute(sql, params))


# What the store recorded: (summary, boundary_hash) per session summary version and
# (summary, turn_hash, covers_hash) per loop working summary.
Sessions = list[tuple[str, str]]
Loops = list[tuple[str, str, str]]


def recorded_coverage(db: Path, tenant: str, key: str) -> tuple[Sessions, Loops]:
    """The coverage the proxy's SQLite store recorded for one conversation."""
    sessions = _rows(
        db,
        "SELECT summary, boundary_hash FROM summary_versions WHERE tenant = ? AND key = ?",
        (tenant, key),
    )
    loops = _rows(
        db,
        "SELECT summary, turn_hash, covers_hash FROM loop_summaries WHERE tenant = ? AND key = ?",
        (tenant, key),
    )
    return [(a, b) for a, b in sessions], [(a, b, c) for a, b, c in loops]


def covered_indices(
    body: list[Any],
    forwarded: list[Any],
    sessions: Sessions,
    loops: Loops,
    chain: list[str] | None = None,
) -> set[int]:
    """Indices into `body` that a summary in `forwarded` stands for, by recorded coverage
    (`chain`: body's chain hashes, when the caller has them)."""
    chain = chain_hashes(body) if chain is None else chain
    at = {h: i for i, h in enumerate(chain)}
    covered: set[int] = set()
    for message in forwarded:
        content = message.get("content")
        if not isinstance(content, str) or FRAME_OPEN not in content:
            continue
        inside = content.split(FRAME_OPEN, 1)[1]
        found = False
        for summary, boundary in sessions:
            if boundary in at and defuse(summary.strip()) in inside:
                covered.update(range(at[boundary] + 1))
                found = True
        for summary, turn, covers in loops:
            if turn in at and covers in at and defuse(summary.strip()) in inside:
                covered.update(range(at[turn] + 1, at[covers] + 1))
                found = True
        assert found, "a summary is forwarded whose recorded coverage is not this history"
    return covered


def assert_nothing_lost(
    db: Path,
    tenant: str,
    key: str,
    sent: list[Any],
    forwarded: list[Any],
    headers: Mapping[str, str],
) -> int:
    """Fails unless the invariant holds against what the store at `db` recorded;
    returns how many messages the fit dropped."""
    sessions, loops = recorded_coverage(db, tenant, key)
    return check_nothing_lost(sent, forwarded, headers, sessions, loops)


def check_nothing_lost(
    sent: list[Any],
    forwarded: list[Any],
    headers: Mapping[str, str],
    sessions: Sessions,
    loops: Loops,
    chain: list[str] | None = None,
) -> int:
    """Fails unless the invariant holds against the recorded coverage given; returns how
    many messages the fit dropped. `chain`: the chain hashes of the body sent, when the
    caller has them (they must be `chain_hashes` of it)."""
    pinned, body = split_pinned(sent)
    assert forwarded[: len(pinned)] == pinned, "leading instructions changed"
    if check_history(sent) == []:
        assert check_history(forwarded) == [], check_history(forwarded)
    covered = covered_indices(body, forwarded, sessions, loops, chain)
    blob = repr(forwarded)
    lost: list[int] = []
    for i, m in enumerate(body):
        if is_pinned(m):
            assert m in forwarded, f"instruction {i} was not forwarded as sent"
        elif i in covered or m in forwarded or f"{ARCHIVE_SCHEME}{fingerprint(m)}" in blob:
            continue
        else:
            lost.append(i)
    dropped = int(headers.get("x-recap-dropped-messages", "0"))
    assert len(lost) <= dropped, f"messages {lost} neither sent, archived-placeholder nor covered"
    if dropped:
        assert headers.get("x-recap-dropped-reason"), "dropped without saying why"
    return dropped


# -- generated conversations ----------------------------------------------------------------

WORDS = [
    "flight",
    "seat",
    "refund",
    "change",
    "cabin",
    "baggage",
    "gate",
    "delay",
    "policy",
    "card",
    "order",
    "file",
    "path",
]


def text(rng: random.Random, words: int, tag: str) -> str:
    return f"{tag} " + " ".join(rng.choice(WORDS) for _ in range(words))


def tool_round(rng: random.Random, tag: str, n: int, size: int) -> list[dict[str, Any]]:
    ids = [f"call_{rng.randrange(3)}_{k}" for k in range(rng.choice((1, 1, 2)))]  # reused ids
    calls = [
        {"id": i, "type": "function", "function": {"name": "lookup", "arguments": f'{{"n": {n}}}'}}
        for i in ids
    ]
    out: list[dict[str, Any]] = [{"role": "assistant", "content": None, "tool_calls": calls}]
    for i in ids:
        out.append({"role": "tool", "tool_call_id": i, "content": text(rng, size, f"{tag}-r{n}")})
    return out


def conversation(
    seed: int, turns: int, tag: str, attachments: bool = False
) -> list[list[dict[str, Any]]]:
    """A conversation as the requests its client makes, each the whole history so far."""
    rng = random.Random(seed)
    history: list[dict[str, Any]] = [{"role": "system", "content": f"Agent {tag}. Follow policy."}]
    requests = []
    n = 0
    for t in range(turns):
        question = text(rng, rng.choice((5, 40, 150)), f"{tag}-u{t}")
        if attachments and rng.random() < 0.3:
            history.append({"role": "user", "content": [{"type": "text", "text": question}, IMAGE]})
        else:
            history.append({"role": "user", "content": question})
        if rng.random() < 0.15:
            history.append(
                {"role": rng.choice(("system", "developer")), "content": f"{tag} rule {t}"}
            )
        requests.append(list(history))
        for _ in range(rng.choice((0, 0, 1, 3, 6))):
            history += tool_round(rng, tag, n, rng.choice((10, 60, 200)))
            n += 1
            requests.append(list(history))
        history.append(
            {"role": "assistant", "content": text(rng, rng.choice((10, 80)), f"{tag}-a{t}")}
        )
    return requests


def sliding(request: list[dict[str, Any]], keep: int) -> list[dict[str, Any]]:
    """The client keeps only its newest `keep` messages after the turn's user message."""
    users = [i for i, m in enumerate(request) if m["role"] == "user"]
    start = users[-1] + 1
    tail = request[start:]
    cut = len(tail) - keep
    while 0 < cut < len(tail) and tail[cut]["role"] == "tool":
        cut -= 1  # never start inside a round
    return request[:start] + tail[max(cut, 0) :]


BEHAVIOURS = ["agent", "sliding", "retry", "fork", "two_users"]
# A small image part (high detail: billed by tiles, not by its base64 characters).
IMAGE = {
    "type": "image_url",
    "image_url": {"url": "data:image/png;base64," + "iVBORw0KGgo" * 8, "detail": "high"},
}


def client_requests(
    seed: int, turns: int, behaviour: str, tag: str, attachments: bool = False
) -> tuple[list[list[dict[str, Any]]], str | None]:
    """The requests a client of `behaviour` makes, and the conversation key it sends
    (None: no header, the key is derived from the system prompt and first message)."""
    requests = conversation(seed, turns, tag, attachments)
    key: str | None = tag
    if behaviour == "sliding":
        requests = [sliding(r, 5) for r in requests]
    elif behaviour == "retry":
        requests = [r for r in requests for _ in (0, 1)]
    elif behaviour == "fork":
        # Another branch of the same conversation: same opening, other rounds, same key.
        other = conversation(seed + 1, turns, tag, attachments)
        other[0][0] = requests[0][0]
        requests = requests + [[*requests[0][:2], *r[2:]] if len(r) > 1 else r for r in other]
    elif behaviour == "two_users":
        # No conversation header: both users land on the key derived from the system
        # prompt and the first user message; everything after differs.
        key = None
        other = conversation(seed + 1, turns, tag + "b", attachments)
        requests = requests + [[*requests[0][:2], *r[2:]] for r in other if len(r) > 2]
    return requests, key
