"""Recap builds side by side: which of two revisions adds less, measured in pairs.

Outside the data path: a script that prints figures (never a test). One fake upstream
(`benchmarks.overhead`'s, recording nothing), the bare pass-through, and one `python -m proxy
serve` per source tree given (a worktree at another revision, say), each in its own process
with its own SQLite store. Sequential requests (the 20-message agent request of
`benchmarks.agent_request`), one per target per round in rotating order, each round also sending
one straight to the upstream: "added" is a target's time minus that direct call's, per round,
then its percentile, so machine drift cancels. CPU per request is each process's from /proc
over the measured rounds.

With several APIs (`--api chat,messages`) every round sends each API's requests in turn (in
rotating order), so the APIs' ratios to the bare pass-through are measured under the same
load: one API after the other (as `benchmarks.overhead --api all` does) lets the machine's
load drift between them.

Usage (from the repository root):
    python -m benchmarks.pairs [--api chat|responses|messages[,API...]] [--mode json|stream]
        [--rounds 1000] NAME=TREE [NAME=TREE ...]
e.g. `git worktree add /tmp/old 3ba1684` and then `python -m benchmarks.pairs old=/tmp/old
new=.`; with `RECAP_PAIRS_ENV_<NAME>="K=V,K=V"` a build gets extra environment variables, with
`RECAP_PAIRS_PYTHON_<NAME>=PATH` its own interpreter (a venv with that revision's dependencies:
the old one without uvloop, say).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import httpx

from benchmarks.agent_request import Bodies
from benchmarks.harness import (
    BenchError,
    Server,
    cpu_seconds,
    fake_command,
    free_port,
    percentile,
    recap_command,
    running,
)
from benchmarks.overhead import MODULE, PATHS, recap_config, rotated, timed


@contextlib.contextmanager
def build(name: str, tree: Path, upstream: str, workdir: Path) -> Iterator[Server]:
    """`python -m proxy serve` from `tree` (its own package, not this checkout's)."""
    here = workdir / name
    here.mkdir()
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(tree)}
    for pair in filter(None, os.environ.get(f"RECAP_PAIRS_ENV_{name}", "").split(",")):
        key, _, value = pair.partition("=")
        env[key] = value
    log = here / "recap.log"
    cmd = recap_command(recap_config(upstream, "sqlite", here), port)
    cmd[0] = os.environ.get(f"RECAP_PAIRS_PYTHON_{name}", cmd[0])
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, cwd=tree, env=env, stdout=out, stderr=subprocess.STDOUT)
    server = Server(name, f"http://127.0.0.1:{port}", proc, log)
    try:
        deadline = time.monotonic() + 30
        while True:
            if proc.poll() is not None:
                raise BenchError(f"{name} exited: {server.log_tail()}")
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(server.url + "/healthz", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise BenchError(f"{name} did not start: {server.log_tail()}")
            time.sleep(0.05)
        yield server
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(20)


async def measure(
    servers: dict[str, Server], upstream: Server, apis: Sequence[str], mode: str, rounds: int
) -> None:
    bodies = {api: Bodies(api) for api in apis}
    names = list(servers)
    async with httpx.AsyncClient(timeout=30, trust_env=False) as client:
        for _ in range(50):  # warm-up
            for api in apis:
                for n in names:
                    await timed(client, servers[n].url + PATHS[api], bodies[api], mode)
        added: dict[str, dict[str, list[float]]] = {api: {n: [] for n in names} for api in apis}
        cpu = {api: dict.fromkeys(names, 0.0) for api in apis}
        for r in range(rounds):
            for api in rotated(apis, r):
                path = PATHS[api]
                direct = await timed(client, upstream.url + path, bodies[api], mode)
                for n in rotated(names, r):
                    before = cpu_seconds(servers[n].proc.pid)
                    took = await timed(client, servers[n].url + path, bodies[api], mode)
                    added[api][n].append(took - direct)
                    cpu[api][n] += cpu_seconds(servers[n].proc.pid) - before
    for api in apis:
        bare = percentile(added[api]["bare"], 50)
        print(f"{api} {mode}, {rounds} rounds of sequential requests")
        print("| target | added p50 ms | added p90 ms | vs bare | CPU ms per request |")
        print("| --- | --: | --: | --: | --: |")
        for n in names:
            p50 = percentile(added[api][n], 50)
            print(
                f"| {n} | {p50 * 1000:.2f} | {percentile(added[api][n], 90) * 1000:.2f} "
                f"| {p50 / bare:.2f}x | {cpu[api][n] / rounds * 1000:.2f} |"
            )
        print()


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--api", default="chat", help="one API, or several with commas: " + ", ".join(PATHS)
    )
    p.add_argument("--mode", choices=["json", "stream"], default="json")
    p.add_argument("--rounds", type=int, default=1000)
    p.add_argument("builds", nargs="+", metavar="NAME=TREE")
    args = p.parse_args(argv)
    apis = args.api.split(",")
    for api in apis:
        if api not in PATHS:
            p.error(f"--api: {api!r} is none of {', '.join(PATHS)}")
    if len(set(apis)) != len(apis):
        p.error("--api: an API named twice")
    trees = {}
    for spec in args.builds:
        name, _, tree = spec.partition("=")
        if not name or not tree or name == "bare":
            p.error(f"{spec!r}: expected NAME=TREE (NAME not 'bare')")
        trees[name] = Path(tree).resolve()
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        work = Path(tmp)
        up_port, bare_port = free_port(), free_port()
        upstream = stack.enter_context(
            running("upstream", fake_command(MODULE, up_port), up_port, work)
        )
        bare_cmd = [sys.executable, "-m", MODULE, "--serve-bare", "--port", str(bare_port)]
        servers = {
            "bare": stack.enter_context(
                running("bare", [*bare_cmd, "--upstream", upstream.url], bare_port, work)
            )
        }
        for name, tree in trees.items():
            servers[name] = stack.enter_context(build(name, tree, upstream.url, work))
        asyncio.run(measure(servers, upstream, apis, args.mode, args.rounds))
    return 0


if __name__ == "__main__":
    sys.exit(main())
