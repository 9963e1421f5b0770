"""Slowloris: does a crowd of slow clients lock a legitimate client out?

Outside the data path: a script that prints figures (never a test). Two servers, each in its
own process on a free 127.0.0.1 port: an upstream whose streamed answers never end
(`tests/slow.py`'s `EndlessStreams`; a request that does not stream gets a short answer) and
`python -m proxy serve` with `listen.max_connections: --max-connections` and two tenants with
the same upstream config (`max_connections: --upstream-connections` each): the open one (no
key) the attackers use, and a keyed one the legitimate client uses. Every other setting is
the default (`body_timeout_s` 20, `body_min_rate` 4096, `send_timeout_s` 60: longer than a
phase, so what keeps the client in is the bound's choice of whom to close).

Each phase runs `--clients` attackers (default: twice `--max-connections`), each on its own
socket and thread, reconnecting as soon as the proxy closes it, as a real slowloris does:

    bodies    complete headers (`Content-Length: 100000`), then a body byte every 1-2 s
    streams   a streamed chat request (the open tenant), never read (a 4 KB receive buffer)
    mixed     half of each

After `--warmup-s`, a legitimate client (the keyed tenant) sends a small chat request every
50 ms for `--duration-s`, each on a new connection (the hard case: it must get a slot), and
the figure is its latency (p50, p99, max) and its failures; the `none` phase, with no
attacker, is the baseline of the same run. Target: p99 under 1 s and no failure under each
attack.

`--recap-root DIR` runs the proxy from another checkout (the revision before the deadlines:
`git archive ce59ff6 | tar -x -C /tmp/base`), for before/after figures with one harness.

Usage (from the repository root):
    python -m benchmarks.slowloris [--max-connections 64] [--duration-s 10] [--warmup-s 3]
        [--phases none,bodies,streams,mixed] [--recap-root DIR] [--json PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from benchmarks.harness import (
    REPO,
    BenchError,
    fake_command,
    free_port,
    git_revision,
    markdown_table,
    percentile,
    running,
    serve_app,
    write_config,
)
from tests.slow import EndlessStreams, chat_head, stream_request

TARGET_P99_MS = 1000.0
LEGIT_KEY = "sk-slowloris-legit"
LEGIT_EVERY_S = 0.050
PHASES = ("none", "bodies", "streams", "mixed")


def slowloris_config(upstream: str, workdir: Path, args: argparse.Namespace) -> Path:
    same = {
        "base_url": upstream + "/v1",
        "timeout_s": 30,
        "connect_timeout_s": 5,
        "max_connections": args.upstream_connections,
    }
    data = {
        "listen": {"max_connections": args.max_connections},
        "store": f"sqlite:///{workdir / 'recap.db'}",
        "tenants": {
            "open": {"api_keys": [], "upstream": same},
            "legit": {"api_keys": [LEGIT_KEY], "upstream": same},
        },
    }
    return write_config(workdir / "recap.yaml", data)


def recap_command(root: Path | None, config: Path, port: int) -> list[str]:
    serve = ["serve", "--host", "127.0.0.1", "--log-format", "json", "--config", str(config)]
    serve += ["--port", str(port)]
    if root is None:
        return [sys.executable, "-m", "proxy", *serve]
    boot = f"import sys; sys.path.insert(0, {str(root)!r}); from proxy.ops.cli import main; "
    return [sys.executable, "-c", boot + "sys.exit(main(sys.argv[1:]))", *serve]


# -- the attackers ---------------------------------------------------------------------------


class Attacker(threading.Thread):
    """One slow client, reconnecting whenever the proxy closes it."""

    def __init__(self, host: str, port: int, kind: str, stop: threading.Event, seed: int) -> None:
        super().__init__(daemon=True)
        self.address = (host, port)
        self.kind = kind
        self.stop = stop
        self.rng = random.Random(seed)
        self.closed_by_proxy = 0

    def _open(self) -> socket.socket | None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.settimeout(5)
        try:
            sock.connect(self.address)
            if self.kind == "bodies":
                sock.sendall(chat_head(100_000) + b"{")
            else:
                sock.sendall(stream_request())
        except OSError:
            sock.close()
            return None
        return sock

    def _gone(self, sock: socket.socket) -> bool:
        """Closed by the proxy: EOF, a reset, or (a body trickler) an answer, its 408. A
        stream's data waiting unread is only peeked at, never read."""
        try:
            data = sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except BlockingIOError:
            return False
        except OSError:
            return True
        return data == b"" or self.kind == "bodies"

    def run(self) -> None:
        while not self.stop.is_set():
            sock = self._open()
            if sock is None:
                self.stop.wait(0.1)
                continue
            try:
                while not self.stop.wait(self.rng.uniform(1.0, 2.0)):
                    if self._gone(sock):
                        self.closed_by_proxy += 1
                        break
                    if self.kind == "bodies":
                        try:
                            sock.send(b" ")
                        except OSError:
                            self.closed_by_proxy += 1
                            break
            finally:
                sock.close()


# -- the legitimate client -------------------------------------------------------------------


@dataclass
class Phase:
    attack: str
    attackers: int
    requests: int
    failures: int
    p50_ms: float
    p99_ms: float
    max_ms: float
    closed_attackers: int
    first_failure: str = ""


