"""The cache-riding summarizer request of each API: the forwarded body, one instruction more.

Beside each dialect's `SummaryCall` (whose `answer` reads the reply). Pure. A riding
request is the body Recap last forwarded for the conversation, every member as it was
written (the history's bytes above all: the provider's prompt cache is keyed on them),
with the history's array ending in one more message, the instruction, and only what must
change for a summary changed: not streamed, the summary's own output limit and sampling,
the scene's model when it names one. Everything else goes as forwarded, `tools` included:
OpenAI caches exact prefixes, tools and images included and identical between requests,
and a structured-output schema is a prefix of the system message; Anthropic's cache is
a hierarchy (tools, then system, then messages) where a change at one level invalidates
it and everything after, and a changed `tool_choice` invalidates the messages' cache. So
`tool_choice` is never added or changed: a body that forces a tool (`required`, a named
function) or a structured answer (`response_format` other than text) cannot give a summary
and is not ridden (`Refusal.NO_SUMMARY`).

Each API builds its own request (`riding_request(name)`): Chat Completions here; an API
without one (Messages, Responses, for now) falls back to the transcript call
(the stage says `RidingFallback.DIALECT`), never another API's shape sent to its upstream.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, Protocol

from proxy.history.messages import json_bytes
from proxy.wire.members import members

# Chat fields a summary cannot keep: the call is not streamed and asks for one answer.
_CHAT_DROPPED = frozenset({"stream", "stream_options", "n"})
_CHAT_LIMITS = ("max_completion_tokens", "max_tokens")


class Refusal(enum.StrEnum):
    """Why a forwarded body cannot be ridden (the session stage says it as a
    `planning.riding.RidingFallback`)."""

    UNREADABLE = "unreadable"  # not a JSON object with its history where the API has it
    NO_SUMMARY = "no_summary"  # it forces a tool call or a structured answer


class RidingRequest(Protocol):
    """One API's cache-riding summarizer request."""

    def check(self, forwarded: bytes) -> Refusal | None:
        """Why `forwarded` cannot be ridden (None: it can)."""
        ...

    def body(
        self, forwarded: bytes, instruction: str, model: str, options: Mapping[str, Any]
    ) -> bytes:
        """The request: `forwarded` with `instruction` as its last message; `options` the
        scene's sampling and `max_tokens`; `model` the summarizer's model. Raises
        ValueError when `forwarded` is not a body `check` accepted."""
        ...


class ChatRiding:
    """Chat Completions: `messages` gets one more, a user message."""

    def check(self, forwarded: bytes) -> Refusal | None:
        try:
            found = {m.key: m.value for m in members(forwarded.decode("utf-8"))}
        except (UnicodeDecodeError, ValueError, RecursionError):
            return Refusal.UNREADABLE
        if not isinstance(found.get("messages"), list):
            return Refusal.UNREADABLE
        choice = found.get("tool_choice")
        if choice not in (None, "auto", "none"):
            return Refusal.NO_SUMMARY
        shape = found.get("response_format")
        if shape is not None and not (isinstance(shape, dict) and shape.get("type") == "text"):
            return Refusal.NO_SUMMARY
        return None

    def body(
        self, forwarded: bytes, instruction: str, model: str, options: Mapping[str, Any]
    ) -> bytes:
        text = forwarded.decode("utf-8")
        found = members(text)
        keys = {m.key for m in found}
        # The output limit goes where the client put its own (newer models take only
        # max_completion_tokens), else as max_tokens.
        limit_key = next((k for k in _CHAT_LIMITS if k in keys), "max_tokens")
        changed: dict[str, Any] = {k: v for k, v in options.items() if k != "max_tokens"}
        if "max_tokens" in options:
            changed[limit_key] = options["max_tokens"]
        message = json_bytes({"role": "user", "content": instruction}).decode("utf-8")
        parts: list[str] = []
        for m in found:
            if m.key in _CHAT_DROPPED or (m.key in _CHAT_LIMITS and m.key != limit_key):
                continue
            if m.key == "messages":
                joint = "," if m.value else ""
                parts.append(text[m.start : m.end - 1] + joint + message + "]")
            elif m.key == "model" and m.value != model:
                parts.append('"model":' + json_bytes(model).decode("utf-8"))
            elif m.key in changed:
                value = changed.pop(m.key)
                parts.append(json_bytes(m.key).decode() + ":" + json_bytes(value).decode())
            else:
                parts.append(text[m.start : m.end])
        if "model" not in keys:
            parts.append('"model":' + json_bytes(model).decode("utf-8"))
        parts += [json_bytes(k).decode() + ":" + json_bytes(v).decode() for k, v in changed.items()]
        parts.append('"stream":false')
        return ("{" + ",".join(parts) + "}").encode("utf-8")


_REQUESTS: Mapping[str, RidingRequest] = MappingProxyType({"chat": ChatRiding()})


def riding_request(dialect: str) -> RidingRequest | None:
    """The riding request of the API named `dialect` (a `Dialect.name`), if it has one."""
    return _REQUESTS.get(dialect)
