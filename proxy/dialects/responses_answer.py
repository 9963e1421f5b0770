"""Reading a Responses answer as it is relayed: for the archive and the calibration.

A non-streamed answer is a `response` object; a streamed one is typed SSE events
(`response.created`, `response.output_text.delta`, `response.output_item.done`, ...,
`response.completed`), relayed to the client byte for byte by the route. The copy is
read after the stream ends: the final `response` of `response.completed` (or
`.incomplete`, `.failed`) gives the output items and `usage.input_tokens`; without
it, the items and text deltas seen. The archived message is the output in the
neutral view: its text and its function calls.

`RESPONSES_SUMMARY` is the summarizer's call in this API: a cache-riding call is made in
it (its answer's reasoning items before the message are not the summary).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from proxy.dialects.base import SummaryAnswer, SummaryCall
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


# A response's status read as the summarizer's finish reason ("incomplete" is read from
# its reason: a cut by the output limit is "length").
_FINISH = {"completed": "stop"}


class ResponsesSummaryCall:
    """The summarizer's call as a Responses request: the scene's system as `instructions`,
    its user text as `input`. The route's transcript calls go as Chat Completions
    (`ResponsesDialect.summary_call`); a cache-riding call goes in this API
    (dialects/responses_riding.py), its answer read here."""

    path = "/v1/responses"
    headers: Mapping[str, str] = {}

    def request(
        self, model: str, system: str, user: str, options: Mapping[str, Any]
    ) -> dict[str, Any]:
        extra = {k: v for k, v in options.items() if k != "max_tokens"}
        if "max_tokens" in options:
            extra["max_output_tokens"] = options["max_tokens"]
        return {"model": model, "instructions": system, "input": user, "store": False, **extra}

    def credentials(self, api_key: str) -> dict[str, str]:
        return {"authorization": f"Bearer {api_key}"}

    def answer(self, data: Any) -> SummaryAnswer:
        """The text of the output's `message` items (reasoning items and calls before or
        beside them are not the answer: a call with no message is no text)."""
        output = data["output"]
        texts = [
            part["text"]
            for item in output
            if item.get("type") == "message"
            for part in item.get("content") or []
            if part.get("type") == "output_text" and isinstance(part.get("text"), str)
        ]
        status = data.get("status")
        details = data.get("incomplete_details")
        reason = details.get("reason") if isinstance(details, Mapping) else None
        finish = "length" if reason == "max_output_tokens" else _FINISH.get(status, status)
        usage = data.get("usage") or {}
        model = data.get("model")
        return SummaryAnswer(
            "".join(texts) if texts else None,
            finish if isinstance(finish, str) else None,
            int(usage.get("input_tokens") or 0),
            int(usage.get("output_tokens") or 0),
            model if isinstance(model, str) and model else None,
        )


RESPONSES_SUMMARY: SummaryCall = ResponsesSummaryCall()
