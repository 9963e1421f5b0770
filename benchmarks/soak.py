"""Load and soak: many streaming agent conversations for minutes, with compaction firing.

Outside the data path: a script that prints figures (never a test). Two servers, each in
its own process on a free 127.0.0.1 port (`benchmarks.harness`):

    fake upstream   the tests' fake (`tests/fakes.py`), recording nothing: streams each
                    answer as SSE after a fixed time to first byte (`--upstream-ttfb-ms`),
                    and answers the proxy's summarizer calls after `--summarizer-ms` with a
                    summary of about 1,500 characters
    recap           `python -m proxy serve`, a SQLite store in a temporary directory,
                    JSON logs to a file; a small context window (`--window`) so that
                    session summaries, loop working memory and trimming all fire

`--conversations` workers (default 200) each run agent conversations back to back: a
user turn, then sometimes a tool loop of several rounds with large tool results, each
request streamed and read to the end, with a think time between requests; a
conversation starts afresh after `--turns` turns, so the request mix is stationary and
memory must level off. Every `--sample-s` the proxy's RSS (/proc/PID/status), open file
descriptors (/proc/PID/fd) and its established TCP connections to the upstream
(/proc/net/tcp, matched to its sockets) are sampled.

Reported: requests and errors (any non-200 answer, missing `[DONE]`, error event or
transport error; must be 0); what compacted (the `x-recap-compaction` header, or the
progress comments of a stream that compacted); p50/p99 of the proxy's own time before
forwarding (`x-recap-overhead-ms`, compaction included), of time to first byte, and of
the added time to first byte (TTFB minus the upstream's fixed TTFB); the samples over
time, and whether RSS levelled off (its growth over the second half of the run against
the first half).

Usage (from the repository root):
    python -m benchmarks.soak [--duration-s 300] [--conversations 200] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from benchmarks.harness import (
    cpu_seconds,
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
from tests.fakes import FakeUpstream, Reply

MODULE = "benchmarks.soak"
MODEL = "soak-small"
_WORDS = (
    "flight booking seat window aisle refund change cabin economy business baggage passenger "
    "insurance payment card gift certificate airport delay cancel upgrade reservation "
    "itinerary connection layover gate boarding status confirm policy"
)
WORDS = tuple(_WORDS.split(" "))
ANSWER = "Done: the reservation is updated and the fee was charged to the card."


# -- the fake upstream (its own process) -----------------------------------------------------


def fake_upstream(ttfb_ms: float, summarizer_ms: float) -> FakeUpstream:
    """The tests' fake, keeping no requests: answers stream 10 ms apart after `ttfb_ms`,
    summaries come after `summarizer_ms`."""
    fake = FakeUpstream(record=False)
    answer = Reply(content=ANSWER, delay_s=ttfb_ms / 1000, chunk_delay_s=0.01)
    summary = "## User Goal\n" + " ".join(random.Random(1).choice(WORDS) for _ in range(220))
    summarized = Reply(
        content=f"<summary>\n{summary}\n</summary>",
        delay_s=summarizer_ms / 1000,
        usage={"prompt_tokens": 3000, "completion_tokens": 400, "total_tokens": 3400},
    )
    fake.chat = lambda body: answer
    fake.summarize = lambda body: summarized
    return fake


# -- the proxy's config ----------------------------------------------------------------------


def recap_config(upstream: str, workdir: Path, window: int) -> Path:
    """One open tenant; a small window so that every layer fires within a few turns."""
    data = {
        "store": f"sqlite:///{workdir / 'recap.db'}",
        "models": {MODEL: {"context_window": window}},
        "tenants": {
            "default": {
                "upstream": {"base_url": upstream + "/v1", "timeout_s": 60},
                "compaction": {
                    "session": {
                        "min_new_tokens": window // 3,
                        "min_saving_tokens": 300,
                        "recent_turns": 2,
                        "max_summary_chars": 2000,
                    },
                    "loop": {"loop_trigger_tool_rounds": 3, "loop_recent_tool_rounds": 2},
                    "trim": {"trim_trigger_ratio": 0.3, "trim_keep_recent": 1},
                },
                "summarizer": {"max_concurrency": 16},
            }
        },
    }
    return write_config(workdir / "recap.yaml", data)


# -- the conversations -----------------------------------------------------------------------


def sentence(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words)).capitalize() + "."


@dataclass
class Figures:
    requests: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    compaction: Counter[str] = field(default_factory=Counter)
    overhead_ms: list[float] = field(default_factory=list)
    ttfb_ms: list[float] = field(default_factory=list)
    samples: list[dict[str, float]] = field(default_factory=list)
    begun: float = 0.0
    ramp_s: float = 0.0


async def one_request(
    client: httpx.AsyncClient,
    url: str,
    messages: list[dict[str, Any]],
    key: str,
    figures: Figures,
) -> None:
    body = {"model": MODEL, "messages": messages, "stream": True}
    start = time.perf_counter()
    first: float | None = None
    tail = b""
    comments: list[bytes] = []
    try:
        async with client.stream(
            "POST",
            url,
            content=json.dumps(body).encode(),
            headers={"content-type": "application/json", "x-conversation-id": key},
        ) as r:
            async for chunk in r.aiter_raw():
                if first is None and b"data:" in chunk:
                    first = time.perf_counter()
                if chunk.startswith(b": recap") or b"\n: recap" in chunk:
                    comments.append(chunk)
                tail = (tail + chunk)[-256:]
            status = r.status_code
            headers = r.headers
    except httpx.HTTPError as exc:
        figures.errors[type(exc).__name__] += 1
        return
    figures.requests += 1
    if status != 200:
        figures.errors[f"status {status}"] += 1
    elif not tail.endswith(b"data: [DONE]\n\n") or b'"error"' in tail:
        figures.errors["stream did not end with [DONE]"] += 1
    if start - figures.begun < figures.ramp_s:
        pass  # latency is measured once every conversation has started
    elif "x-recap-overhead-ms" in headers:
        figures.overhead_ms.append(float(headers["x-recap-overhead-ms"]))
    if first is not None and start - figures.begun >= figures.ramp_s:
        figures.ttfb_ms.append((first - start) * 1000)
    # A stream that compacted started early (progress comments): no header then.
    layers = headers.get("x-recap-compaction") or ("compacted (stream)" if comments else "none")
    figures.compaction[layers] += 1


async def conversation_worker(
    n: int, url: str, args: argparse.Namespace, figures: Figures, stop_at: float
) -> None:
    # One client (one connection) per conversation, as agents have: a shared pool of 200
    # connections costs httpcore O(connections^2) per request, and the load generator,
    # not the proxy, would be what is measured.
    limits = httpx.Limits(max_connections=1, keepalive_expiry=30)
    timeout = httpx.Timeout(120, connect=30)
    # Conversations start one after the other over the ramp, as users arrive, not all in
    # the same millisecond (that burst measures a thundering herd, not the proxy).
    await asyncio.sleep(n * args.ramp_s / args.conversations)
    async with httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False) as client:
        await converse(n, client, url, args, figures, stop_at)


async def converse(
    n: int,
    client: httpx.AsyncClient,
    url: str,
    args: argparse.Namespace,
    figures: Figures,
    stop_at: float,
) -> None:
    rng = random.Random(n)
    generation = 0
    while time.monotonic() < stop_at:
        generation += 1
        key = f"soak-{n}-{generation}"
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": "You are an airline agent. " + sentence(rng, 60)}
        ]
        for turn in range(args.turns):
            if time.monotonic() >= stop_at:
                return
            messages.append({"role": "user", "content": f"Turn {turn}: " + sentence(rng, 80)})
            await one_request(client, url, messages, key, figures)
            await asyncio.sleep(rng.uniform(0, 2 * args.think_s))
            if rng.random() < 0.4:  # a tool loop of a few rounds, with large results
                for round_ in range(rng.randint(2, 6)):
                    call_id = f"call_{round_ % 2}"  # reused ids, as real clients do
                    messages.append(
                        {
                            "role": "assistant",
                            "content": None,
                            "tool_calls": [
                                {
                                    "id": call_id,
                                    "type": "function",
                                    "function": {"name": "lookup", "arguments": '{"q": 1}'},
                                }
                            ],
                        }
                    )
                    result = "\n".join(sentence(rng, 20) for _ in range(rng.randint(3, 25)))
                    messages.append({"role": "tool", "tool_call_id": call_id, "content": result})
                    await one_request(client, url, messages, key, figures)
                    await asyncio.sleep(rng.uniform(0, 2 * args.think_s))
            messages.append({"role": "assistant", "content": "Answer: " + sentence(rng, 60)})


# -- what the proxy holds --------------------------------------------------------------------


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def fds_and_upstream(pid: int, upstream_port: int) -> tuple[int, int]:
    """Open fds, and the process's established TCP connections to the upstream port."""
    inodes: set[str] = set()
    fds = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        fds += 1
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    connections = 0
    for table in ("tcp", "tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
                cols = line.split()
                remote_port = int(cols[2].rsplit(":", 1)[1], 16)
                if cols[3] == "01" and remote_port == upstream_port and cols[9] in inodes:
                    connections += 1
    return fds, connections


async def sampler(
    pids: dict[str, int], upstream_port: int, figures: Figures, every: float, stop_at: float
) -> None:
    last = cpu_now(pids)
    while True:
        await asyncio.sleep(min(every, max(0.0, stop_at - time.monotonic())))
        figures.samples.append(sample(pids, upstream_port, figures, last))
        last = cpu_now(pids)
        if time.monotonic() >= stop_at:
            return


def cpu_now(pids: dict[str, int]) -> tuple[float, dict[str, float]]:
    return time.monotonic(), {name: cpu_seconds(pid) for name, pid in pids.items()}


def sample(
    pids: dict[str, int],
    upstream_port: int,
    figures: Figures,
    last: tuple[float, dict[str, float]],
) -> dict[str, float]:
    fds, conns = fds_and_upstream(pids["proxy"], upstream_port)
    now, cpu = cpu_now(pids)
    out: dict[str, float] = {
        "t_s": round(now - figures.begun, 1),
        "requests": figures.requests,
        "rss_mb": round(rss_mb(pids["proxy"]), 1),
        "fds": fds,
        "upstream_connections": conns,
    }
    for name in pids:
        spent = cpu[name] - last[1][name]
        out[f"cpu_pct_{name}"] = round(100 * spent / max(1e-9, now - last[0]), 1)
    return out


async def soak(
    url: str, pids: dict[str, int], upstream_port: int, args: argparse.Namespace
) -> Figures:
    figures = Figures(ramp_s=args.ramp_s)
    pids = {**pids, "loadgen": os.getpid()}
    figures.begun = time.monotonic()
    stop_at = figures.begun + args.duration_s
    workers = [
        asyncio.create_task(conversation_worker(n, url, args, figures, stop_at))
        for n in range(args.conversations)
    ]
    sampling = asyncio.create_task(sampler(pids, upstream_port, figures, args.sample_s, stop_at))
    await asyncio.gather(*workers)
    await sampling
    # One last sample once the load is gone: what the proxy still holds at rest.
    rest = cpu_now(pids)
    await asyncio.sleep(5)
    figures.samples.append(sample(pids, upstream_port, figures, rest))
    return figures


# -- the report ------------------------------------------------------------------------------


def levelled_off(samples: Sequence[dict[str, float]]) -> dict[str, float]:
    """RSS growth in the first and the second half of the run (the last sample, at rest,
    is left out); it levels off when the second half grows far less than the first."""
    loaded = list(samples[:-1])
    if len(loaded) < 3:
        return {}
    mid = len(loaded) // 2
    first = loaded[mid]["rss_mb"] - loaded[0]["rss_mb"]
    second = loaded[-1]["rss_mb"] - loaded[mid]["rss_mb"]
    per_1k = 1000 * second / max(1.0, loaded[-1]["requests"] - loaded[mid]["requests"])
    return {
        "first_half_mb": round(first, 1),
        "second_half_mb": round(second, 1),
        "second_half_mb_per_1k_requests": round(per_1k, 2),
    }


def report(figures: Figures, args: argparse.Namespace) -> dict[str, Any]:
    def pct(values: list[float]) -> dict[str, float]:
        if not values:
            return {}
        return {"p50": round(percentile(values, 50), 2), "p99": round(percentile(values, 99), 2)}

    added = [t - args.upstream_ttfb_ms for t in figures.ttfb_ms]
    return {
        "requests": figures.requests,
        "errors": dict(figures.errors),
        "error_count": sum(figures.errors.values()),
        "compaction": dict(figures.compaction.most_common()),
        "overhead_ms": pct(figures.overhead_ms),
        "ttfb_ms": pct(figures.ttfb_ms),
        "added_ttfb_ms": pct(added),
        "rss": levelled_off(figures.samples),
        "max_fds": max(s["fds"] for s in figures.samples),
        "max_upstream_connections": max(s["upstream_connections"] for s in figures.samples),
        "samples": figures.samples,
    }


def print_report(out: dict[str, Any], args: argparse.Namespace) -> None:
    print(f"requests {out['requests']}, errors {out['error_count']} {out['errors'] or ''}")
    print(
        "compaction (x-recap-compaction): "
        + ", ".join(f"{k} {v}" for k, v in out["compaction"].items())
    )
    for name in ("overhead_ms", "ttfb_ms", "added_ttfb_ms"):
        f = out[name]
        if f:
            print(f"{name}: p50 {f['p50']:.2f}, p99 {f['p99']:.2f}")
    header = [
        "t (s)",
        "requests",
        "proxy RSS (MB)",
        "open fds",
        "upstream connections",
        "CPU proxy / upstream / load generator",
    ]
    rows = [
        [
            f"{s['t_s']:g}",
            s["requests"],
            f"{s['rss_mb']:.1f}",
            s["fds"],
            s["upstream_connections"],
            f"{s['cpu_pct_proxy']:.0f}% / {s['cpu_pct_upstream']:.0f}% / "
            f"{s['cpu_pct_loadgen']:.0f}%",
        ]
        for s in out["samples"]
    ]
    print("\n" + markdown_table(header, rows, "rrrrrr"))
    print("(the last row: 5 s after the load stopped)")
    rss = out["rss"]
    if rss:
        flat = rss["second_half_mb"] <= max(0.25 * rss["first_half_mb"], 10.0)
        print(
            f"\nRSS growth: first half {rss['first_half_mb']} MB, second half "
            f"{rss['second_half_mb']} MB ({rss['second_half_mb_per_1k_requests']} MB per 1,000 "
            f"requests): {'levels off' if flat else 'STILL GROWING'}"
        )
    bounded = out["max_upstream_connections"] <= args.conversations + 16
    print(
        f"max open fds {out['max_fds']}, max upstream connections "
        f"{out['max_upstream_connections']}: {'bounded' if bounded else 'UNBOUNDED'}"
    )
    print(f"errors: {'PASS' if out['error_count'] == 0 else 'FAIL'}")


# -- the run ---------------------------------------------------------------------------------


def run(args: argparse.Namespace, argv: Sequence[str], workdir: Path) -> int:
    print(f"$ python -m {MODULE} {' '.join(argv)}")
    print(environment())
    print(
        f"{args.conversations} streaming conversations for {args.duration_s:g} s (starting "
        f"over the first {args.ramp_s:g} s, latency measured after that), window "
        f"{args.window} tokens, think time ~{args.think_s:g} s, upstream TTFB "
        f"{args.upstream_ttfb_ms:g} ms, summarizer {args.summarizer_ms:g} ms\n",
        flush=True,
    )
    up_port, recap_port = free_port(), free_port()
    timing = ["--upstream-ttfb-ms", str(args.upstream_ttfb_ms)]
    timing += ["--summarizer-ms", str(args.summarizer_ms)]
    with contextlib.ExitStack() as stack_:
        upstream = stack_.enter_context(
            running("upstream", fake_command(MODULE, up_port, *timing), up_port, workdir)
        )
        config = recap_config(upstream.url, workdir, args.window)
        runner = [
            *(["-m", "cProfile", "-o", args.profile_recap] if args.profile_recap else []),
            *(
                ["-m", "benchmarks.tracemem", args.tracemalloc, str(args.sample_s), "--"]
                if args.tracemalloc
                else ["-m", "proxy"]
            ),
        ]
        # Under tracemalloc the proxy takes a minute or more to start (loading its tokenizers).
        ready_s = 300 if args.tracemalloc else 30
        recap_cmd = recap_command(config, recap_port, runner)
        recap = stack_.enter_context(
            running("recap", recap_cmd, recap_port, workdir, ready_s=ready_s)
        )
        pids = {"proxy": recap.proc.pid, "upstream": upstream.proc.pid}
        figures = asyncio.run(soak(recap.url + "/v1/chat/completions", pids, up_port, args))
    out = report(figures, args)
    print_report(out, args)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n", encoding="utf-8")
    return 0 if out["error_count"] == 0 else 1


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.soak", description=__doc__.split("\n")[0]
    )
    p.add_argument("--duration-s", type=float, default=300.0, help="how long (default 300)")
    p.add_argument("--conversations", type=int, default=200, help="concurrent (default 200)")
    p.add_argument("--turns", type=int, default=30, help="turns before a new conversation")
    p.add_argument("--think-s", type=float, default=2.0, help="mean pause between requests")
    p.add_argument("--window", type=int, default=6000, help="the model's context window")
    p.add_argument("--upstream-ttfb-ms", type=float, default=300.0)
    p.add_argument("--summarizer-ms", type=float, default=200.0)
    p.add_argument("--sample-s", type=float, default=15.0, help="sampling interval")
    p.add_argument("--ramp-s", type=float, default=10.0, help="conversations start over this long")
    p.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    p.add_argument("--workdir", help="keep config, database and logs here")
    p.add_argument("--profile-recap", metavar="PATH", help="run Recap under cProfile")
    p.add_argument(
        "--tracemalloc",
        metavar="DIR",
        help="run Recap with tracemalloc, a snapshot per sample in DIR (benchmarks/tracemem.py)",
    )
    p.add_argument("--serve-fake", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.duration_s <= 0 or args.conversations < 1 or args.turns < 1:
        p.error("--duration-s, --conversations and --turns must be positive")
    if not 0 <= args.ramp_s < args.duration_s:
        p.error("--ramp-s must be at least 0 and less than --duration-s")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.serve_fake:
        fake = fake_upstream(args.upstream_ttfb_ms, args.summarizer_ms)
        serve_app(fake.app, args.port, backlog=4096)
        return 0
    return in_workdir(run, args, argv, "soak")


if __name__ == "__main__":
    sys.exit(main())
