"""A chat history in the Responses API's shape, and back. Pure.

Outside the data path: `benchmarks.overhead` and `benchmarks.replay` send the same histories
to `/v1/responses` as to `/v1/chat/completions`; this module writes them as `input` items the
way the OpenAI SDKs and Codex send them (no item ids, `store` left to the caller), and reads
what reached the upstream back into chat messages, so that the replay's figures are computed
on the same neutral form for both APIs:

    chat                                      Responses
    system message, first                     `instructions`
    system/developer message, later           a message item of that role
    user message (text)                       {"role": "user", "content": TEXT}
    assistant text                            a message item, one `output_text` part
    assistant tool_calls (after its text)     one `function_call` item per call
    tool message                              a `function_call_output` item

Back (`to_chat`), a `function_call_output` gets the `name` of the call it answers when
`name_results` (the τ-bench and generated sessions' clients name their results; the
Responses item has no such field), an assistant message item and the calls right after it
are one assistant message, and an assistant message without text has `content: None`, as in
the recorded sessions. Items this module does not write (reasoning, built-in calls) are kept
as `{"role": "opaque", "item": ...}`, so a history holding them never compares equal to a
chat one. For these sessions `to_chat(*to_input(m)) == m`
(tests/benchmarks/test_responses_shape.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

Message = dict[str, Any]
Item = dict[str, Any]


def _text(content: Any) -> str | None:
    """Chat content as one text (parts joined); None stays None."""
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            str(p.get("text", "")) for p in content if isinstance(p, Mapping) and "text" in p
        )
    return str(content)


def to_input(messages: Sequence[Mapping[str, Any]]) -> tuple[str | None, list[Item]]:
    """(instructions, input items) of a chat history."""
    instructions: str | None = None
    rest = list(messages)
    if rest and rest[0].get("role") == "system":
        instructions = _text(rest[0].get("content"))
        rest = rest[1:]
    items: list[Item] = []
    for m in rest:
        role = m.get("role")
        if role == "tool":
            output = m.get("content")
            items.append(
                {
                    "type": "function_call_output",
                    "call_id": m.get("tool_call_id"),
                    "output": output if isinstance(output, str) else _text(output) or "",
                }
            )
        elif role == "assistant":
            text = _text(m.get("content"))
            if text is not None:
                part = {"type": "output_text", "text": text, "annotations": []}
                items.append({"type": "message", "role": "assistant", "content": [part]})
            for call in m.get("tool_calls") or []:
                function = call.get("function") or {}
                items.append(
                    {
                        "type": "function_call",
                        "call_id": call.get("id"),
                        "name": function.get("name"),
                        "arguments": function.get("arguments") or "",
                    }
                )
        else:
            items.append({"role": role, "content": _text(m.get("content")) or ""})
    return instructions, items


def tools(chat_tools: Sequence[Mapping[str, Any]]) -> list[Item]:
    """Chat's `{"type": "function", "function": {...}}` tools as Responses function tools."""
    out: list[Item] = []
    for tool in chat_tools:
        function = tool.get("function") or {}
        out.append({"type": "function", **function})
    return out


def request_body(
    model: str, messages: Sequence[Mapping[str, Any]], **fields: Any
) -> dict[str, Any]:
    """A `/v1/responses` body for this chat history (`fields` added as they are)."""
    instructions, items = to_input(messages)
    body: dict[str, Any] = {"model": model}
    if instructions is not None:
        body["instructions"] = instructions
    body["input"] = items
    body.update(fields)
    return body


def _item_type(item: Mapping[str, Any]) -> str:
    value = item.get("type")
    if isinstance(value, str):
        return value
    return "message" if "role" in item else ""


def _call(item: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "id": item.get("call_id"),
        "type": "function",
        "function": {"name": item.get("name"), "arguments": item.get("arguments")},
    }


def to_chat(instructions: Any, items: Any, *, name_results: bool = True) -> list[Message]:
    """The chat messages a Responses request stands for (the inverse of `to_input`)."""
    out: list[Message] = []
    if isinstance(instructions, str) and instructions:
        out.append({"role": "system", "content": instructions})
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    names: dict[Any, Any] = {}
    # The assistant message the next calls join (until anything else comes).
    open_call: Message | None = None
    for item in items if isinstance(items, list) else []:
        kind = _item_type(item) if isinstance(item, Mapping) else ""
        if kind == "function_call":
            names[item.get("call_id")] = item.get("name")
            if open_call is None:
                open_call = {"role": "assistant", "content": None}
                out.append(open_call)
            open_call.setdefault("tool_calls", []).append(_call(item))
            continue
        open_call = None
        if kind == "message":
            m: Message = {"role": item.get("role"), "content": item.get("content")}
            if not isinstance(m["content"], str):
                m["content"] = _text(m["content"])
            out.append(m)
            open_call = m if m["role"] == "assistant" else None
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            result: Message = {"role": "tool", "tool_call_id": call_id}
            if name_results and call_id in names:
                result["name"] = names[call_id]
            result["content"] = item.get("output")
            out.append(result)
        else:
            out.append({"role": "opaque", "item": item})
    return out


def response(model: str, message: Mapping[str, Any]) -> dict[str, Any]:
    """A non-streamed Responses answer holding a recorded assistant message: its text as a
    message item, its calls as `function_call` items with the recorded call ids."""
    output: list[Item] = []
    text = _text(message.get("content"))
    if text is not None:
        part = {"type": "output_text", "text": text, "annotations": []}
        output.append(
            {
                "type": "message",
                "id": "msg_replay",
                "status": "completed",
                "role": "assistant",
                "content": [part],
            }
        )
    for n, item in enumerate(to_input([{"role": "assistant", **message, "content": None}])[1]):
        output.append({**item, "id": f"fc_replay_{n}", "status": "completed"})
    return {
        "id": "resp_replay",
        "object": "response",
        "status": "completed",
        "model": model,
        "output": output,
        "usage": {"input_tokens": 0, "output_tokens": 0, "total_tokens": 0},
    }


def answer_message(answer: Mapping[str, Any]) -> Message:
    """The assistant message of a Responses answer (its `output` items), as `to_chat`
    reads it: text and calls merged into one message."""
    merged: Message = {"role": "assistant", "content": None}
    for m in to_chat(None, answer.get("output") or []):
        if isinstance(m.get("content"), str):
            merged["content"] = (merged["content"] or "") + m["content"]
        merged.setdefault("tool_calls", []).extend(m.get("tool_calls") or [])
    if not merged["tool_calls"]:
        del merged["tool_calls"]
    return merged
