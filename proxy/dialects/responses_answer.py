"""Reading a Responses answer as it is relayed: for the archive and the calibration.

A non-streamed answer is a `response` object; a streamed one is typed SSE events
(`response.created`, `response.output_text.delta`, `response.output_item.done`, ...,
`response.completed`), relayed to the client byte for byte by the route. The copy is
read after the stream ends: the final `response` of `response.completed` (or
`.incomplete`, `.failed`) gives the output items and `usage.input_tokens`; without
it, the items and text deltas seen. The archived message is the output in the
neutral view: its text and its function calls.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from proxy.wire.sse import AnswerRecorder

_FINAL = frozenset({"response.completed", "response.incomplete", "response.failed"})


def output_message(output: Sequence[Any]) -> dict[str, Any]:
    """The output items as one assistant message of the neutral view."""
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for item in output:
        if not isinstance(item, Mapping):
            continue
        if item.get("type") == "message":
            for part in item.get("content") or []:
                if isinstance(part, Mapping) and isinstance(part.get("text"), str):
                    texts.append(part["text"])
        elif item.get("type") == "function_call":
            calls.append(
                {
                    "id": item.get("call_id"),
                    "type": "function",
                    "function": {
                        "name": item.get("name") or "",
                        "arguments": item.get("arguments") or "",
                    },
                }
            )
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts) or None}
    if calls:
        message["tool_calls"] = calls
    return message


class ResponsesRecorder(AnswerRecorder):
    def __init__(self, streamed: bool, encoding: str = "", limit: int = 8 * 1024 * 1024) -> None:
        super().__init__(streamed, encoding, limit)
        self.final: dict[str, Any] | None = None
        self.items: list[Any] = []

    def _parse_stream(self, body: bytes) -> None:
        # The last event is normally the final one, and it holds the whole response: read
        # it alone when it is (the other events only repeat pieces of it).
        at = body.rfind(b"\ndata:")
        if at >= 0:
            line = body[at + 6 :].split(b"\n", 1)[0].strip()
            try:
                event = json.loads(line)
            except ValueError:
                event = None
            if (
                isinstance(event, dict)
                and event.get("type") in _FINAL
                and isinstance(event.get("response"), dict)
            ):
                self.final = event["response"]
                return
        super()._parse_stream(body)

    def _event(self, event: dict[str, Any]) -> None:
        kind = event.get("type")
        if kind in _FINAL and isinstance(event.get("response"), dict):
            self.final = event["response"]
        elif kind == "response.output_text.delta" and isinstance(event.get("delta"), str):
            self.content.append(event["delta"])
        elif kind == "response.output_item.done":
            self.items.append(event.get("item"))
        elif kind == "error":
            self.error = event

    def result(self) -> dict[str, Any]:
        body = None if self.truncated else self._decoded()
        if body is None:
            return {"message": None, "truncated": self.truncated, "unparsed": True}
        if not self.streamed:
            try:
                whole = json.loads(body)
            except ValueError:
                whole = None
            if not isinstance(whole, dict):
                return {"message": None, "truncated": False, "unparsed": True}
            return self._answer(whole)
        self._parse_stream(body)
        if self.final is not None:
            return self._answer(self.final)
        message = output_message(self.items)
        if message["content"] is None and self.content:
            message["content"] = "".join(self.content)
        return {
            "message": message,
            "finish_reason": None,
            "usage": None,
            "model": None,
            "error": self.error,
            "truncated": self.truncated,
        }

    def _answer(self, response: Mapping[str, Any]) -> dict[str, Any]:
        output = response.get("output")
        items = output if isinstance(output, list) else []
        return {
            "message": output_message(items),
            "output": items,
            "finish_reason": response.get("status"),
            "usage": response.get("usage"),
            "model": response.get("model"),
            "error": response.get("error") or self.error,
            "truncated": self.truncated,
        }
