"""The upstream transport alone: Recap's (`proxy.upstream.transport`) against httpx's own.

Outside the data path: a script that prints figures (never a test). The fake upstream of
`benchmarks.overhead` (the tests' fakes: a JSON completion, or an SSE stream of 20 small
chunks) runs in its own process; this process is the client, sending the 8 KB agent body
(`benchmarks.agent_request`) through each transport exactly as `UpstreamClient.send` does
(`build_request`, then the transport's `handle_async_request`, the body read with
`aiter_raw`, the response closed), with the pool settings `UpstreamClient` gives it.

Measured in the same run, interleaved (blocks of requests alternate between the transports,
the first one rotating), so machine noise lands on both alike:
  * latency at concurrency 1, JSON and SSE: time to the last byte, p50 and p99;
  * CPU per request of this process (the client side: request building, the transport,
    reading the answer), at c=1 and at `--concurrency` with streaming, where RPS is also
    taken.
Ratios are fast / httpx: under 1 is better.

Usage (from the repository root):
    python -m benchmarks.transport [--requests 2000] [--concurrency 16] [--duration-s 4]
        [--loop asyncio|uvloop]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import httpx

from benchmarks.agent_request import MODES, Bodies
from benchmarks.harness import (
    environment,
    fake_command,
    free_port,
    in_workdir,
    markdown_table,
    percentile,
    running,
)
from benchmarks.overhead import ENDINGS, HEADERS
from proxy.upstream.client import KEEPALIVE_S
from proxy.upstream.transport import FastTransport

TRANSPORTS = ("httpx", "fast")
BLOCK = 50  # requests per block at c=1
WINDOW_S = 0.5  # throughput windows, alternating between the transports


def transports(max_connections: int) -> dict[str, httpx.AsyncBaseTransport]:
    """Both, with the pool `UpstreamClient` builds."""
    limits = httpx.Limits(
        max_connections=max_connections,
        max_keepalive_connections=max_connections,
        keepalive_expiry=KEEPALIVE_S,
    )
    return {
        "httpx": httpx.AsyncHTTPTransport(limits=limits, trust_env=False),
        "fast": FastTransport(limits=limits),
    }


async def one(
    builder: httpx.AsyncClient,
    transport: httpx.AsyncBaseTransport,
    url: str,
    bodies: Bodies,
    mode: str,
) -> float:
    body = bodies.next(mode)
    start = time.perf_counter()
    request = builder.build_request("POST", url, content=body, headers=HEADERS)
    response = await transport.handle_async_request(request)
    tail = b""
    try:
        async for chunk in response.aiter_raw():
            tail = (tail + chunk)[-64:]
    finally:
        await response.aclose()
    elapsed = time.perf_counter() - start
    _, end = ENDINGS["chat", mode]
    if response.status_code != 200 or not tail.endswith(end):
        raise RuntimeError(f"{url} ({mode}) answered {response.status_code}, ending {tail!r}")
    return elapsed


async def window(
    builder: httpx.AsyncClient,
    transport: httpx.AsyncBaseTransport,
    url: str,
    bodies: Bodies,
    workers: int,
) -> int:
    """`workers` streaming clients for WINDOW_S; the requests they completed."""
    deadline = time.perf_counter() + WINDOW_S
    done = 0

    async def worker() -> None:
        nonlocal done
        while time.perf_counter() < deadline:
            await one(builder, transport, url, bodies, "stream")
            done += 1

    await asyncio.gather(*(worker() for _ in range(workers)))
    return done


async def measure(url: str, args: argparse.Namespace) -> dict[str, dict[str, float]]:
    timeout = httpx.Timeout(30, connect=10)
    builder = httpx.AsyncClient(timeout=timeout, trust_env=False)
    pools = transports(args.concurrency * 2)
    bodies = Bodies("chat")
    times = {t: {m: [] for m in MODES} for t in TRANSPORTS}
    cpu = dict.fromkeys(TRANSPORTS, 0.0)
    count = dict.fromkeys(TRANSPORTS, 0)
    for transport in pools.values():  # warm-up, excluded
        for mode in MODES:
            for _ in range(20):
                await one(builder, transport, url, bodies, mode)
    blocks = max(1, args.requests // BLOCK)
    for b in range(blocks):
        order = TRANSPORTS if b % 2 == 0 else TRANSPORTS[::-1]
        for name in order:
            for mode in MODES:
                before = time.process_time()
                for _ in range(BLOCK):
                    times[name][mode].append(await one(builder, pools[name], url, bodies, mode))
                cpu[name] += time.process_time() - before
                count[name] += BLOCK
    # Throughput at c=N, streaming, in alternating windows.
    tp_done = dict.fromkeys(TRANSPORTS, 0)
    tp_wall = dict.fromkeys(TRANSPORTS, 0.0)
    tp_cpu = dict.fromkeys(TRANSPORTS, 0.0)
    for w in range(max(2, round(args.duration_s / WINDOW_S))):
        name = TRANSPORTS[w % 2]
        before, start = time.process_time(), time.perf_counter()
        tp_done[name] += await window(builder, pools[name], url, bodies, args.concurrency)
        tp_cpu[name] += time.process_time() - before
        tp_wall[name] += time.perf_counter() - start
    for transport in pools.values():
        await transport.aclose()
    await builder.aclose()
    out: dict[str, dict[str, float]] = {}
    for name in TRANSPORTS:
        out[name] = {
            **{f"{m} p50 ms": percentile(times[name][m], 50) * 1000 for m in MODES},
            **{f"{m} p99 ms": percentile(times[name][m], 99) * 1000 for m in MODES},
            "CPU ms/req c=1": 1000 * cpu[name] / count[name],
            f"RPS c={args.concurrency}": tp_done[name] / tp_wall[name],
            f"CPU ms/req c={args.concurrency}": 1000 * tp_cpu[name] / tp_done[name],
        }
    return out


def run(args: argparse.Namespace, argv: Sequence[str], workdir: Path) -> int:
    print(f"$ python -m benchmarks.transport {' '.join(argv)}")
    print(f"{environment()}; client loop: {args.loop}")
    port = free_port()
    with running("upstream", fake_command("benchmarks.overhead", port), port, workdir) as up:
        url = up.url + "/v1/chat/completions"
        if args.loop == "uvloop":
            import uvloop

            figures = uvloop.run(measure(url, args))
        else:
            figures = asyncio.run(measure(url, args))
    keys = list(figures["httpx"])
    rows = [
        [key, f"{figures['httpx'][key]:.3f}", f"{figures['fast'][key]:.3f}", ratio(key, figures)]
        for key in keys
    ]
    print(f"\n{args.requests} requests per mode and transport at c=1 (8 KB chat body)\n")
    print(markdown_table(["figure", "httpx", "fast", "fast / httpx"], rows, "lrrr"))
    return 0


def ratio(key: str, figures: dict[str, dict[str, float]]) -> str:
    base = figures["httpx"][key]
    return f"{figures['fast'][key] / base:.2f}x" if base else "n/a"


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.transport", description=__doc__)
    p.add_argument("--requests", type=int, default=2000, help="per mode and transport at c=1")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--duration-s", type=float, default=4.0, help="throughput seconds in all")
    p.add_argument("--loop", choices=["asyncio", "uvloop"], default="asyncio")
    p.add_argument("--workdir", help="keep the upstream's log here (default: a temp dir)")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    with contextlib.suppress(KeyboardInterrupt):
        return in_workdir(run, args, argv, "transport")
    return 1


if __name__ == "__main__":
    sys.exit(main())
