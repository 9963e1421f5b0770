"""Run `recap` with tracemalloc on, dumping a snapshot every few seconds (a diagnosis aid).

    python -m benchmarks.tracemem OUTDIR INTERVAL_S -- serve --config ... --port ...
    python -m benchmarks.tracemem --compare OUTDIR/snap-0003.pickle OUTDIR/snap-0020.pickle

The first form runs the proxy as `recap` would, with snapshots (`snap-NNNN.pickle`) in
OUTDIR; the second prints the allocation sites that grew most between two snapshots.
Tracing costs several times the CPU: run the load lighter than in `benchmarks.soak`.
"""

from __future__ import annotations

import sys
import threading
import time
import tracemalloc
from pathlib import Path

from proxy.ops.cli import main as recap_main


def _dump(outdir: Path, interval_s: float) -> None:
    n = 0
    while True:
        time.sleep(interval_s)
        snap = tracemalloc.take_snapshot().filter_traces(
            [tracemalloc.Filter(False, tracemalloc.__file__)]
        )
        snap.dump(str(outdir / f"snap-{n:04d}.pickle"))
        n += 1


def compare(old: str, new: str, top: int = 25) -> None:
    before = tracemalloc.Snapshot.load(old)
    after = tracemalloc.Snapshot.load(new)
    for stat in after.compare_to(before, "traceback")[:top]:
        print(f"{stat.size_diff / 1e6:+8.2f} MB {stat.count_diff:+8d} blocks")
        for line in stat.traceback.format()[-12:]:
            print("    " + line)


def main(argv: list[str]) -> int:
    if argv[:1] == ["--compare"]:
        compare(argv[1], argv[2])
        return 0
    outdir, interval, sep, *rest = argv
    assert sep == "--", "usage: OUTDIR INTERVAL_S -- recap arguments"
    Path(outdir).mkdir(parents=True, exist_ok=True)
    tracemalloc.start(12)
    threading.Thread(target=_dump, args=(Path(outdir), float(interval)), daemon=True).start()
    return recap_main(rest)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
