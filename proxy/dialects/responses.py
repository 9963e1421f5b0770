"""The Responses API (`POST /v1/responses`): its items <-> neutral messages.

parse groups the items of `input` into the neutral messages the planners read, each
holding the items it stands for (under `recap_items`, so its fingerprint is that of the
items and the archive keeps them whole):

    message (user, system, developer)    -> that role's message, parts mapped to chat's
    message (assistant) + the calls after it
                                         -> one assistant message with `tool_calls`
    function_call, custom_tool_call, any item with a `call_id` that is not an output
                                         -> a call of that assistant message
    function_call_output, any `*_output` with a `call_id`
                                         -> a `tool` result answering it
    reasoning, built-in tool calls, item_reference, types Recap does not know
                                         -> carried with the item that follows them

so a `reasoning` item is never separated from the item it precedes, a call never from
its output (the planners' rounds), and nothing unknown is summarised away unless its
whole message is. `instructions` is a pinned system message that render leaves where
it is (in `instructions`). A body whose history the upstream holds
(`previous_response_id`, `conversation`) is not parsed: Recap cannot see that history.

render writes each unchanged neutral message as the very items it was parsed from;
a rewritten one (a trimmed result, an attachment placeholder) as its items with the
new content; a new one (a summary) as a message item.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from proxy.dialects.base import Parsed, PassReason, SummaryCall, Unparsed
from proxy.dialects.chat import CHAT_SUMMARY, error_object, parse_json, write_json
from proxy.dialects.responses_answer import ResponsesRecorder
from proxy.errors import OPENAI_ERRORS, ErrorShape
from proxy.history.identity import chat_key_fields
from proxy.history.messages import Message

ITEMS = "recap_items"
_MESSAGE_ROLES = frozenset({"user", "assistant", "system", "developer"})
# Outputs whose `output` is text or content parts (what a placeholder may replace).
_TEXT_OUTPUTS = frozenset({"function_call_output", "custom_tool_call_output"})
# Calls whose arguments are text, and the field holding it.
_ARGUMENTS = {"function_call": "arguments", "custom_tool_call": "input"}


def kind(item: Mapping[str, Any]) -> str:
    """The item's type; a message may leave it out (EasyInputMessage)."""
    value = item.get("type")
    if isinstance(value, str):
        return value
    return "message" if "role" in item else ""


def is_call(item: Mapping[str, Any]) -> bool:
    return isinstance(item.get("call_id"), str) and not kind(item).endswith("_output")


def is_output(item: Mapping[str, Any]) -> bool:
    return kind(item).endswith("_output") and isinstance(item.get("call_id"), str)


def neutral_part(part: Any, sources: dict[int, list[Any]]) -> Any:
    """A content part as chat writes it (text, image_url, file), remembering its original."""
    if not isinstance(part, Mapping):
        return part
    t = part.get("type")
    out: dict[str, Any]
    if t in ("input_text", "output_text") and isinstance(part.get("text"), str):
        out = {"type": "text", "text": part["text"]}
    elif t == "refusal" and isinstance(part.get("refusal"), str):
        out = {"type": "refusal", "refusal": part["refusal"]}
    elif t == "input_image" and isinstance(part.get("image_url"), str):
        image: dict[str, Any] = {"url": part["image_url"]}
        if isinstance(part.get("detail"), str):
            image["detail"] = part["detail"]
        out = {"type": "image_url", "image_url": image}
    elif t == "input_file":
        keys = ("file_data", "file_id", "filename")
        out = {"type": "file", "file": {k: part[k] for k in keys if k in part}}
    else:
        return part
    sources[id(out)] = [part]
    return out


def neutral_content(content: Any, sources: dict[int, list[Any]]) -> Any:
    if isinstance(content, list):
        return [neutral_part(p, sources) for p in content]
    return content


def _call(item: Mapping[str, Any]) -> dict[str, Any]:
    name = item.get("name")
    args = item.get("arguments", item.get("input"))
    if not isinstance(args, str):
        rest = {k: v for k, v in item.items() if k not in ("type", "id", "call_id", "status")}
        args = json.dumps(rest, sort_keys=True)
    return {
        "id": item["call_id"],
        "type": "function",
        "function": {"name": name if isinstance(name, str) else kind(item), "arguments": args},
    }


def _result_content(item: Mapping[str, Any], sources: dict[int, list[Any]]) -> Any:
    if kind(item) in _TEXT_OUTPUTS and isinstance(item.get("output"), str | list):
        return neutral_content(item["output"], sources)
    # Screenshots, shell results: never rewritten, so only named.
    return f"[{kind(item)}]"


def group(items: Sequence[dict[str, Any]], sources: dict[int, list[Any]]) -> list[Message]:
    """The neutral messages of `items`, in order; each remembers its items in `sources`."""
    out: list[Message] = []
    pending: list[dict[str, Any]] = []
    # The assistant message the next calls join (none once a result or message came).
    open_call: dict[str, Any] | None = None
    for item in items:
        t = kind(item)
        if t == "message" and isinstance(item.get("role"), str):
            role = item["role"]
            m: dict[str, Any] = {
                "role": role,
                "content": neutral_content(item.get("content"), sources),
            }
            open_call = m if role == "assistant" else None
        elif is_call(item):
            if open_call is not None and not pending:
                open_call.setdefault("tool_calls", []).append(_call(item))
                open_call[ITEMS].append(item)
                continue
            m = {"role": "assistant", "content": None, "tool_calls": [_call(item)]}
            open_call = m
        elif is_output(item):
            m = {
                "role": "tool",
                "tool_call_id": item["call_id"],
                "content": _result_content(item, sources),
            }
            open_call = None
        else:
            # reasoning, built-in calls, references, unknown types: with what follows.
            pending.append(item)
            continue
        m[ITEMS] = [*pending, item]
        pending = []
        out.append(m)
    if pending:
        out.append({"role": "assistant", "content": "", ITEMS: pending})
    for made in out:
        sources[id(made)] = made[ITEMS]
    return out


