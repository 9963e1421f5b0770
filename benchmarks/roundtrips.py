"""Store round trips a compacting turn awaits before its first byte goes upstream.

Outside the data path: a script that prints figures (never a test). One proxy in this
process (the real app and stage list, `create_app`) over a real SQLite store in a
temporary directory, wrapped to note every call (`CountingStore`: the method, when, and
from which task), in front of the tests' fake upstream (its summarizer side answers every
summary); the fake notes when each request arrives. Each round sends one compacting turn
(a new conversation over the session trigger) and counts the store calls made by the
request's own task before the forwarded request reached the upstream: those the turn
awaited before forwarding. Twice:

    inline       the audit rows and their events awaited where a stage writes them (how
                 the proxy wrote them before the background audit writer)
    background   the app as it ships: `AuditWriter` writes them off the request path

Usage (from the repository root):
    python -m benchmarks.roundtrips [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.harness import environment
from proxy.store import SqliteStore
from proxy.store.base import ConversationRef, Deferred, Store
from tests.faults import SummarizerFake, compacting_config, history, post
from tests.servers import recap_app, serve


@dataclass(frozen=True)
class Call:
    name: str
    at: float
    task: asyncio.Task[Any] | None


def _counted(name: str) -> Callable[..., Any]:
    async def call(self: CountingStore, *args: Any, **kwargs: Any) -> Any:
        self.note(name)
        return await getattr(SqliteStore, name)(self, *args, **kwargs)

    return call


class CountingStore(SqliteStore):
    """The real SQLite store, noting each call; `inline`: the app's audit writer is not
    used (audits are awaited where they are asked for)."""

    def __init__(self, path: str, *, inline: bool) -> None:
        super().__init__(path)
        self.inline = inline
        self.calls: list[Call] = []
        self._writer: Deferred | None = None

    @property  # type: ignore[override]
    def audits(self) -> Deferred | None:
        return None if self.inline else self._writer

    @audits.setter
    def audits(self, writer: Deferred | None) -> None:
        self._writer = writer

    def note(self, name: str) -> None:
        self.calls.append(Call(name, time.monotonic(), asyncio.current_task()))

    def conversation_lock(
        self, conv: ConversationRef
    ) -> contextlib.AbstractAsyncContextManager[None]:
        @contextlib.asynccontextmanager
        async def held() -> AsyncIterator[None]:
            self.note("conversation_lock")
            async with SqliteStore.conversation_lock(self, conv):
                yield

        return held()


for _name in dir(Store):
    if _name.startswith("_") or _name in ("open", "close", "conversation_lock"):
        continue
    if asyncio.iscoroutinefunction(getattr(Store, _name)):
        setattr(CountingStore, _name, _counted(_name))


class Arrivals:
    """ASGI: the fake upstream, noting when each request arrives."""

    def __init__(self, app: SummarizerFake) -> None:
        self.app = app
        self.times: list[float] = []

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            self.times.append(time.monotonic())
        await self.app(scope, receive, send)


def one_turn(work: Path, inline: bool, key: str) -> list[str]:
    """The store calls the compacting turn awaited before it was forwarded, in order."""
    fake = Arrivals(SummarizerFake())
    with serve(fake) as upstream:
        config = compacting_config(upstream, work)
        store = CountingStore(str(work / "recap.db"), inline=inline)
        with serve(recap_app(config, store=store)) as proxy:
            before = len(store.calls)
            r = post(proxy + "/v1", history(), key)
            if r.status_code != 200 or r.headers.get("x-recap-compaction") != "session":
                raise SystemExit(f"not a compacting turn: {r.status_code} {r.headers}")
            forwarded = fake.times[-1]  # the summarizer's call(s) first, then the turn
            calls = store.calls[before:]
            mine = calls[0].task  # the turn's first store call: the session stage's read
            return [c.name for c in calls if c.task is mine and c.at < forwarded]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    print(environment())
    counts: dict[str, list[int]] = {"inline": [], "background": []}
    names: dict[str, list[str]] = {}
    for i in range(args.rounds):
        for mode in counts:
            with tempfile.TemporaryDirectory(prefix="recap-roundtrips-") as tmp:
                calls = one_turn(Path(tmp), mode == "inline", f"turn-{i}")
            counts[mode].append(len(calls))
            names[mode] = calls
    for mode, seen in counts.items():
        listed = ", ".join(names[mode])
        print(f"{mode:>10}: {max(seen)} round trips before the forward {seen}: {listed}")
    inline, background = max(counts["inline"]), max(counts["background"])
    print(f"background / inline: {background}/{inline} = {background / inline:.2f}")


if __name__ == "__main__":
    main()
