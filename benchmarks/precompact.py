"""Background pre-compaction: what a turn that needs a new summary waits, with and without it.

Outside the data path: a script that prints figures (never a test). Three servers, each in
its own process on a free 127.0.0.1 port (`benchmarks.harness`):

    fake upstream   the tests' fake (`tests/fakes.py`): answers a chat at once, a summarizer
                    call after `--summarizer-s` (default 3 s, a hosted model's time), and
                    checks every forwarded history (below)
    sync            `python -m proxy serve` with `compaction.session.precompact: false`
    ahead           the same with `precompact: true` (the default)

`--conversations` conversations (default 6) run against each proxy at the same time, each
`--turns` user turns (default 30) with `--think-s` (default 4 s) between an answer and the
next turn, as a user reads and writes; they start at seeded random times over `--ramp-s`
(default 20 s), as users do, rather than in lockstep (which would make every conversation's
summary due at the same moment). A small window makes a session summary due every few turns.

Reported per proxy: the requests on which a new summary takes effect (their
`x-recap-summary-version` differs from the turn before), and on those the proxy's time
before forwarding (`x-recap-overhead-ms`, the wait for the summarizer included): p50, p95;
summary versions stored and the share never applied to any request (made for nothing);
invalid histories the upstream saw (must be 0): a forwarded history is valid when it is the
system message, at most one summary message, then an unbroken run of one conversation's own
messages ending with a user turn (the fake cannot know which turn is newest: the suite's
invariant tests check that). Targets (issue): p50 under 0.5 s, p95 under 1 s, at most 25%
never applied.

With `--real-model` the summaries are written by the local model of `benchmarks.realmodel`
(Qwen2.5-Coder-1.5B on llama.cpp, installed by `benchmarks.realmodel.install` outside the
repository, about a minute a summary on two cores) instead of the fake's fixed text after
`--summarizer-s`: the fake still answers the agent's turns at once. The model serves one call
at a time, so both proxies at once would queue each other's calls: `--only ahead` (or `sync`)
runs one of them. The report adds the summarizer calls' own time (the audit trail's), which the
think time must exceed for a summary made in the background to be ready.

Usage (from the repository root):
    python -m benchmarks.precompact [--conversations 6] [--turns 30] [--think-s 4]
        [--real-model [--only ahead|sync] [--dir D] [--n-ctx 8192]]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import re
import sqlite3
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from benchmarks.harness import (
    environment,
    fake_command,
    free_port,
    in_workdir,
    markdown_table,
    percentile,
    recap_command,
    running,
    serve_app,
    write_config,
)
from benchmarks.realmodel.install import DEFAULT_DIR, QWEN_1_5B, ensure
from benchmarks.realmodel.run import llama_command
from tests.fakes import FakeUpstream, Reply

MODULE = "benchmarks.precompact"
MODEL = "precompact-small"
WINDOW = 6000
WORDS = [
    "flight",
    "booking",
    "seat",
    "refund",
    "change",
    "cabin",
    "baggage",
    "payment",
    "upgrade",
    "itinerary",
    "gate",
]
TAG = re.compile(r"^\[c(\d+) ([ua])(\d+)\]")


# -- the fake upstream (its own process) -----------------------------------------------------


@dataclass
class Checked:
    histories: int = 0
    invalid: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)


def valid(messages: Sequence[Any]) -> bool:
    """System, at most one summary, then one conversation's own messages in an unbroken run
    (user, assistant, user, ...) ending with a user message."""
    if not messages or messages[0].get("role") != "system":
        return False
    rest = list(messages[1:])
    if rest and "recap-summary" in str(rest[0].get("content")):
        rest = rest[1:]
    tags = [TAG.match(str(m.get("content") or "")) for m in rest]
    if not rest or any(t is None for t in tags):
        return False
    order = [(int(t[3]), t[2]) for t in tags if t is not None]
    expected = [order[0]]
    while len(expected) < len(order):
        n, kind = expected[-1]
        expected.append((n, "a") if kind == "u" else (n + 1, "u"))
    return order == expected and order[-1][1] == "u" and len({t[1] for t in tags if t}) == 1


def fake_upstream(summarizer_s: float) -> FakeUpstream:
    checked = Checked()

    def chat(body: dict[str, Any]) -> Reply:
        ok = valid(body.get("messages") or [])
        with checked.lock:
            checked.histories += 1
            checked.invalid += 0 if ok else 1
        return Reply(content="Noted.")

    async def stats(request: Request) -> Response:
        return JSONResponse({"histories": checked.histories, "invalid": checked.invalid})

    fake = FakeUpstream(record=False, routes=[Route("/stats", stats)])
    summary = "## User Goal\n" + " ".join(WORDS * 12)
    fake.chat = chat
    fake.summarize = lambda body: Reply(
        content=f"<summary>\n{summary}\n</summary>", delay_s=summarizer_s
    )
    return fake


# -- the proxies' config ---------------------------------------------------------------------


def recap_config(
    upstream: str,
    workdir: Path,
    name: str,
    precompact: bool,
    model: str | None = None,
    min_new_tokens: int = 1500,
) -> Path:
    """The proxy's config; `model`: the real model's server, as the tenant's summarizer."""
    summarizer: dict[str, Any] = {"quality_guard": False, "max_concurrency": 8}
    if model is not None:
        summarizer = {
            "quality_guard": False,
            "upstream": {"base_url": model + "/v1", "timeout_s": 900},
            "timeout_s": 900,
            "max_concurrency": 1,  # one model on two cores: calls would only queue
        }
    data = {
        "store": f"sqlite:///{workdir / (name + '.db')}",
        "models": {MODEL: {"context_window": WINDOW}},
        "tenants": {
            "default": {
                "upstream": {"base_url": upstream + "/v1", "timeout_s": 60},
                "compaction": {
                    "session": {
                        "min_new_tokens": min_new_tokens,
                        "min_saving_tokens": 300,
                        "recent_turns": 2,
                        "max_summary_chars": 1500,
                        "precompact": precompact,
                    },
                    "trim": {"enabled": False},
                },
                "summarizer": summarizer,
            }
        },
    }
    return write_config(workdir / f"{name}.yaml", data)


