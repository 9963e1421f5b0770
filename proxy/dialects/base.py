"""The dialect seam: what an API adapter gives the route and the planners.

See the package docstring for the neutral view. A body an adapter cannot or must not
work on is `Unparsed`, with a typed reason: the route forwards it as it came and logs
the reason (the first law: the proxy never rejects what the upstream might accept).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from proxy.errors import ErrorShape
from proxy.history.messages import Message


class PassReason(enum.StrEnum):
    """Why a body went upstream untouched (the log's `passthrough` field)."""

    UNDECODABLE = "undecodable"  # a Content-Encoding the proxy cannot read, or broken
    NOT_JSON = "not_json"
    NOT_OBJECT = "not_object"
    NO_HISTORY = "no_history"  # the history field is missing or of the wrong type
    BAD_ITEM = "bad_item"  # an entry of the history is not an object
    SERVER_HISTORY = "server_history"  # the history is held by the upstream (Responses)


@dataclass(frozen=True)
class Unparsed:
    reason: PassReason
    # In words, for the log's `passthrough_reason`.
    detail: str


@dataclass
class Parsed:
    """A body the proxy works on: the JSON object, and its history in the neutral view."""

    body: dict[str, Any]
    messages: list[Message]
    # Numbers whose text Python would not write back the same (proxy.wire.numbers).
    kept_numbers: bool = False
    # id(neutral message) -> the API's own entries it stands for, in order (adapters
    # whose entries are not already neutral messages). The messages themselves are
    # held in `messages`, so the ids stay unique while this lives.
    sources: dict[int, list[Any]] = field(default_factory=dict)


class Recorder(Protocol):
    """Reads the upstream's answer as it is relayed (a copy, bounded)."""

    def feed(self, chunk: bytes) -> None: ...

    def result(self) -> dict[str, Any]:
        """The archived answer; `usage.prompt_tokens` (when known) feeds calibration."""
        ...


@dataclass(frozen=True)
class SummaryAnswer:
    """A summarizer call's answer, read: its text, why it stopped ("stop", "length", or
    another word of the API's), its tokens and the model that wrote it."""

    text: str | None
    finish: str | None
    input_tokens: int
    output_tokens: int
    model: str | None


@dataclass(frozen=True)
class CacheUsage:
    """What an answer's usage says of its input: all of it, and what the prompt cache served."""

    input_tokens: int
    cached_tokens: int


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def cache_usage(usage: Any) -> CacheUsage | None:
    """The input and cached-input tokens of a usage object in any of the three APIs.

    Chat: `prompt_tokens` and `prompt_tokens_details.cached_tokens`. Responses:
    `input_tokens` and `input_tokens_details.cached_tokens`. Messages: `input_tokens`
    counts only the uncached, unwritten part, so the input is it plus
    `cache_read_input_tokens` and `cache_creation_input_tokens`, and only the read part
    is cached (a cache write is billed above the base price, not served from cache).
    None when the usage names no input tokens."""
    if not isinstance(usage, Mapping):
        return None
    prompt = _int(usage.get("prompt_tokens"))
    if prompt is not None:
        details = usage.get("prompt_tokens_details")
        cached = _int(details.get("cached_tokens")) if isinstance(details, Mapping) else None
        return CacheUsage(prompt, cached or 0)
    given = _int(usage.get("input_tokens"))
    if given is None:
        return None
    read = _int(usage.get("cache_read_input_tokens"))
    written = _int(usage.get("cache_creation_input_tokens"))
    if read is not None or written is not None:
        return CacheUsage(given + (read or 0) + (written or 0), read or 0)
    details = usage.get("input_tokens_details")
    cached = _int(details.get("cached_tokens")) if isinstance(details, Mapping) else None
    return CacheUsage(given, cached or 0)


class SummaryCall(Protocol):
    """The summarizer's own model call in one API: one non-streamed request and its answer.

    A compaction asks the tenant's upstream through the API of the request that needs
    it, so an upstream that serves only that API still compacts."""

    # The path of the call, under the upstream's base URL.
    path: str
    # Headers every call of this API carries (Anthropic's `anthropic-version`).
    headers: Mapping[str, str]

    def request(
        self, model: str, system: str, user: str, options: Mapping[str, Any]
    ) -> dict[str, Any]:
        """The body: `system` and `user` from the scene; `options` the sampling settings
        and `max_tokens` that are set."""
        ...

    def credentials(self, api_key: str) -> dict[str, str]:
        """The headers that carry the upstream's own key (on the summarizer's calls, and
        on the requests forwarded on this API's route)."""
        ...

    def answer(self, data: Any) -> SummaryAnswer:
        """The answer's JSON read; raises KeyError, IndexError, TypeError, AttributeError
        or ValueError when it is not an answer of this API."""
        ...


class Dialect(Protocol):
    """One API: how its requests map onto the neutral view and back."""

    # The route's name in logs and metrics ("chat", "responses").
    name: str
    # The body field holding the history ("messages", "input"): archived apart.
    history_key: str
    # Body fields naming the most output tokens the client allows (the fit keeps room).
    output_limit_keys: tuple[str, ...]
    # Recap's own errors on this API's route: an error answer's body, and the final event
    # of a stream that broke after it started (never another API's shape).
    errors: ErrorShape
    # How the summarizer asks the upstream for a summary in this API.
    summary_call: SummaryCall
    # The client headers that may carry a key, in this API's way ("authorization" for a
    # Bearer token; Anthropic's "x-api-key"): read for the proxy key that picks the
    # tenant; replaced by `summary_call.credentials` when the tenant's upstream has a key
    # of its own, else forwarded (and given to the summarizer's calls).
    credential_headers: tuple[str, ...]
    # Where the final bytes of this API's streamed answer begin (chat's `data: [DONE]`):
    # they wait for the request's archive record (`edge.relay.FinalBytesGate`).
    stream_end: bytes

    def parse(self, raw: bytes) -> Parsed | Unparsed: ...

    def render(self, parsed: Parsed, messages: Sequence[Message]) -> bytes: ...

    def key_fields(self, body: Mapping[str, Any]) -> list[tuple[str, Any]]:
        """(source, value) candidates for the conversation key that the body carries,
        in order of precedence (after the headers)."""
        ...

    def recorder(self, streamed: bool, encoding: str) -> Recorder: ...

    def error_event(self, body: bytes, status: int) -> bytes:
        """An upstream's error answer (its body and status) as SSE bytes of this API, for
        a stream that had already started (compaction progress went out first)."""
        ...


# -- the cache-riding summarizer request (each API's in dialects/riding.py) ----------


class Refusal(enum.StrEnum):
    """Why a forwarded body cannot be ridden (the session stage says it as a
    `planning.riding.RidingFallback`)."""

    UNREADABLE = "unreadable"  # not a JSON object with its history where the API has it
    NO_SUMMARY = "no_summary"  # it forces a tool call or a structured answer


@dataclass(frozen=True)
class Numbered:
    """The last folded message as the riding instruction names it: its number among the
    API's own entries (the prompt's instructions are number 1 when there are any), and
    its role in the API's words."""

    count: int
    role: str


class RidingRequest(Protocol):
    """One API's cache-riding summarizer request."""

    # The API the request is sent in, and its answer read in.
    call: SummaryCall
    # Client headers the riding call carries as the forwarded request did (Anthropic's
    # `anthropic-beta`: a body using a beta feature is refused without it).
    carried: tuple[str, ...]

    def check(self, forwarded: bytes) -> Refusal | None:
        """Why `forwarded` cannot be ridden (None: it can)."""
        ...

    def number(self, forwarded: bytes, view: Sequence[Message], last: int) -> Numbered | None:
        """How the instruction names `view[last - 1]`, the last folded message of `view`
        (the neutral view `forwarded` was rendered from); None when the fold does not end
        between two of the API's entries, so no "messages 1 to K" says it exactly."""
        ...

    def output_limit(self, forwarded: bytes, limit: int) -> int:
        """The most output tokens the request asks for when the summary's limit is `limit`
        (more where the API spends some before the text: Anthropic's thinking budget)."""
        ...

    def body(
        self, forwarded: bytes, instruction: str, model: str, options: Mapping[str, Any]
    ) -> bytes:
        """The request: `forwarded` with `instruction` as its last message; `options` the
        scene's sampling and `max_tokens`; `model` the summarizer's model. Raises
        ValueError when `forwarded` is not a body `check` accepted."""
        ...
