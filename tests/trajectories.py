"""Real agent trajectories (τ-bench airline) shaped for replay through the proxy."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

DATA = Path(__file__).resolve().parent / "data" / "taubench-airline-dev.jsonl"


def sessions() -> list[dict[str, Any]]:
    with DATA.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def chained(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Several sessions as one long conversation: the first system prompt, then every
    session's non-system messages in order (the later system prompts are dropped)."""
    out: list[dict[str, Any]] = []
    for i, row in enumerate(rows):
        msgs = row["messages"]
        out.extend(msgs if i == 0 else [m for m in msgs if m.get("role") != "system"])
    return out


def model_calls(messages: list[dict[str, Any]]) -> Iterator[int]:
    """Indices i where the recorded agent called the model with messages[:i]."""
    for i, m in enumerate(messages):
        if (
            i > 0
            and m.get("role") == "assistant"
            and messages[i - 1].get("role") in ("user", "tool")
        ):
            yield i