# -- the conversations -----------------------------------------------------------------------


@dataclass
class Figures:
    took_effect_ms: list[float] = field(default_factory=list)
    other_ms: list[float] = field(default_factory=list)
    applied: dict[str, set[int]] = field(default_factory=dict)
    errors: int = 0


def text(c: int, kind: str, i: int, words: int) -> str:
    body = " ".join(WORDS[(i * 7 + k) % len(WORDS)] for k in range(words))
    return f"[c{c} {kind}{i}] {body}"


async def conversation(
    client: httpx.AsyncClient, url: str, c: int, args: argparse.Namespace, out: Figures
) -> None:
    key = f"bench-{c}"
    await asyncio.sleep(random.Random(c).uniform(0, args.ramp_s))
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are a travel agent."}]
    last: str | None = None
    out.applied[key] = set()
    for i in range(args.turns):
        messages.append({"role": "user", "content": text(c, "u", i, 120)})
        try:
            response = await client.post(
                url,
                json={"model": MODEL, "messages": messages},
                headers={"x-conversation-id": key},
            )
        except httpx.HTTPError:
            out.errors += 1
            return
        if response.status_code != 200:
            out.errors += 1
            return
        version = response.headers.get("x-recap-summary-version")
        overhead = float(response.headers.get("x-recap-overhead-ms", "nan"))
        if version is not None:
            out.applied[key].add(int(version))
        (out.took_effect_ms if version is not None and version != last else out.other_ms).append(
            overhead
        )
        last = version
        messages.append({"role": "assistant", "content": text(c, "a", i, 100)})
        await asyncio.sleep(args.think_s)


async def drive(urls: dict[str, str], args: argparse.Namespace) -> dict[str, Figures]:
    figures = {name: Figures() for name in urls}
    # A turn may wait for a summarizer call (the sync proxy's, or a background one still
    # running): the real model's may take minutes.
    timeout = 1800 if args.real_model else 120
    async with httpx.AsyncClient(timeout=timeout, trust_env=False) as client:
        await asyncio.gather(
            *(
                conversation(client, url + "/v1/chat/completions", c, args, figures[name])
                for name, url in urls.items()
                for c in range(args.conversations)
            )
        )
    return figures


def summary_call_ms(db: Path) -> list[float]:
    """The session summaries' call times, from the audit trail (background or not)."""
    with contextlib.closing(sqlite3.connect(db)) as conn:
        rows = conn.execute(
            "SELECT duration_ms FROM compactions"
            " WHERE layer = 'session' AND outcome = 'ok' AND duration_ms IS NOT NULL"
        ).fetchall()
    return [float(ms) for (ms,) in rows]


def never_applied(db: Path, figures: Figures) -> tuple[int, int]:
    with contextlib.closing(sqlite3.connect(db)) as conn:
        rows = conn.execute("SELECT key, version FROM summary_versions").fetchall()
    unused = sum(1 for key, version in rows if version not in figures.applied.get(key, set()))
    return len(rows), unused