def legit(base: str, duration_s: float) -> tuple[list[float], list[str]]:
    """Latencies (ms) of successful requests, and the failures' reasons."""
    body = {"model": "m", "messages": [{"role": "user", "content": "What is on today?"}]}
    headers = {"authorization": f"Bearer {LEGIT_KEY}"}
    latencies: list[float] = []
    failures: list[str] = []
    # No keep-alive: every request needs a slot of its own, as a new client's would.
    limits = httpx.Limits(max_keepalive_connections=0)
    end = time.monotonic() + duration_s
    with httpx.Client(trust_env=False, timeout=30, limits=limits) as client:
        while time.monotonic() < end:
            start = time.perf_counter()
            try:
                r = client.post(base + "/v1/chat/completions", json=body, headers=headers)
                if r.status_code == 200:
                    latencies.append((time.perf_counter() - start) * 1000)
                else:
                    failures.append(f"status {r.status_code}")
            except httpx.HTTPError as exc:
                failures.append(type(exc).__name__)
            time.sleep(max(0.0, LEGIT_EVERY_S - (time.perf_counter() - start)))
    return latencies, failures


def one_phase(base: str, attack: str, args: argparse.Namespace) -> Phase:
    host, port = base.removeprefix("http://").split(":")
    stop = threading.Event()
    kinds: list[str] = []
    if attack == "bodies":
        kinds = ["bodies"] * args.clients
    elif attack == "streams":
        kinds = ["streams"] * args.clients
    elif attack == "mixed":
        kinds = ["bodies", "streams"] * (args.clients // 2)
    attackers = [Attacker(host, int(port), k, stop, i) for i, k in enumerate(kinds)]
    for a in attackers:
        a.start()
    try:
        if attackers:
            time.sleep(args.warmup_s)
        latencies, failures = legit(base, args.duration_s)
    finally:
        stop.set()
        for a in attackers:
            a.join(timeout=10)
        time.sleep(1.0)  # let the proxy see the attackers go before the next phase
    return Phase(
        attack,
        len(attackers),
        len(latencies) + len(failures),
        len(failures),
        percentile(latencies, 50),
        percentile(latencies, 99),
        max(latencies, default=float("nan")),
        sum(a.closed_by_proxy for a in attackers),
        failures[0] if failures else "",
    )


def run(args: argparse.Namespace, workdir: Path) -> int:
    root = Path(args.recap_root).resolve() if args.recap_root else None
    print(f"$ python -m benchmarks.slowloris {' '.join(sys.argv[1:])}")
    print(
        f"proxy from {root or REPO} (harness revision {git_revision()}); {os.cpu_count()} cores; "
        f"listen.max_connections {args.max_connections}, {args.clients} attackers a phase; "
        f"target: the legitimate client's p99 under {TARGET_P99_MS:.0f} ms, no failure\n",
        flush=True,
    )
    up_port, recap_port = free_port(), free_port()
    phases: list[Phase] = []
    with contextlib.ExitStack() as stack:
        upstream = stack.enter_context(
            running("upstream", fake_command("benchmarks.slowloris", up_port), up_port, workdir)
        )
        config = slowloris_config(upstream.url, workdir, args)
        recap = stack.enter_context(
            running("recap", recap_command(root, config, recap_port), recap_port, workdir)
        )
        for attack in args.phases:
            phases.append(one_phase(recap.url, attack, args))
            p = phases[-1]
            print(
                f"  {attack}: {p.requests} requests, {p.failures} failed, p99 {p.p99_ms:.0f} ms",
                flush=True,
            )
    base = next((p.p99_ms for p in phases if p.attack == "none"), float("nan"))
    rows = [
        (
            p.attack,
            p.attackers,
            p.requests,
            p.failures,
            f"{p.p50_ms:.1f}",
            f"{p.p99_ms:.1f}",
            f"{p.max_ms:.1f}",
            f"{p.p99_ms / base:.1f}" if base == base and base > 0 else "",
            p.closed_attackers,
            p.first_failure,
        )
        for p in phases
    ]
    header = ["attack", "attackers", "requests", "failed", "p50 ms", "p99 ms", "max ms"]
    header += ["p99 / none", "attackers closed", "first failure"]
    print()
    print(markdown_table(header, rows, "lrrrrrrrrl"))
    attacked = [p for p in phases if p.attack != "none"]
    ok = all(p.failures == 0 and p.p99_ms < TARGET_P99_MS for p in attacked)
    print(f"\n{'PASS' if ok else 'MISS'}  target: p99 under {TARGET_P99_MS:.0f} ms, no failure")
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(p) for p in phases], indent=2))
    return 0


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.slowloris", description=__doc__)
    p.add_argument("--max-connections", type=int, default=64, help="listen.max_connections")
    p.add_argument("--clients", type=int, help="attackers a phase (default: twice the bound)")
    p.add_argument("--upstream-connections", type=int, default=32, help="per tenant")
    p.add_argument("--duration-s", type=float, default=10.0, help="the client's time a phase")
    p.add_argument("--warmup-s", type=float, default=3.0, help="the attack before the client")
    p.add_argument("--phases", default=",".join(PHASES), help=f"of {', '.join(PHASES)}")
    p.add_argument("--recap-root", help="run the proxy from this checkout instead")
    p.add_argument("--workdir", help="keep configs, the database and logs here")
    p.add_argument("--json", help="write the figures here")
    p.add_argument("--serve-fake", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.phases = [x for x in args.phases.split(",") if x]
    if not args.phases or any(x not in PHASES for x in args.phases):
        p.error(f"--phases: choose from {', '.join(PHASES)}")
    if args.clients is None:
        args.clients = 2 * args.max_connections
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.serve_fake:
        serve_app(EndlessStreams(), args.port)
        return 0
    try:
        if args.workdir:
            Path(args.workdir).mkdir(parents=True, exist_ok=True)
            return run(args, Path(args.workdir).resolve())
        with tempfile.TemporaryDirectory(prefix="recap-slowloris-") as tmp:
            return run(args, Path(tmp))
    except BenchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
