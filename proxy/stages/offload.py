"""CPU work of large requests runs off the event loop, so no request stalls the others.

Sits around the CPU-heavy steps of the data path: parsing the body, deriving its
conversation key and encoding a rewritten body (proxy/edge/compacting.py); fingerprinting
and counting its messages (the `measure_off_loop` stage, first in the pipeline); and the
archive rows' JSON (the archive stage). Under `OFF_LOOP_BYTES` a body parses and counts in
well under a millisecond, cheaper than a hop to a worker thread (about 50 µs) would be; past
it, the work goes to `asyncio.to_thread`. In a thread the loop still needs the GIL: tiktoken
and hashlib release it, JSON is read and written in slices (`proxy.wire.longjson`), and each
text's count is bounded (`proxy.history.textcount`). What still holds it in one piece is
making or copying one huge string as a whole (joining its slices, SQLite binding it): about
20 ms for 30 MB on the reference machine (docs/benchmarks.md, loop lag).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import TypeVar

from proxy.history.measure import Measure
from proxy.history.messages import Message
from proxy.pipeline import Exchange

T = TypeVar("T")

# About 1 ms of JSON parsing or 30 ms of BPE on prose; below it, work stays on the loop.
OFF_LOOP_BYTES = 256 * 1024


async def off_loop(size: int, work: Callable[[], T]) -> T:
    """`work()`, in a worker thread when its input is `size` >= OFF_LOOP_BYTES bytes."""
    if size < OFF_LOOP_BYTES:
        return work()
    return await asyncio.to_thread(work)


class MeasureOffLoop:
    """Fingerprints and counts a large request's messages in a worker thread, first.

    The archive stage and the planners then find every fingerprint and count in the
    request's `Measure`; a small request skips this (its fingerprints and counts cost
    microseconds on the loop).
    """

    name = "measure_off_loop"

    async def __call__(self, ex: Exchange, /) -> None:
        if ex.body_bytes >= OFF_LOOP_BYTES:
            await asyncio.to_thread(_measure, ex.measure, ex.original)


def _measure(measure: Measure, messages: Sequence[Message]) -> None:
    for m in messages:
        try:
            measure.fingerprint(m)
        except (TypeError, ValueError, RecursionError):
            continue  # the archive stage meets (and reports) it; counting copes alone
    measure.total(messages)