def run(args: argparse.Namespace, argv: Sequence[str], workdir: Path) -> int:
    print(f"$ python -m {MODULE} {' '.join(argv)}")
    print(environment())
    summarizer = "the local model" if args.real_model else f"{args.summarizer_s:g} s"
    print(
        f"{args.conversations} conversations per proxy, {args.turns} turns each, think time "
        f"{args.think_s:g} s, summarizer {summarizer}, starts over "
        f"{args.ramp_s:g} s, window {WINDOW}, min_new_tokens {args.min_new_tokens}\n",
        flush=True,
    )
    up_port = free_port()
    names = ["sync", "ahead"] if args.only is None else [args.only]
    ports = {name: free_port() for name in names}
    with contextlib.ExitStack() as stack:
        fake = ["--summarizer-s", str(args.summarizer_s)]
        upstream = stack.enter_context(
            running("upstream", fake_command(MODULE, up_port, *fake), up_port, workdir)
        )
        model = None
        if args.real_model:
            installed = ensure(Path(args.dir), QWEN_1_5B)
            llama_port = free_port()
            cmd = llama_command(installed.python, installed.model, MODEL, llama_port, args.n_ctx)
            model = stack.enter_context(
                running("llama", cmd, llama_port, workdir, ready_s=900, health="/v1/models")
            ).url
        urls = {}
        for name, port in ports.items():
            config = recap_config(
                upstream.url, workdir, name, name == "ahead", model, args.min_new_tokens
            )
            server = stack.enter_context(running(name, recap_command(config, port), port, workdir))
            urls[name] = server.url
        figures = asyncio.run(drive(urls, args))
        checked = httpx.get(upstream.url + "/stats", timeout=10).json()
    rows = []
    for name, f in figures.items():
        stored, unused = never_applied(workdir / f"{name}.db", f)
        calls = summary_call_ms(workdir / f"{name}.db")
        # A wait of half a call or more: the request waited for a summarizer call.
        waited_ms = (percentile(calls, 50) if calls else 0.0) / 2
        ms = f.took_effect_ms
        rows.append(
            [
                name,
                len(ms),
                f"{percentile(ms, 50):,.0f}",
                f"{percentile(ms, 95):,.0f}",
                sum(1 for m in ms if calls and m >= waited_ms),
                f"{percentile(f.other_ms, 50):,.0f}",
                f"{percentile(calls, 50) / 1000:,.1f}" if calls else "-",
                stored,
                f"{unused / stored:.0%}" if stored else "-",
                f.errors,
            ]
        )
    print(
        markdown_table(
            [
                "proxy",
                "new summary took effect",
                "their wait p50 ms",
                "p95 ms",
                "of them waited for a call",
                "other requests p50 ms",
                "summary call p50 s",
                "versions stored",
                "never applied",
                "errors",
            ],
            rows,
            "lrrrrrrrrr",
        )
    )
    print(f"\nhistories the upstream saw: {checked['histories']}, invalid: {checked['invalid']}")
    bad = checked["invalid"] or any(f.errors for f in figures.values())
    return 1 if bad else 0


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.split("\n")[0])
    p.add_argument("--conversations", type=int, default=6, help="per proxy (default 6)")
    p.add_argument("--turns", type=int, default=30, help="user turns each (default 30)")
    p.add_argument("--think-s", type=float, default=4.0, help="between answer and next turn")
    p.add_argument("--summarizer-s", type=float, default=3.0, help="one summarizer call")
    p.add_argument("--ramp-s", type=float, default=20.0, help="conversations start over this")
    p.add_argument("--real-model", action="store_true", help="summaries by the local model")
    p.add_argument("--only", choices=("sync", "ahead"), help="run one proxy, not both")
    p.add_argument("--dir", default=str(DEFAULT_DIR), help="the real model's install directory")
    p.add_argument("--n-ctx", type=int, default=8192, help="the real model server's context")
    p.add_argument(
        "--min-new-tokens",
        type=int,
        default=1500,
        help="the session trigger (default 1500: a summary every five turns or so)",
    )
    p.add_argument("--workdir", help="keep configs, databases and logs here")
    p.add_argument("--serve-fake", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.conversations < 1 or args.turns < 1 or args.think_s < 0 or args.ramp_s < 0:
        p.error("--conversations and --turns must be positive, --think-s and --ramp-s >= 0")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.serve_fake:
        serve_app(fake_upstream(args.summarizer_s).app, args.port)
        return 0
    return in_workdir(run, args, argv, "precompact")


if __name__ == "__main__":
    sys.exit(main())
