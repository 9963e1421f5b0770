"""Reading the upstream's answer as it streams past, to archive it.

The bytes go to the client untouched (proxy/edge/compacting.py forwards every chunk as it arrives);
this only keeps a copy. After the stream ends (off the latency path) the copy is
split into SSE lines, the `data:` payloads parsed in one go, and the assistant
message rebuilt from the deltas: content and refusal concatenated, tool calls
assembled by index with their arguments joined, the finish reason and usage kept.
A non-streamed JSON answer is parsed whole. Bounded: past `limit` bytes the
recorder stops collecting (the stream itself goes on), and a compressed answer is
decoded only up to `limit` bytes (else it is archived as truncated).
"""

from __future__ import annotations

import json
from typing import Any

from proxy.wire.encoding import TooLarge, Undecodable, decode, encodings


class AnswerRecorder:
    def __init__(self, streamed: bool, encoding: str = "", limit: int = 8 * 1024 * 1024) -> None:
        self.streamed = streamed
        # The copy is of the raw bytes; a Content-Encoding is undone only when reading it.
        self.encoding = encoding
        self.limit = limit
        self.size = 0
        self.truncated = False
        self._body = bytearray()
        self.content: list[str] = []
        self.refusal: list[str] = []
        self.tool_calls: dict[int, dict[str, Any]] = {}
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] | None = None
        self.model: str | None = None
        self.error: Any = None

    def feed(self, chunk: bytes) -> None:
        if self.truncated:
            return
        self.size += len(chunk)
        if self.size > self.limit:
            self.truncated = True
            return
        self._body += chunk

    def _decoded(self) -> bytes | None:
        body = bytes(self._body)
        codings = encodings(self.encoding)
        if not codings:
            return body
        try:
            # Bounded after decoding too: a small compressed answer can be huge decoded.
            return decode(body, codings, self.limit)
        except TooLarge:
            self.truncated = True
            return None
        except Undecodable:
            return None  # an encoding we cannot read (zstd) or a broken body: unparsed

    def _parse_stream(self, body: bytes) -> None:
        payloads = []
        for line in body.split(b"\n"):
            if line.startswith(b"data:"):
                payload = line[5:].strip()
                if payload and payload != b"[DONE]":
                    payloads.append(payload)
        try:
            # One parse for the whole stream; per line only if some line is bad.
            events = json.loads(b"[" + b",".join(payloads) + b"]")
        except ValueError:
            events = []
            for payload in payloads:
                try:
                    events.append(json.loads(payload))
                except ValueError:
                    continue
        for event in events:
            if isinstance(event, dict):
                self._event(event)

    def _event(self, event: dict[str, Any]) -> None:
        if "error" in event:
            self.error = event["error"]
        self.model = event.get("model") or self.model
        if isinstance(event.get("usage"), dict):
            self.usage = event["usage"]
        for choice in event.get("choices") or []:
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                continue
            self.finish_reason = choice.get("finish_reason") or self.finish_reason
            delta = choice.get("delta") or {}
            if not isinstance(delta, dict):
                continue
            if isinstance(delta.get("content"), str):
                self.content.append(delta["content"])
            if isinstance(delta.get("refusal"), str):
                self.refusal.append(delta["refusal"])
            for call in delta.get("tool_calls") or []:
                if isinstance(call, dict):
                    self._call(call)

    def _call(self, call: dict[str, Any]) -> None:
        index = call.get("index", 0)
        slot = self.tool_calls.setdefault(
            index if isinstance(index, int) else 0,
            {"id": None, "type": "function", "function": {"name": "", "arguments": ""}},
        )
        if call.get("id"):
            slot["id"] = call["id"]
        function = call.get("function") or {}
        if isinstance(function.get("name"), str):
            slot["function"]["name"] += function["name"]
        if isinstance(function.get("arguments"), str):
            slot["function"]["arguments"] += function["arguments"]

    def result(self) -> dict[str, Any]:
        """The archived `response` payload: the assistant message, usage, finish reason."""
        body = None if self.truncated else self._decoded()
        if body is None:
            return {"message": None, "truncated": self.truncated, "unparsed": True}
        if not self.streamed:
            return self._whole(body)
        self._parse_stream(body)
        message: dict[str, Any] = {"role": "assistant", "content": "".join(self.content) or None}
        if self.refusal:
            message["refusal"] = "".join(self.refusal)
        if self.tool_calls:
            message["tool_calls"] = [self.tool_calls[i] for i in sorted(self.tool_calls)]
        return {
            "message": message,
            "finish_reason": self.finish_reason,
            "usage": self.usage,
            "model": self.model,
            "error": self.error,
            "truncated": self.truncated,
        }

    def _whole(self, raw: bytes) -> dict[str, Any]:
        try:
            body = json.loads(raw)
        except ValueError:
            body = None
        if not isinstance(body, dict):
            return {"message": None, "truncated": self.truncated, "unparsed": True}
        choices = body.get("choices") or [{}]
        first = choices[0] if isinstance(choices[0], dict) else {}
        return {
            "message": first.get("message"),
            "finish_reason": first.get("finish_reason"),
            "usage": body.get("usage"),
            "model": body.get("model"),
            "error": body.get("error"),
            "truncated": False,
        }
