"""Conversations as the Anthropic Messages API holds them, for the tests and benchmarks.

`from_chat` turns a chat history (`tests.faults.history`) into a Messages request's
`system` and `messages`: every call a `tool_use` with its own id (Anthropic's are unique)
answered by a `tool_result` in the next user message, each answer that calls a tool
opening with a signed thinking block (`tests.fake_messages.signature`), and the cache
breakpoints a client such as Claude Code sets: the system prompt's last block and the last
block of the last message. `tool_loop` is one long turn of tool rounds, the shape of a
Claude Code task.
"""

from __future__ import annotations

import copy
import json
from typing import Any

from tests.fake_messages import signature

EPHEMERAL = {"type": "ephemeral"}
TOOLS: list[dict[str, Any]] = [
    {
        "name": "get_reservation_details",
        "description": "Look a reservation up by its id.",
        "input_schema": {
            "type": "object",
            "properties": {"reservation_id": {"type": "string"}},
            "required": ["reservation_id"],
        },
    },
    {
        "name": "read_file",
        "description": "Read a file of the workspace.",
        "input_schema": {
            "type": "object",
            "properties": {"path": {"type": "string"}},
            "required": ["path"],
        },
    },
]


def thinking(text: str) -> dict[str, Any]:
    return {"type": "thinking", "thinking": text, "signature": signature(text)}


def mark_last(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A copy whose last message's last block carries the cache breakpoint (a text message
    becomes one text block), as Claude Code marks the end of its history."""
    out = copy.deepcopy(messages)
    last = out[-1]
    if isinstance(last["content"], str):
        last["content"] = [{"type": "text", "text": last["content"]}]
    last["content"][-1]["cache_control"] = EPHEMERAL
    return out


def from_chat(
    chat: list[dict[str, Any]], *, think: bool = True, cache: bool = True
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(system blocks, messages) of a chat history whose first message is its system."""
    system = [{"type": "text", "text": chat[0]["content"]}]
    if cache:
        system[-1]["cache_control"] = EPHEMERAL
    messages: list[dict[str, Any]] = []
    n = 0
    open_ids: list[str] = []
    for m in chat[1:]:
        if m["role"] == "assistant" and m.get("tool_calls"):
            blocks: list[dict[str, Any]] = [thinking(f"Step {n}: look it up.")] if think else []
            if m.get("content"):
                blocks.append({"type": "text", "text": m["content"]})
            open_ids = []
            for c in m["tool_calls"]:
                n += 1
                open_ids.append(f"toolu_{n:04d}")
                blocks.append(
                    {
                        "type": "tool_use",
                        "id": open_ids[-1],
                        "name": c["function"]["name"],
                        "input": json.loads(c["function"]["arguments"]),
                    }
                )
            messages.append({"role": "assistant", "content": blocks})
        elif m["role"] == "tool":
            result = {
                "type": "tool_result",
                "tool_use_id": open_ids.pop(0),
                "content": m["content"],
            }
            if messages[-1]["role"] == "user":
                messages[-1]["content"].append(result)
            else:
                messages.append({"role": "user", "content": [result]})
        elif m["role"] == "assistant":
            messages.append(
                {"role": "assistant", "content": [{"type": "text", "text": m["content"]}]}
            )
        else:
            messages.append({"role": "user", "content": m["content"]})
    return system, mark_last(messages) if cache else messages


def tool_loop(
    rounds: int, *, result_chars: int = 600, think: bool = True, marker: str = ""
) -> list[dict[str, Any]]:
    """One turn: the user's task, then `rounds` tool rounds (read a file, get its text), each
    answer opening with its thinking; the last message is the last round's result."""
    out: list[dict[str, Any]] = [
        {"role": "user", "content": f"Review every module of the project {marker} and report."}
    ]
    for i in range(rounds):
        blocks: list[dict[str, Any]] = (
            [thinking(f"Round {i}: read the next file.")] if think else []
        )
        blocks += [
            {"type": "text", "text": f"Reading module {i}."},
            {
                "type": "tool_use",
                "id": f"toolu_loop_{i:04d}",
                "name": "read_file",
                "input": {"path": f"src/module_{i}.py"},
            },
        ]
        out.append({"role": "assistant", "content": blocks})
        body = "\n".join(f"line {j} of module {i}: value_{i}_{j} = {j * i}" for j in range(1000))
        out.append(
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": f"toolu_loop_{i:04d}",
                        "content": body[:result_chars],
                    }
                ],
            }
        )
    return out
