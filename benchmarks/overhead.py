"""What Recap adds to a model call: latency and throughput against a direct call and a bare proxy.

Outside the data path: a script that prints figures (never a test). Three servers, each in its
own process on a free 127.0.0.1 port, so that none shares an event loop or a GIL with the load
generator or with another server:

    fake upstream   the tests' fakes (`tests/fakes.py`, `tests/fake_responses.py`), recording
                    nothing: for chat a JSON completion or an SSE stream of 20 small chunks,
                    for `/v1/responses` a JSON response or OpenAI's typed SSE events (16 text
                    deltas among 24 events), with no artificial delay
    bare            the floor for this stack: a Starlette route that reads the body and forwards
                    it with one shared httpx.AsyncClient, streaming the answer back
    recap           `python -m proxy serve` with its real default stage list, a SQLite store in
                    a temporary directory, JSON logs to a file

All three run on uvicorn with the settings `proxy/ops/cli.py` uses (`benchmarks.harness`), but
the bare pass-through always on the asyncio loop and h11, as `pip install starlette httpx
uvicorn` gives it: the floor a user could write in an afternoon. Recap runs on what this
environment gives `recap serve` (uvicorn's loop="auto", its guarded h11 protocol,
`proxy/edge/serving.py`).

The request is a realistic 20-message agent history (`benchmarks.agent_request`: system
prompt, user/assistant turns, four tool calls and their results, tool schemas; about 8 KB of
JSON). Its last message carries a per-request counter, as a live agent's history grows by one
message a turn. `--api responses` sends the same history to `/v1/responses` (instructions,
message, function_call and function_call_output items, Responses tools; the upstream checks
every input as OpenAI would); `--api messages` to `/v1/messages` (system blocks, tool_use and
tool_result blocks, Messages tools, Claude Code's cache breakpoints; the upstream checks every
request as Anthropic would, `tests/fake_messages.py`); `--api all` (the default) measures chat,
Responses and Messages one after the other through the same three servers, each API with its
own table and verdicts.

Measurements, all interleaved round-robin over the targets (the starting target rotates)
so that machine noise lands on every target alike:
  * latency at concurrency 1, JSON and SSE: time to the full response, `--requests` rounds
    of one request per target per mode. "Added" latency is computed per round (target time
    minus the direct time of the same round), then its percentiles are taken: pairing
    cancels slow drifts of the machine, which a difference of two percentiles would not.
  * requests per second at `--concurrency` with streaming: `--duration-s` per target, cut
    in `--slice-s` windows that alternate between the targets.
The load generator is one process of httpx.AsyncClients; `--client fast` (the default) gives
them Recap's own upstream transport (`proxy/upstream/transport.py`), `--client httpx` httpx's.
With httpx's the load generator spends more CPU per request than either proxy (about 1.5x
Recap's; docs/benchmarks.md, "At 33843cf"), so on 2 cores the RPS mostly says what the proxy
leaves the load generator; the same client serves every target either way, so the ratios stay
like for like.
Warm-up requests are sent first and excluded. Also printed: the CPU time each process spent
per request in the throughput windows (Linux /proc; on 2 cores the load generator and the
upstream compete with the proxy, so this is the steadier view of what a request costs it), and
Recap's own `overhead_ms` (arrival to forwarding) for the c=1 rounds, from its access log.
`--profile-recap PATH` runs Recap under cProfile (its figures are then not comparable).

Usage (from the repository root):
    python -m benchmarks.overhead [--api chat|responses|messages|all] [--requests 400]
        [--concurrency 16] [--duration-s 10] [--store sqlite | postgresql://...] [--json PATH]
        [--workdir DIR] [--profile-recap PATH] [--client fast|httpx]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import platform
import shlex
import sys
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from benchmarks.agent_request import APIS, MODES, Bodies
from benchmarks.harness import (
    BenchError,
    cpu_seconds,
    environment,
    fake_command,
    free_port,
    git_revision,
    in_workdir,
    markdown_table,
    percentile,
    recap_command,
    redact,
    running,
    serve_app,
    stack,
    write_config,
)
from proxy.upstream.client import KEEPALIVE_S
from proxy.upstream.transport import FastTransport
from tests.fake_messages import Answer as MessagesAnswer
from tests.fake_messages import FakeMessages
from tests.fake_responses import Answer, FakeResponses
from tests.fakes import Reply

MODULE = "benchmarks.overhead"
TARGETS = ("direct", "bare", "recap")
ADDED_P50_MAX_RATIO = 1.3  # Recap's added p50 over the bare pass-through's
RPS_MIN_RATIO = 0.9  # Recap's streaming RPS over the bare pass-through's
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
    }
)


# -- the servers (each runs in its own process, see `main`) ----------------------------------

ANSWER = "Done: NO6JO3 now flies HAT136 on 2024-05-22 in economy, $16 charged to your visa."
USAGE = {"prompt_tokens": 2400, "completion_tokens": 20, "total_tokens": 2420}
# The Responses fake streams text in 8-character deltas: 16 of them (OpenAI: about one a token).
RESPONSES_ANSWER = ANSWER + " The new e-ticket is on its way to your email."
PATHS = {"chat": "/v1/chat/completions", "responses": "/v1/responses", "messages": "/v1/messages"}
# What the end of a complete answer looks like, per (api, mode): a marker the answer must
# contain (None: none) and the bytes it must end with.
ENDINGS: dict[tuple[str, str], tuple[bytes | None, bytes]] = {
    ("chat", "json"): (None, b"}"),
    ("chat", "stream"): (None, b"data: [DONE]\n\n"),
    ("responses", "json"): (None, b"}"),
    ("responses", "stream"): (b"event: response.completed\n", b"}\n\n"),
    ("messages", "json"): (None, b"}"),
    ("messages", "stream"): (b"event: message_stop\n", b"}\n\n"),
}


def fake_upstream() -> FakeResponses:
    """The tests' Responses fake (which serves chat too) with the Messages fake's route,
    keeping no requests: every call gets the same short answer."""
    fake = FakeResponses()
    fake.record = False
    reply = Reply(content=ANSWER, usage=USAGE)
    fake.chat = lambda body: reply
    answer = Answer(text=RESPONSES_ANSWER)
    fake.respond = lambda body: answer
    messages = FakeMessages(record=False)
    said = MessagesAnswer(text=RESPONSES_ANSWER)
    messages.respond = lambda body: said
    fake.app.router.routes.append(Route("/v1/messages", messages.serve_messages, methods=["POST"]))
    return fake


def bare_app(upstream: str) -> Starlette:
    """The floor: read the body, forward it with one shared client, stream the answer back."""

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[dict[str, httpx.AsyncClient]]:
        # The pool and timeouts of Recap's upstream client (proxy/upstream/client.py): idle
        # connections dropped before the upstream's uvicorn closes them (5 s), else a request
        # sent on one it is closing fails (a text/plain 500 from Starlette, ending the run).
        limits = httpx.Limits(
            max_connections=512, max_keepalive_connections=512, keepalive_expiry=KEEPALIVE_S
        )
        async with httpx.AsyncClient(
            timeout=httpx.Timeout(30, connect=10), limits=limits, trust_env=False
        ) as client:
            yield {"client": client}

    async def forward(request: Request) -> Response:
        client: httpx.AsyncClient = request.state.client
        body = await request.body()
        headers = [(k, v) for k, v in request.headers.items() if k not in HOP_BY_HOP]
        out = client.build_request(
            request.method, upstream + request.url.path, headers=headers, content=body
        )
        response = await client.send(out, stream=True)
        back = {
            k: v for k, v in response.headers.items() if k not in HOP_BY_HOP - {"content-length"}
        }
        return StreamingResponse(
            response.aiter_raw(),
            status_code=response.status_code,
            headers=back,
            background=BackgroundTask(response.aclose),
        )

    async def healthz(request: Request) -> Response:
        return PlainTextResponse("ok")

    return Starlette(
        routes=[Route("/healthz", healthz), Route("/v1/{path:path}", forward, methods=["POST"])],
        lifespan=lifespan,
    )


def recap_config(upstream: str, store: str, workdir: Path) -> Path:
    """A minimal config: one open tenant forwarding to the fake upstream, defaults otherwise."""
    url = f"sqlite:///{workdir / 'recap.db'}" if store == "sqlite" else store
    data = {
        "store": url,
        "tenants": {
            "default": {"api_keys": [], "upstream": {"base_url": upstream + "/v1", "timeout_s": 30}}
        },
    }
    return write_config(workdir / "recap.yaml", data)


# -- the load generator ----------------------------------------------------------------------


HEADERS = {"content-type": "application/json", "authorization": "Bearer sk-bench"}


async def timed(client: httpx.AsyncClient, url: str, bodies: Bodies, mode: str) -> float:
    """Seconds from sending the next request of `bodies` to the last byte of the answer
    (checked: complete, as ENDINGS says for its API and mode)."""
    body = bodies.next(mode)
    marker, end = ENDINGS[bodies.api, mode]
    seen = marker is None
    start = time.perf_counter()
    async with client.stream("POST", url, content=body, headers=HEADERS) as response:
        tail = b""
        async for chunk in response.aiter_raw():
            joined = tail + chunk
            seen = seen or (marker is not None and marker in joined)
            tail = joined[-64:]
    elapsed = time.perf_counter() - start
    if response.status_code != 200 or not seen or not tail.endswith(end):
        raise BenchError(f"{url} ({mode}) answered {response.status_code}, ending {tail!r}")
    return elapsed


def rotated(items: Sequence[str], n: int) -> list[str]:
    k = n % len(items)
    return [*items[k:], *items[:k]]


async def latency_rounds(
    client: httpx.AsyncClient, urls: dict[str, str], bodies: Bodies, rounds: int
) -> dict[str, dict[str, list[float]]]:
    """Concurrency 1: each round sends one request per target and mode, in rotating order."""
    times: dict[str, dict[str, list[float]]] = {m: {t: [] for t in urls} for m in MODES}
    for r in range(rounds):
        for mode in rotated(MODES, r):
            for target in rotated(list(urls), r):
                times[mode][target].append(await timed(client, urls[target], bodies, mode))
    return times


async def window(
    client: httpx.AsyncClient, url: str, bodies: Bodies, workers: int, seconds: float
) -> tuple[int, float]:
    """`workers` streaming clients for `seconds` (requests in flight then are let finish)."""
    start = time.perf_counter()
    deadline = start + seconds
    done = 0

    async def worker() -> None:
        nonlocal done
        while time.perf_counter() < deadline:
            await timed(client, url, bodies, "stream")
            done += 1

    await asyncio.gather(*(worker() for _ in range(workers)))
    return done, time.perf_counter() - start


@dataclass
class Throughput:
    rps: dict[str, float]
    # target -> process ("loadgen", "proxy", "upstream") -> CPU ms per request in its windows
    cpu_ms: dict[str, dict[str, float]]


async def throughput(
    client: httpx.AsyncClient,
    urls: dict[str, str],
    pids: dict[str, int],
    bodies: Bodies,
    args: argparse.Namespace,
) -> Throughput:
    """Requests per second per target from alternating windows, and the CPU each process spent.

    CPU per request shows what a request costs each process even when the load generator,
    not the proxy, is what saturates a 2-core machine.
    """
    done = dict.fromkeys(urls, 0)
    spent = dict.fromkeys(urls, 0.0)
    roles = {"loadgen": None, "upstream": pids["direct"]}
    cpu = {t: dict.fromkeys([*roles, "proxy"], 0.0) for t in urls}
    for n in range(max(1, math.ceil(args.duration_s / args.slice_s))):
        for target in rotated(list(urls), n):
            procs = {**roles, **({} if target == "direct" else {"proxy": pids[target]})}
            before = {role: cpu_seconds(pid) for role, pid in procs.items()}
            count, elapsed = await window(
                client, urls[target], bodies, args.concurrency, args.slice_s
            )
            for role, pid in procs.items():
                cpu[target][role] += cpu_seconds(pid) - before[role]
            done[target] += count
            spent[target] += elapsed
    return Throughput(
        rps={t: done[t] / spent[t] for t in urls},
        cpu_ms={t: {r: 1000 * c / max(done[t], 1) for r, c in cpu[t].items()} for t in urls},
    )


# -- figures ---------------------------------------------------------------------------------


@dataclass
class Figures:
    latency: dict[str, dict[str, dict[str, float]]] = field(default_factory=dict)
    rps: dict[str, float] = field(default_factory=dict)
    cpu_ms: dict[str, dict[str, float]] = field(default_factory=dict)
    # Which of Recap's requests to this API (in its log's order) were the sequential latency
    # rounds.
    recap_c1: tuple[int, int] = (0, 0)
    verdicts: list[dict[str, Any]] = field(default_factory=list)


def summarize(
    times: dict[str, dict[str, list[float]]], tp: Throughput, concurrency: int
) -> Figures:
    rps = tp.rps
    figures = Figures(rps={t: round(v, 1) for t, v in rps.items()}, cpu_ms=tp.cpu_ms)
    for mode, by_target in times.items():
        direct = by_target["direct"]
        figures.latency[mode] = {}
        for target, values in by_target.items():
            added = [a - b for a, b in zip(values, direct, strict=True)]
            figures.latency[mode][target] = {
                "n": len(values),
                "p50_ms": percentile(values, 50) * 1000,
                "p99_ms": percentile(values, 99) * 1000,
                "added_p50_ms": percentile(added, 50) * 1000,
                "added_p99_ms": percentile(added, 99) * 1000,
                # The less robust alternative, for reference: p50(target) - p50(direct).
                "p50_minus_direct_p50_ms": (percentile(values, 50) - percentile(direct, 50)) * 1000,
            }
        recap = figures.latency[mode]["recap"]["added_p50_ms"]
        limit = ADDED_P50_MAX_RATIO * figures.latency[mode]["bare"]["added_p50_ms"]
        name = f"added p50 ({mode}): recap <= {ADDED_P50_MAX_RATIO}x bare"
        figures.verdicts.append(
            {"target": name, "recap": recap, "limit": limit, "pass": recap <= limit}
        )
    limit = RPS_MIN_RATIO * rps["bare"]
    name = f"RPS stream at c={concurrency}: recap >= {RPS_MIN_RATIO}x bare"
    figures.verdicts.append(
        {"target": name, "recap": rps["recap"], "limit": limit, "pass": rps["recap"] >= limit}
    )
    return figures


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b > 0 else "n/a"


def table(figures: Figures, concurrency: int) -> str:
    header = [
        "target",
        "mode",
        "p50 ms",
        "p99 ms",
        "added p50 ms",
        "added p99 ms",
        "added p50 vs bare",
        f"RPS c={concurrency} stream",
        "RPS vs bare",
    ]
    rows = []
    for target in TARGETS:
        for mode in MODES:
            f = figures.latency[mode][target]
            bare = figures.latency[mode]["bare"]["added_p50_ms"]
            added = (
                ["—", "—", "—"]
                if target == "direct"
                else [
                    f"{f['added_p50_ms']:.2f}",
                    f"{f['added_p99_ms']:.2f}",
                    ratio(f["added_p50_ms"], bare),
                ]
            )
            rps = f"{figures.rps[target]:.0f}" if mode == "stream" else ""
            rps_ratio = ratio(figures.rps[target], figures.rps["bare"]) if mode == "stream" else ""
            rows.append(
                [target, mode, f"{f['p50_ms']:.2f}", f"{f['p99_ms']:.2f}", *added, rps, rps_ratio]
            )
    return markdown_table(header, rows, "llrrrrrrr")


def cpu_table(figures: Figures, concurrency: int) -> str:
    header = [f"CPU ms per request, c={concurrency} stream", "load generator", "proxy", "upstream"]
    rows = []
    for target in TARGETS:
        cpu = figures.cpu_ms[target]
        proxy = "—" if target == "direct" else f"{cpu['proxy']:.2f}"
        rows.append([target, f"{cpu['loadgen']:.2f}", proxy, f"{cpu['upstream']:.2f}"])
    return markdown_table(header, rows, "lrrr")


def recap_log_figures(log: Path, path: str, rows: tuple[int, int]) -> dict[str, float]:
    """Recap's own view of the latency rounds (c=1) to `path`: its access log's `overhead_ms`
    (time from the request's arrival to forwarding it) and `total_ms`."""
    records: list[dict[str, Any]] = []
    with contextlib.suppress(OSError), log.open(encoding="utf-8") as f:
        for line in f:
            with contextlib.suppress(ValueError):
                record = json.loads(line)
                if (
                    record.get("logger") == "recap.access"
                    and record.get("path") == path
                    and "overhead_ms" in record
                ):
                    records.append(record)
    picked = records[rows[0] : rows[1]]
    if not picked:
        return {}
    overhead = [float(r["overhead_ms"]) for r in picked]
    total = [float(r.get("total_ms", 0.0)) for r in picked]
    return {
        "requests": len(picked),
        "overhead_ms_p50": percentile(overhead, 50),
        "overhead_ms_p99": percentile(overhead, 99),
        "total_ms_p50": percentile(total, 50),
    }


# -- the run ---------------------------------------------------------------------------------


def command_line(argv: Sequence[str]) -> str:
    return " ".join([f"python -m {MODULE}", *map(shlex.quote, argv)])


def effective_command(args: argparse.Namespace) -> str:
    return (
        f"python -m benchmarks.overhead --api {args.api} --requests {args.requests} "
        f"--warmup {args.warmup} "
        f"--concurrency {args.concurrency} --duration-s {args.duration_s} "
        f"--slice-s {args.slice_s} --store {shlex.quote(redact(args.store))} "
        f"--client {args.client}"
    )


async def measure(
    api: str, urls: dict[str, str], pids: dict[str, int], args: argparse.Namespace
) -> Figures:
    """One API's figures."""
    bodies = Bodies(api)
    # The direct target and the bare one close idle connections after uvicorn's 5 s.
    limits = httpx.Limits(max_connections=args.concurrency * 2, keepalive_expiry=KEEPALIVE_S)
    transport = FastTransport(limits=limits) if args.client == "fast" else None
    async with httpx.AsyncClient(
        limits=limits, timeout=30, trust_env=False, transport=transport
    ) as client:
        print(f"{api}: warm-up: {args.warmup} rounds ...", file=sys.stderr, flush=True)
        sent = 0
        for target in urls:  # fill every pool on the path with `concurrency` connections
            count, _ = await window(
                client, urls[target], bodies, args.concurrency, min(1.0, args.slice_s)
            )
            sent += count if target == "recap" else 0
        await latency_rounds(client, urls, bodies, args.warmup)
        sent += len(MODES) * args.warmup
        print(f"{api}: latency: {args.requests} rounds at c=1 ...", file=sys.stderr, flush=True)
        times = await latency_rounds(client, urls, bodies, args.requests)
        print(
            f"{api}: throughput: {args.duration_s} s per target at c={args.concurrency} ...",
            file=sys.stderr,
            flush=True,
        )
        tp = await throughput(client, urls, pids, bodies, args)
    figures = summarize(times, tp, args.concurrency)
    figures.recap_c1 = (sent, sent + len(MODES) * args.requests)
    return figures


def apis(args: argparse.Namespace) -> list[str]:
    return list(APIS) if args.api in ("both", "all") else [args.api]


def report(api: str, figures: Figures, log: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Print one API's tables and verdicts; its figures as JSON."""
    print(f"## {api} ({PATHS[api]})\n")
    print(table(figures, args.concurrency))
    print()
    print(cpu_table(figures, args.concurrency))
    print()
    for v in figures.verdicts:
        print(
            f"{'PASS' if v['pass'] else 'MISS'}  {api}: {v['target']}: recap {v['recap']:.2f}, "
            f"limit {v['limit']:.2f}"
        )
    logged = recap_log_figures(log, PATHS[api], figures.recap_c1)
    if logged:
        print(
            f"\nrecap's access log, c=1 rounds: time from arrival to forwarding p50 "
            f"{logged['overhead_ms_p50']:.2f} ms, p99 {logged['overhead_ms_p99']:.2f} ms; "
            f"total p50 {logged['total_ms_p50']:.2f} ms"
        )
    print()
    return {
        "latency_ms": figures.latency,
        "rps_stream": figures.rps,
        "cpu_ms_per_request_stream": figures.cpu_ms,
        "verdicts": figures.verdicts,
        "recap_log": logged,
    }


def run(args: argparse.Namespace, argv: Sequence[str], workdir: Path) -> int:
    print(f"$ {command_line(argv)}")
    print(f"(all options: {effective_command(args)})")
    print(environment())
    sizes = {api: {m: len(Bodies(api).next(m)) for m in MODES} for api in apis(args)}
    described = ", ".join(f"{api} {sizes[api]['json']}" for api in apis(args))
    print(
        f"request: 20 messages, bytes of JSON: {described}; store: {redact(args.store)}\n",
        flush=True,
    )
    up_port, bare_port, recap_port = free_port(), free_port(), free_port()
    with contextlib.ExitStack() as stack_:
        upstream = stack_.enter_context(
            running("upstream", fake_command(MODULE, up_port), up_port, workdir)
        )
        bare_cmd = [sys.executable, "-m", MODULE, "--serve-bare", "--port", str(bare_port)]
        bare = stack_.enter_context(
            running("bare", [*bare_cmd, "--upstream", upstream.url], bare_port, workdir)
        )
        config = recap_config(upstream.url, args.store, workdir)
        profile = (
            ["-m", "cProfile", "-o", str(Path(args.profile_recap).resolve())]
            if args.profile_recap
            else []
        )
        recap_cmd = recap_command(config, recap_port, [*profile, "-m", "proxy"])
        recap = stack_.enter_context(running("recap", recap_cmd, recap_port, workdir))
        servers = (("direct", upstream), ("bare", bare), ("recap", recap))
        pids = {"direct": upstream.proc.pid, "bare": bare.proc.pid, "recap": recap.proc.pid}
        measured: dict[str, Figures] = {}
        for api in apis(args):
            urls = {t: s.url + PATHS[api] for t, s in servers}
            measured[api] = asyncio.run(measure(api, urls, pids, args))
    by_api = {api: report(api, figures, recap.log, args) for api, figures in measured.items()}
    print(
        "added = per-round (target - direct) latency, then its percentile; RPS from "
        f"{args.slice_s:g} s windows alternating between targets."
    )
    if args.json:
        out = {
            "command": command_line(argv),
            "options": effective_command(args),
            "revision": git_revision(),
            "python": platform.python_version(),
            "cores": os.cpu_count(),
            "stack": stack(),
            "request_bytes": sizes,
            "apis": by_api,
        }
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n", encoding="utf-8")
    return 0


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.overhead", description="Recap's added latency and throughput."
    )
    p.add_argument(
        "--api",
        choices=[*APIS, "both", "all"],
        default="all",
        help="the API measured: chat (/v1/chat/completions), responses (/v1/responses), "
        "messages (/v1/messages), or all, one after the other (default; 'both' says the same)",
    )
    p.add_argument("--requests", type=int, default=400, help="latency rounds at c=1 (default 400)")
    p.add_argument("--warmup", type=int, default=30, help="warm-up rounds, excluded (default 30)")
    p.add_argument("--concurrency", type=int, default=16, help="streaming clients (default 16)")
    p.add_argument("--duration-s", type=float, default=10.0, help="throughput seconds per target")
    p.add_argument("--slice-s", type=float, default=1.0, help="throughput window (default 1 s)")
    p.add_argument("--store", default="sqlite", help="sqlite (a temp file) or a postgresql:// URL")
    p.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    p.add_argument("--workdir", help="keep config, database and logs here (default: a temp dir)")
    p.add_argument(
        "--client",
        choices=("fast", "httpx"),
        default="fast",
        help="the load generator's transport: Recap's own (default) or httpx's",
    )
    p.add_argument(
        "--profile-recap",
        metavar="PATH",
        help="run Recap under cProfile, stats to PATH (its figures are then skewed)",
    )
    p.add_argument("--serve-fake", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--serve-bare", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    p.add_argument("--upstream", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.store != "sqlite" and not args.store.startswith(("postgresql://", "postgres://")):
        p.error("--store must be sqlite or a postgresql:// URL")
    for name in ("requests", "concurrency"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be at least 1")
    if args.duration_s <= 0 or args.slice_s <= 0 or args.warmup < 0:
        p.error("--duration-s and --slice-s must be positive, --warmup not negative")
    return args


def serve_floor(app: Any, port: int) -> None:
    """The bare pass-through on the stack `pip install starlette httpx uvicorn` gives: the
    asyncio loop and h11, whatever faster loop or parser this environment has (Recap may run on
    a faster one: the floor stays what a user writes in an afternoon)."""
    uvicorn.run(
        app,
        host="127.0.0.1",
        port=port,
        loop="asyncio",
        http="h11",
        log_config=None,
        access_log=False,
        timeout_graceful_shutdown=10,
        server_header=False,
        date_header=False,
    )


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.serve_fake:
        serve_app(fake_upstream().app, args.port)
        return 0
    if args.serve_bare:
        serve_floor(bare_app(args.upstream or ""), args.port)
        return 0
    return in_workdir(run, args, argv, "overhead")


if __name__ == "__main__":
    sys.exit(main())