def server_history_key(body: Mapping[str, Any]) -> str | None:
    """The field that makes the upstream hold the history (Recap cannot see it), if any."""
    keys = ("previous_response_id", "conversation")
    return next((k for k in keys if body.get(k) is not None), None)


class ResponsesDialect:
    name = "responses"
    history_key = "input"
    output_limit_keys: tuple[str, ...] = ("max_output_tokens",)
    # Recap's own errors, as on chat: the Responses clients read OpenAI's error object.
    errors: ErrorShape = OPENAI_ERRORS
    # The summarizer asks as a Chat Completion: every upstream that serves the Responses
    # API here (OpenAI, vLLM, ...) serves that too.
    summary_call: SummaryCall = CHAT_SUMMARY
    credential_headers: tuple[str, ...] = ("authorization",)
    # The event holding the whole response; a stream that fails ends in another, and
    # then only the end of the body waits.
    stream_end = b"event: response.completed"

    def parse(self, raw: bytes) -> Parsed | Unparsed:
        loaded = parse_json(raw)
        if isinstance(loaded, Unparsed):
            return loaded
        body, kept = loaded
        key = server_history_key(body)
        if key is not None:
            return Unparsed(PassReason.SERVER_HISTORY, f"{key} set: the upstream holds the history")
        value = body.get("input")
        if isinstance(value, str):
            items: list[Any] = [{"role": "user", "content": value}]
        elif isinstance(value, list):
            items = value
        else:
            return Unparsed(PassReason.NO_HISTORY, "input missing or neither text nor a list")
        if not all(isinstance(i, dict) for i in items):
            return Unparsed(PassReason.BAD_ITEM, "an input item is not an object")
        sources: dict[int, list[Any]] = {}
        messages: list[Message] = []
        instructions = body.get("instructions")
        if isinstance(instructions, str) and instructions:
            pinned: dict[str, Any] = {"role": "system", "content": instructions}
            sources[id(pinned)] = []  # rendered where it is: in `instructions`
            messages.append(pinned)
        messages += group(items, sources)
        return Parsed(body, messages, kept, sources)

    def render(self, parsed: Parsed, messages: Sequence[Message]) -> bytes:
        items: list[Any] = []
        for m in messages:
            original = parsed.sources.get(id(m))
            items += original if original is not None else rewritten(m, parsed.sources)
        out = dict(parsed.body)
        out["input"] = items
        return write_json(out, parsed.kept_numbers)

    def key_fields(self, body: Mapping[str, Any]) -> list[tuple[str, Any]]:
        return [("prompt_cache_key", body.get("prompt_cache_key")), *chat_key_fields(body)]

    def recorder(self, streamed: bool, encoding: str) -> ResponsesRecorder:
        return ResponsesRecorder(streamed=streamed, encoding=encoding)

    def error_event(self, body: bytes, status: int) -> bytes:
        error = error_object(body, status)["error"]
        event = {
            "type": "error",
            "code": error.get("code"),
            "message": error.get("message"),
            "param": error.get("param"),
            "sequence_number": 0,
            "error": error,
        }
        return b"event: error\ndata: " + json.dumps(event).encode() + b"\n\n"


def rewritten(m: Message, sources: Mapping[int, list[Any]]) -> list[Any]:
    """The items of a message a stage made or rewrote."""
    templates = m.get(ITEMS)
    role = m.get("role")
    if not isinstance(templates, list):
        # A message Recap made (a summary): a plain message item of its role.
        return [{"type": "message", "role": role, "content": _api_content(m, sources)}]
    calls = {
        c.get("id"): c.get("function")
        for c in m.get("tool_calls") or []
        if isinstance(c, Mapping) and isinstance(c.get("function"), Mapping)
    }
    out: list[Any] = []
    for item in templates:
        t = kind(item)
        if role == "tool" and is_output(item) and t in _TEXT_OUTPUTS:
            out.append({**item, "output": _api_content(m, sources)})
        elif role != "tool" and t == "message" and item.get("role") == role:
            out.append({**item, "content": _api_content(m, sources, item.get("content"))})
        elif t in _ARGUMENTS and isinstance(function := calls.get(item.get("call_id")), Mapping):
            # Shortened arguments (decreasing fidelity) go where the call keeps them.
            args = function.get("arguments")
            out.append({**item, _ARGUMENTS[t]: args} if isinstance(args, str) else item)
        else:
            out.append(item)
    return out


def _api_content(m: Message, sources: Mapping[int, list[Any]], was: Any = None) -> Any:
    content = m.get("content")
    if not isinstance(content, list):
        if isinstance(content, str) and isinstance(was, list):
            return [_text_part(m.get("role"), content)]
        return content
    out: list[Any] = []
    for part in content:
        original = sources.get(id(part))
        if original is not None:
            out.append(original[0])
        elif isinstance(part, Mapping) and part.get("type") == "text":
            out.append(_text_part(m.get("role"), str(part.get("text", ""))))
        else:
            out.append(part)
    return out


def _text_part(role: Any, text: str) -> dict[str, Any]:
    if role == "assistant":
        return {"type": "output_text", "text": text, "annotations": []}
    return {"type": "input_text", "text": text}
