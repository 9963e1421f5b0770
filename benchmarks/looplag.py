"""Event-loop lag while Recap handles a pathological request: does one request stall the rest?

Outside the data path: a script that prints figures (never a test). Two servers, each in its
own process on a free 127.0.0.1 port: the fake upstream of `benchmarks.overhead` (the
tests' fake) and
`python -m proxy serve` (the real default stage list, a SQLite store in a temporary
directory). While one client sends a pathological chat request, two probes run beside it:

    healthz   GET /healthz every 10 ms, one at a time; its delay is the response time
              (an idle server answers in about 1 ms, so the delay is what the loop owed)
    chat      a small chat request of another tenant every 50 ms, one at a time; that
              tenant has its own fake upstream (another process), so the figure is what
              Recap delayed it, not the big request's upstream parsing 30 MB on its loop.
              It also waits for its archive record to commit (the final bytes do), and
              SQLite has one writer: the big request's record is written first.

Each pathological case runs `--rounds` times; the figure is the worst probe delay seen while
the big request was in flight, and its p99. Target: no probe delayed more than 50 ms.

The cases (each a single user message):
    word-30mb    a 30 MB single word ("aaaa..."): one BPE piece of 30 million bytes
    prose-1.9mb  1.9 MB of ordinary English prose
    b64-8mb      8 MB of base64 text (an image pasted as text)

`--recap-root DIR` runs the proxy from another checkout (e.g. the base revision extracted
with `git archive 5725a87 | tar -x -C /tmp/base`), to print before/after figures with the
same harness.

Usage (from the repository root):
    python -m benchmarks.looplag [--rounds 2] [--cases word-30mb,prose-1.9mb,b64-8mb]
        [--recap-root DIR] [--timeout-s 120]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import os
import random
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import yaml

from benchmarks.harness import (
    REPO,
    BenchError,
    fake_command,
    free_port,
    git_revision,
    percentile,
    running,
    write_config,
)
from benchmarks.overhead import recap_config

TARGET_MS = 50.0
HEALTHZ_EVERY_S = 0.010
CHAT_EVERY_S = 0.050


def _word(size: int) -> str:
    return "a" * size


def _prose(size: int) -> str:
    rng = random.Random(7)
    words = [
        "the",
        "proxy",
        "forwards",
        "every",
        "request",
        "and",
        "keeps",
        "the",
        "history",
        "it",
        "archives",
        "lossless",
    ]
    out: list[str] = []
    n = 0
    while n < size:
        w = rng.choice(words)
        out.append(w)
        n += len(w) + 1
    return " ".join(out)[:size]


def _b64(size: int) -> str:
    rng = random.Random(7)
    return base64.b64encode(rng.randbytes(size * 3 // 4)).decode()[:size]


CASES: dict[str, Callable[[], str]] = {
    "word-30mb": lambda: _word(30_000_000),
    "prose-1.9mb": lambda: _prose(1_900_000),
    "b64-8mb": lambda: _b64(8_000_000),
}


PROBE_KEY = "sk-looplag-probe"


def looplag_config(big_upstream: str, probe_upstream: str, workdir: Path) -> Path:
    """`recap_config`'s open tenant for the big request, and the probe's own tenant."""
    config = recap_config(big_upstream, "sqlite", workdir)
    data = yaml.safe_load(config.read_text(encoding="utf-8"))
    upstream = {**data["tenants"]["default"]["upstream"], "base_url": probe_upstream + "/v1"}
    data["tenants"]["probe"] = {"api_keys": [PROBE_KEY], "upstream": upstream}
    return write_config(config, data)


def chat_body(text: str, conversation: str) -> bytes:
    return json.dumps(
        {"model": "gpt-4o", "messages": [{"role": "user", "content": text}], "user": conversation}
    ).encode()


@dataclass
class Probe:
    delays_ms: list[float] = field(default_factory=list)
    errors: int = 0


async def probe_loop(
    client: httpx.AsyncClient, call: Callable[[], object], every: float, stop: asyncio.Event
) -> Probe:
    out = Probe()
    while not stop.is_set():
        start = time.perf_counter()
        try:
            response = await call()  # type: ignore[misc]
            if response.status_code != 200:
                out.errors += 1
        except httpx.HTTPError:
            out.errors += 1
        out.delays_ms.append((time.perf_counter() - start) * 1000)
        await asyncio.sleep(max(0.0, every - (time.perf_counter() - start)))
    return out


@dataclass
class Round:
    case: str
    big_s: float
    big_status: int
    healthz: Probe
    chat: Probe


async def one_round(base: str, case: str, body: bytes, timeout: float, n: int) -> Round:
    headers = {"content-type": "application/json", "x-conversation-id": f"big-{case}-{n}"}
    async with httpx.AsyncClient(trust_env=False, timeout=timeout) as client:
        small = chat_body("What is on my calendar today?", "probe")
        # Warm the probes' connections first, so their first delay is not a connect.
        await client.get(base + "/healthz")
        probe_headers = {
            "content-type": "application/json",
            "x-conversation-id": "probe",
            "authorization": f"Bearer {PROBE_KEY}",
        }
        await client.post(base + "/v1/chat/completions", content=small, headers=headers)
        await client.post(base + "/v1/chat/completions", content=small, headers=probe_headers)
        stop = asyncio.Event()
        health = asyncio.ensure_future(
            probe_loop(client, lambda: client.get(base + "/healthz"), HEALTHZ_EVERY_S, stop)
        )
        chat = asyncio.ensure_future(
            probe_loop(
                client,
                lambda: client.post(
                    base + "/v1/chat/completions",
                    content=small,
                    headers=probe_headers,
                ),
                CHAT_EVERY_S,
                stop,
            )
        )
        await asyncio.sleep(0.2)
        start = time.perf_counter()
        try:
            response = await client.post(
                base + "/v1/chat/completions", content=body, headers=headers
            )
            status = response.status_code
        except httpx.HTTPError as exc:
            raise BenchError(f"the {case} request failed: {exc!r}") from exc
        big_s = time.perf_counter() - start
        stop.set()
        return Round(case, big_s, status, await health, await chat)


def figures(rounds: Sequence[Round]) -> dict[str, float]:
    health = [d for r in rounds for d in r.healthz.delays_ms]
    chat = [d for r in rounds for d in r.chat.delays_ms]
    return {
        "big_s": max(r.big_s for r in rounds),
        "healthz_max_ms": max(health),
        "healthz_p99_ms": percentile(health, 99),
        "healthz_n": len(health),
        "chat_max_ms": max(chat),
        "chat_p99_ms": percentile(chat, 99),
        "chat_n": len(chat),
        "errors": sum(r.healthz.errors + r.chat.errors for r in rounds),
    }


def recap_command(root: Path | None, config: Path, port: int) -> list[str]:
    serve = ["serve", "--host", "127.0.0.1", "--log-format", "json", "--config", str(config)]
    serve += ["--port", str(port)]
    if root is None:
        return [sys.executable, "-m", "proxy", *serve]
    boot = f"import sys; sys.path.insert(0, {str(root)!r}); from proxy.ops.cli import main; "
    return [sys.executable, "-c", boot + "sys.exit(main(sys.argv[1:]))", *serve]


def run(args: argparse.Namespace, workdir: Path) -> int:
    root = Path(args.recap_root).resolve() if args.recap_root else None
    print(f"$ python -m benchmarks.looplag {' '.join(sys.argv[1:])}")
    print(
        f"proxy from {root or REPO} (harness revision {git_revision()}); {os.cpu_count()} cores; "
        f"target: no probe delayed more than {TARGET_MS:.0f} ms\n",
        flush=True,
    )
    up_port, probe_port, recap_port = free_port(), free_port(), free_port()
    worst = 0.0
    with contextlib.ExitStack() as stack:
        upstream = stack.enter_context(
            running("upstream", fake_command("benchmarks.overhead", up_port), up_port, workdir)
        )
        probe_upstream = stack.enter_context(
            running(
                "probe-upstream",
                fake_command("benchmarks.overhead", probe_port),
                probe_port,
                workdir,
            )
        )
        config = looplag_config(upstream.url, probe_upstream.url, workdir)
        recap = stack.enter_context(
            running("recap", recap_command(root, config, recap_port), recap_port, workdir)
        )
        print(
            f"{'case':<12} {'big request s':>13} {'healthz max':>11} {'p99':>7} "
            f"{'chat max':>9} {'p99':>7} {'probes':>7} {'errors':>6}"
        )
        for case in args.cases:
            body = chat_body(CASES[case](), "big")
            rounds = [
                asyncio.run(one_round(recap.url, case, body, args.timeout_s, n))
                for n in range(args.rounds)
            ]
            bad = [r.big_status for r in rounds if r.big_status != 200]
            f = figures(rounds)
            worst = max(worst, f["healthz_max_ms"], f["chat_max_ms"])
            print(
                f"{case:<12} {f['big_s']:>13.2f} {f['healthz_max_ms']:>9.1f}ms "
                f"{f['healthz_p99_ms']:>5.1f}ms {f['chat_max_ms']:>7.1f}ms "
                f"{f['chat_p99_ms']:>5.1f}ms {f['healthz_n'] + f['chat_n']:>7.0f} "
                f"{f['errors']:>6.0f}" + (f"  (big request status {bad})" if bad else ""),
                flush=True,
            )
    verdict = "PASS" if worst <= TARGET_MS else "MISS"
    print(f"\n{verdict}  worst probe delay {worst:.1f} ms, limit {TARGET_MS:.0f} ms")
    return 0


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.looplag", description=__doc__)
    p.add_argument("--rounds", type=int, default=2, help="rounds per case (default 2)")
    p.add_argument(
        "--cases",
        default=",".join(CASES),
        help=f"comma-separated, of {', '.join(CASES)} (default all)",
    )
    p.add_argument("--recap-root", help="run the proxy from this checkout instead")
    p.add_argument("--timeout-s", type=float, default=120.0, help="per request (default 120)")
    args = p.parse_args(argv)
    args.cases = [c for c in args.cases.split(",") if c]
    unknown = [c for c in args.cases if c not in CASES]
    if unknown or not args.cases:
        p.error(f"unknown case(s) {unknown}; choose from {', '.join(CASES)}")
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        with tempfile.TemporaryDirectory(prefix="recap-looplag-") as tmp:
            return run(args, Path(tmp))
    except BenchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
