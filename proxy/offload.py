"""CPU work of large requests runs off the event loop, so no request stalls the others.

Sits around the CPU-heavy steps of the data path: parsing the body (chat.py) and counting
its messages' tokens (the `count_off_loop` stage, right after the archive stage has
fingerprinted them). Under `OFF_LOOP_BYTES` a body parses and counts in well under a
millisecond, cheaper than a hop to a worker thread (about 50 µs) would be; past it, the work
goes to `asyncio.to_thread`. tiktoken releases the GIL while it encodes, so counting in a
thread leaves the loop free; `json.loads` does not release it, but in a thread the loop
still gets the GIL back between the parser's larger steps (measured: a 30 MB body stalled
the loop 80 ms parsed on it, 50 ms parsed beside it). Each text's count is bounded too
(`proxy.textcount`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TypeVar

from proxy.pipeline import Exchange

T = TypeVar("T")

# About 1 ms of JSON parsing or 30 ms of BPE on prose; below it, work stays on the loop.
OFF_LOOP_BYTES = 256 * 1024


async def off_loop(size: int, work: Callable[[], T]) -> T:
    """`work()`, in a worker thread when its input is `size` >= OFF_LOOP_BYTES bytes."""
    if size < OFF_LOOP_BYTES:
        return work()
    return await asyncio.to_thread(work)


class CountOffLoop:
    """Counts a large request's messages in a worker thread, before any stage needs them.

    Later stages then find every count in the request's `Measure`; a small request skips
    this (its counts, if any stage needs them, cost microseconds on the loop).
    """

    name = "count_off_loop"

    async def __call__(self, ex: Exchange, /) -> None:
        if ex.body_bytes >= OFF_LOOP_BYTES:
            original = ex.original
            await asyncio.to_thread(lambda: ex.measure.total(original))
