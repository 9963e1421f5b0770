"""Decreasing fidelity: old assistant messages cut, valid, stable; users and results untouched."""

from __future__ import annotations

import json
from typing import Any

import pytest

from proxy.history.conversation import check_history
from proxy.planning.fidelity import plan_fidelity
from proxy.planning.trim import TrimPlan, apply_trim

pytestmark = pytest.mark.quick


def history() -> list[dict[str, Any]]:
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "first request " + "u" * 9000}]
    for i in range(6):
        args = json.dumps({"path": f"src/m{i}.py", "body": "x" * 3000})
        msgs.append(
            {
                "role": "assistant",
                "content": f"step {i} " + "a" * 6000,
                "tool_calls": [
                    {
                        "id": f"c{i}",
                        "type": "function",
                        "function": {"name": "write", "arguments": args},
                    }
                ],
            }
        )
        msgs.append({"role": "tool", "tool_call_id": f"c{i}", "content": "ok " * 2000})
        msgs.append({"role": "user", "content": f"next {i} " + "u" * 5000})
    return msgs


def test_old_assistant_messages_shortened_valid_and_stable() -> None:
    msgs = history()
    protect = 10
    out = plan_fidelity(msgs, 4000, 1000, protect)
    assert out and all(i < protect and msgs[i]["role"] == "assistant" for i in out)
    view = apply_trim(msgs, TrimPlan(out))
    assert check_history(view) == []
    for i, m in out.items():
        assert len(m["content"]) <= 4000
        args = m["tool_calls"][0]["function"]["arguments"]
        assert len(args) < 1200 and "recap_shortened" in json.loads(args)  # still valid JSON
        assert msgs[i]["content"].startswith(m["content"][:50])  # the head is kept
    # Users, tool results and the protected tail are untouched; the input is not mutated.
    for i, m in enumerate(view):
        if i not in out:
            assert m is msgs[i]
    assert plan_fidelity(history(), 4000, 1000, protect) == out  # byte-stable


def test_disabled_and_short_messages() -> None:
    assert plan_fidelity(history(), 0, 0, 100) == {}
    short = [{"role": "assistant", "content": "fine"}]
    assert plan_fidelity(short, 4000, 1000, 1) == {}
