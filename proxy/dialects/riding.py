"""The cache-riding summarizer request of each API: the forwarded body, one instruction more.

Beside each dialect's `SummaryCall` (whose `answer` reads the reply). Pure. A riding
request is the body Recap last forwarded for the conversation, every member as it was
written (the history's bytes above all: the provider's prompt cache is keyed on them),
with the history's array ending in one more entry, the instruction, and only what must
change for a summary changed: not streamed, the summary's own output limit and sampling,
the scene's model when it names one. Everything else goes as forwarded, `tools` included:
OpenAI caches exact prefixes, tools and images included and identical between requests,
and a structured-output schema is a prefix of the system message; Anthropic's cache is
a hierarchy (tools, then system, then messages) where a change at one level invalidates
it and everything after, and a changed `tool_choice` invalidates the messages' cache. So
`tool_choice` is never added or changed: a body that forces a tool (`required`, a named
function) or a structured answer (`response_format` other than text) cannot give a summary
and is not ridden (`Refusal.NO_SUMMARY`).

Each API builds its own request (`riding_request(name)`), sent in its own API
(`RidingRequest.call`: path, headers, how its answer is read), never another API's shape
sent to its upstream: Chat Completions here, Messages in `messages_riding.py`, Responses
in `responses_riding.py`. Each also numbers the folded part as its model sees it
(`RidingRequest.number`): the instruction names "messages 1 to K", and K counts the API's
own entries, the prompt's instructions first.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any

from proxy.dialects.base import Numbered, Refusal, RidingRequest, SummaryCall
from proxy.dialects.chat import CHAT_SUMMARY
from proxy.dialects.messages_riding import MessagesRiding
from proxy.dialects.responses_riding import ResponsesRiding
from proxy.history.messages import Message
from proxy.wire.members import members, read_members, spliced

__all__ = ["Numbered", "Refusal", "RidingRequest", "riding_request"]

# Chat fields a summary cannot keep: the call is not streamed and asks for one answer.
_CHAT_DROPPED = frozenset({"stream", "stream_options", "n"})
_CHAT_LIMITS = ("max_completion_tokens", "max_tokens")


class ChatRiding:
    """Chat Completions: `messages` gets one more, a user message."""

    call: SummaryCall = CHAT_SUMMARY
    carried: tuple[str, ...] = ()

    def check(self, forwarded: bytes) -> Refusal | None:
        found = read_members(forwarded)
        if found is None or not isinstance(found.get("messages"), list):
            return Refusal.UNREADABLE
        choice = found.get("tool_choice")
        if choice not in (None, "auto", "none"):
            return Refusal.NO_SUMMARY
        shape = found.get("response_format")
        if shape is not None and not (isinstance(shape, dict) and shape.get("type") == "text"):
            return Refusal.NO_SUMMARY
        return None

    def number(self, forwarded: bytes, view: Sequence[Message], last: int) -> Numbered | None:
        # The view is the request's `messages`, system messages included.
        if not 0 < last <= len(view):
            return None
        return Numbered(last, str(view[last - 1].get("role") or "message"))

    def output_limit(self, forwarded: bytes, limit: int) -> int:
        return limit

    def body(
        self, forwarded: bytes, instruction: str, model: str, options: Mapping[str, Any]
    ) -> bytes:
        text = forwarded.decode("utf-8")
        found = members(text)
        keys = {m.key for m in found}
        # The output limit goes where the client put its own (newer models take only
        # max_completion_tokens), else as max_tokens.
        limit_key = next((k for k in _CHAT_LIMITS if k in keys), "max_tokens")
        changed: dict[str, Any] = {"model": model}
        changed.update((k, v) for k, v in options.items() if k != "max_tokens")
        if "max_tokens" in options:
            changed[limit_key] = options["max_tokens"]
        changed["stream"] = False
        dropped = (_CHAT_DROPPED - {"stream"}) | {k for k in _CHAT_LIMITS if k != limit_key}
        message = {"role": "user", "content": instruction}
        return spliced(text, found, "messages", message, changed, dropped)


_REQUESTS: Mapping[str, RidingRequest] = MappingProxyType(
    {"chat": ChatRiding(), "messages": MessagesRiding(), "responses": ResponsesRiding()}
)


def riding_request(dialect: str) -> RidingRequest | None:
    """The riding request of the API named `dialect` (a `Dialect.name`), if it has one."""
    return _REQUESTS.get(dialect)
