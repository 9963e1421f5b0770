"""A chat history in the Anthropic Messages API's shape, and back. Pure.

Outside the data path: `benchmarks.overhead` and `benchmarks.replay` send the same histories
to `/v1/messages` as to `/v1/chat/completions`; this module writes them as a Messages body the
way Claude Code sends one, and reads what reached the upstream back into chat messages, so
the replay's figures are computed on the same neutral form for every API:

    chat                                      Messages
    system message, first                     `system`: one text block, a cache breakpoint
    user message (text)                       a user message, its text as sent
    assistant text and tool_calls             an assistant message: a text block, then a
                                              `tool_use` block per call (input: the parsed
                                              arguments)
    tool messages after a call                one user message of `tool_result` blocks
    the last message                          its last block carries a cache breakpoint

Consecutive messages of one role (which the Messages API merges) are merged into one
message of blocks. Back (`to_chat`), each system block and each text block of a user
message is a message of its own, as Anthropic's prompt cache works by blocks: a summary
merged into a user message leaves the client's own block in the cached prefix. A call's
arguments come back as `json.dumps` of its input (`same_calls` compares them parsed).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

Message = dict[str, Any]
EPHEMERAL = {"type": "ephemeral"}


def tools(chat_tools: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Chat's function tools as Messages tools."""
    out = []
    for tool in chat_tools:
        f = tool.get("function") or {}
        schema = f.get("parameters") or {"type": "object"}
        out.append(
            {"name": f.get("name"), "description": f.get("description", ""), "input_schema": schema}
        )
    return out


def _args(text: Any) -> Any:
    try:
        value = json.loads(text) if isinstance(text, str) else text
    except ValueError:
        value = None
    return value if isinstance(value, dict) else {"arguments": text}


def _blocks(m: Mapping[str, Any]) -> list[dict[str, Any]]:
    role, content = m.get("role"), m.get("content")
    if role == "tool":
        result = {
            "type": "tool_result",
            "tool_use_id": m.get("tool_call_id"),
            "content": content or "",
        }
        return [result]
    out: list[dict[str, Any]] = []
    if isinstance(content, str) and content:
        out.append({"type": "text", "text": content})
    elif isinstance(content, list):
        out += [
            {"type": "text", "text": str(p.get("text", ""))}
            for p in content
            if isinstance(p, Mapping)
        ]
    for call in m.get("tool_calls") or []:
        f = call.get("function") or {}
        out.append(
            {
                "type": "tool_use",
                "id": call.get("id"),
                "name": f.get("name"),
                "input": _args(f.get("arguments")),
            }
        )
    return out


def to_body(messages: Sequence[Mapping[str, Any]]) -> tuple[list[Any] | None, list[Message]]:
    """(system blocks, messages) of a chat history."""
    rest = list(messages)
    system = None
    if rest and rest[0].get("role") == "system":
        system = [
            {"type": "text", "text": str(rest[0].get("content") or ""), "cache_control": EPHEMERAL}
        ]
        rest = rest[1:]
    out: list[Message] = []
    for m in rest:
        role = "assistant" if m.get("role") == "assistant" else "user"
        blocks = _blocks(m)
        if not blocks:
            blocks = [{"type": "text", "text": "(empty)"}]
        if out and out[-1]["role"] == role:
            previous = out[-1]["content"]
            if isinstance(previous, str):
                previous = [{"type": "text", "text": previous}]
            out[-1]["content"] = [*previous, *blocks]
        elif role == "user" and m.get("role") == "user" and isinstance(m.get("content"), str):
            out.append({"role": role, "content": m["content"]})
        else:
            out.append({"role": role, "content": blocks})
    if out:
        last = out[-1]
        if isinstance(last["content"], str):
            last["content"] = [{"type": "text", "text": last["content"]}]
        last["content"][-1] = {**last["content"][-1], "cache_control": EPHEMERAL}
    return system, out


def request_body(
    model: str, messages: Sequence[Mapping[str, Any]], **fields: Any
) -> dict[str, Any]:
    system, body_messages = to_body(messages)
    body: dict[str, Any] = {"model": model, "max_tokens": 4096, "messages": body_messages}
    if system is not None:
        body["system"] = system
    body.update(fields)
    return body


def to_chat(system: Any, messages: Any) -> list[Message]:
    """The chat messages a Messages request stands for, block by block (see the docstring)."""
    out: list[Message] = []
    if isinstance(system, str) and system:
        out.append({"role": "system", "content": system})
    for block in system if isinstance(system, list) else []:
        out.append({"role": "system", "content": block.get("text")})
    names: dict[Any, Any] = {}
    for m in messages if isinstance(messages, list) else []:
        content = m.get("content")
        if m.get("role") == "assistant":
            blocks = content if isinstance(content, list) else [{"type": "text", "text": content}]
            texts = [b.get("text", "") for b in blocks if b.get("type") == "text"]
            answer: Message = {"role": "assistant", "content": "".join(texts) if texts else None}
            calls = []
            for b in blocks:
                if b.get("type") == "tool_use":
                    names[b.get("id")] = b.get("name")
                    arguments = json.dumps(b.get("input"))
                    calls.append(
                        {
                            "id": b.get("id"),
                            "type": "function",
                            "function": {"name": b.get("name"), "arguments": arguments},
                        }
                    )
            if calls:
                answer["tool_calls"] = calls
            out.append(answer)
            continue
        if isinstance(content, str):
            out.append({"role": "user", "content": content})
            continue
        for b in content if isinstance(content, list) else []:
            if b.get("type") == "tool_result":
                result: Message = {"role": "tool", "tool_call_id": b.get("tool_use_id")}
                if b.get("tool_use_id") in names:
                    result["name"] = names[b.get("tool_use_id")]
                inner = b.get("content")
                result["content"] = inner if isinstance(inner, str) else json.dumps(inner)
                out.append(result)
            else:
                out.append({"role": "user", "content": b.get("text", f"[{b.get('type')}]")})
    return out


def response(model: str, message: Mapping[str, Any]) -> dict[str, Any]:
    """A non-streamed Messages answer holding a recorded assistant message."""
    blocks = _blocks({**message, "role": "assistant"}) or [{"type": "text", "text": ""}]
    return {
        "id": "msg_replay",
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": blocks,
        "stop_reason": "tool_use" if message.get("tool_calls") else "end_turn",
        "stop_sequence": None,
        "usage": {"input_tokens": 0, "output_tokens": 0},
    }


def answer_message(answer: Mapping[str, Any]) -> Message:
    """The assistant message of a Messages answer, as `to_chat` reads it."""
    return to_chat(None, [{"role": "assistant", "content": answer.get("content") or []}])[0]


def same_calls(a: Any, b: Any) -> bool:
    """Two messages' tool calls, their arguments compared as parsed JSON."""

    def norm(calls: Any) -> Any:
        return [
            (c.get("id"), c["function"].get("name"), _args(c["function"].get("arguments")))
            for c in calls or []
        ]

    return bool(norm(a) == norm(b))
