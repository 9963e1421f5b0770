"""Chat Completions (`POST /v1/chat/completions`): the identity adapter.

Its `messages` are the neutral view already: parse checks the body can be worked on,
render writes it back with the rewritten messages (only `messages` changes; every
other field goes through as sent), and the answer is read as chat completions or
their chunks (proxy.wire.sse).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from proxy.dialects.base import Parsed, PassReason, SummaryAnswer, SummaryCall, Unparsed
from proxy.errors import OPENAI_ERRORS, ErrorShape
from proxy.history.identity import chat_key_fields
from proxy.history.messages import Message, json_bytes
from proxy.wire import numbers
from proxy.wire.sse import AnswerRecorder


def parse_json(raw: bytes) -> tuple[dict[str, Any], bool] | Unparsed:
    """The body as a JSON object, and whether it holds numbers kept as written."""
    try:
        body, kept = numbers.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return Unparsed(PassReason.NOT_JSON, "body is not JSON")
    except RecursionError:
        return Unparsed(PassReason.NOT_JSON, "body is nested too deeply to parse")
    if not isinstance(body, dict):
        return Unparsed(PassReason.NOT_OBJECT, "body is not a JSON object")
    return body, kept


def write_json(body: dict[str, Any], kept_numbers: bool) -> bytes:
    """Deterministic serialisation: the same body gives the same bytes (prompt caches)."""
    if kept_numbers:
        return numbers.dumps(body, separators=(",", ":"))
    return json_bytes(body, separators=(",", ":"))


def error_object(body: bytes, status: int) -> dict[str, Any]:
    """The upstream's own error object when it sent one, else a generic one with its status."""
    try:
        parsed = json.loads(body)
        if isinstance(parsed, dict) and isinstance(parsed.get("error"), dict):
            return parsed
    except ValueError:
        pass
    text = body[:2000].decode("utf-8", "replace")
    return {
        "error": {
            "message": text or f"upstream status {status}",
            "type": "upstream_error",
            "param": None,
            "code": status,
        }
    }


class ChatSummaryCall:
    """The summarizer's call as a Chat Completion: a system and a user message."""

    path = "/v1/chat/completions"
    headers: Mapping[str, str] = {}

    def request(
        self, model: str, system: str, user: str, options: Mapping[str, Any]
    ) -> dict[str, Any]:
        messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
        return {"model": model, "messages": messages, "stream": False, **options}

    def credentials(self, api_key: str) -> dict[str, str]:
        return {"authorization": f"Bearer {api_key}"}

    def answer(self, data: Any) -> SummaryAnswer:
        choice = data["choices"][0]
        text = choice["message"].get("content")
        finish = choice.get("finish_reason")
        usage = data.get("usage") or {}
        model = data.get("model")
        return SummaryAnswer(
            text if isinstance(text, str) else None,
            finish if isinstance(finish, str) else None,
            int(usage.get("prompt_tokens") or 0),
            int(usage.get("completion_tokens") or 0),
            model if isinstance(model, str) and model else None,
        )


CHAT_SUMMARY: SummaryCall = ChatSummaryCall()


class ChatDialect:
    name = "chat"
    history_key = "messages"
    output_limit_keys: tuple[str, ...] = ("max_completion_tokens", "max_tokens")
    errors: ErrorShape = OPENAI_ERRORS
    summary_call: SummaryCall = CHAT_SUMMARY
    credential_headers: tuple[str, ...] = ("authorization",)
    stream_end = b"data: [DONE]"

    def parse(self, raw: bytes) -> Parsed | Unparsed:
        loaded = parse_json(raw)
        if isinstance(loaded, Unparsed):
            return loaded
        body, kept = loaded
        messages = body.get("messages")
        if not isinstance(messages, list):
            return Unparsed(PassReason.NO_HISTORY, "messages missing or not a list")
        if not all(isinstance(m, dict) for m in messages):
            return Unparsed(PassReason.BAD_ITEM, "a message is not an object")
        return Parsed(body, list(messages), kept)

    def render(self, parsed: Parsed, messages: Sequence[Message]) -> bytes:
        out = dict(parsed.body)
        out["messages"] = list(messages)
        return write_json(out, parsed.kept_numbers)

    def key_fields(self, body: Mapping[str, Any]) -> list[tuple[str, Any]]:
        return chat_key_fields(body)

    def recorder(self, streamed: bool, encoding: str) -> AnswerRecorder:
        return AnswerRecorder(streamed=streamed, encoding=encoding)

    def error_event(self, body: bytes, status: int) -> bytes:
        return b"data: " + json.dumps(error_object(body, status)).encode() + b"\n\n"
