"""The summarizer step: scene -> one non-streamed model call -> a checked summary text.

IO edge of compaction (httpx through the shared upstream pool). The caller gives
the rendered values and the API to ask in (`SummaryCall`: the request's dialect's, Chat
Completions by default); this module sends them to the tenant's upstream (or its
`summarizer.upstream`), bounded per tenant by `summarizer.max_concurrency`, and
returns a `SummaryResult` or raises `SummarizerFailed` with a short reason
(never the text). The `Breaker` keeps a conversation whose summaries keep failing
from paying for a failing call on every turn.

A summary cut by its token limit (`finish_reason: length`: typically a small model
copying tool output into it), or one that stops on its own over `max_chars`, is asked for
once more, with the scene's `length_retry` text after the prompt and half the character
target. If that one is cut too, or stops but is still over `max_chars`, its whole sections
that fit stand in for it when they make a valid summary (else the first answer's); only
then does the call fail. Both tries count in the result (`retried`, `salvaged`) and in the
failure.

A cache-riding call (`Riding`, planning/riding.py) sends the conversation's forwarded
request with the scene's `riding` instruction as its last message, built by the request's
API (`dialects/riding.py`) and sent in that API (a Responses request to `/v1/responses`,
where its transcript calls go as Chat Completions), instead of the scene's system and user
prompts; its answer is read, checked, retried and guarded the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from proxy.config import Tenant
from proxy.dialects.base import SummaryCall
from proxy.dialects.chat import CHAT_SUMMARY
from proxy.dialects.riding import RidingRequest
from proxy.errors import RecapError
from proxy.history.messages import json_bytes
from proxy.planning.budget import CallLimits
from proxy.planning.budget import call_limits as limits_of
from proxy.planning.framing import check_summary, complete_sections, extract_summary
from proxy.planning.guard import guard_summary
from proxy.stages.scenes import Scene, render_riding, render_values
from proxy.store.base import ConversationRef
from proxy.upstream.client import UpstreamClient, UpstreamPool, mapped_errors, upstream_url
from proxy.wire.encoding import Decoder, TooLarge, Undecodable, encodings

# Marks the proxy's own calls, so an upstream gateway can tell them from the client's.
PURPOSE_HEADER = "x-recap-purpose"


class SummarizerFailed(Exception):
    """The summary could not be made; `reason` is short and safe to log. `retried`: a
    second, shorter try was made after the first was cut by its token limit or too long."""

    def __init__(self, reason: str, *, retried: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        self.retried = retried


@dataclass(frozen=True)
class SummaryResult:
    text: str
    input_tokens: int
    output_tokens: int
    model: str
    duration_ms: int
    # References the quality guard put back that the model's summary had lost.
    restored_references: int = 0
    # The first answer was cut by its token limit or too long; a shorter one was asked for.
    retried: bool = False
    # The second was cut or too long too: this summary is the whole sections of one of them.
    salvaged: bool = False


@dataclass(frozen=True)
class Riding:
    """A cache-riding call: `forwarded` (the body last forwarded, decoded) with the scene's
    riding instruction appended, as `request` (its API's) builds it, sent in that API
    (`request.call`) with the client's `headers` that `request.carried` names; the call's
    values are then the riding template's."""

    request: RidingRequest
    forwarded: bytes
    headers: Mapping[str, str] = dataclasses.field(default_factory=dict)


@dataclass(frozen=True)
class _Answer:
    """One summarizer call's answer, before it is judged."""

    text: str
    finish: str | None
    input_tokens: int
    output_tokens: int
    model: str
    duration_ms: int


# What a summarizer's answer may be, decoded: a summary is a few KB of JSON (reasoning
# included), and a compressed answer past this is a bomb, never read into memory whole.
MAX_ANSWER_BYTES = 8 * 1024 * 1024


async def _read(client: UpstreamClient, request: httpx.Request) -> tuple[int, bytes]:
    """The answer's status and body, decoded within MAX_ANSWER_BYTES (raises TooLarge, or
    Undecodable for a body that is not valid in its Content-Encoding)."""
    response = await client.send(request)
    try:
        decoder = Decoder(encodings(response.headers.get("content-encoding", "")), MAX_ANSWER_BYTES)
        body = bytearray()
        async for chunk in response.aiter_raw():
            body += decoder.feed(chunk)
        decoder.finish()
    finally:
        await response.aclose()
    return response.status_code, bytes(body)


class Summarizer:
    def __init__(self, upstreams: UpstreamPool, tenants: Mapping[str, Tenant]) -> None:
        self.upstreams = upstreams
        self._slots = {
            name: asyncio.Semaphore(max(1, t.summarizer.max_concurrency))
            for name, t in tenants.items()
        }

    async def summarize(
        self,
        tenant: Tenant,
        scene: Scene,
        values: Mapping[str, str | int],
        *,
        model: str | None,
        credentials: Mapping[str, str],
        max_chars: int,
        replaced: Sequence[Any] = (),
        max_tokens: int | None = None,
        call: SummaryCall = CHAT_SUMMARY,
        background: bool = False,
        riding: Riding | None = None,
    ) -> SummaryResult:
        """One summary (one call, two after a length cut); `credentials` are the client's
        own key headers (sent when the upstream has no key); `replaced` are the messages the
        summary stands for (guarded); `max_tokens` overrides the scene's; `call` is the
        API to ask in on the tenant's upstream (a separate `summarizer.upstream` is asked
        as a Chat Completion: an OpenAI-compatible summarizer). A `background` call
        (stages/ahead.py, which bounds its own) takes none of the tenant's
        `max_concurrency` slots, so no request waits for it. `riding`: a cache-riding
        call, `values` being its instruction's (the summarizer's own upstream only)."""
        chosen = scene.model or model
        if not chosen:
            raise SummarizerFailed("no model for the summarizer call")
        limit = max_tokens if max_tokens is not None else scene.max_tokens

        async def ask(retry: bool, asked: Mapping[str, str | int]) -> _Answer:
            return await self._call(
                tenant, scene, asked, chosen, credentials, limit, retry, call, background, riding
            )

        first = await ask(False, values)
        answer, problem = first, check_summary(first.text, first.finish, max_chars)
        retried = salvaged = False
        if problem is not None and (first.finish == "length" or problem == "too_long"):
            retried = True
            shorter = dict(values)
            if "max_summary_chars" in shorter:
                shorter["max_summary_chars"] = max(1, int(shorter["max_summary_chars"]) // 2)
            try:
                second = await ask(True, shorter)
            except SummarizerFailed as exc:
                raise SummarizerFailed(exc.reason, retried=True) from None
            answer = _merged(first, second)
            problem = check_summary(second.text, second.finish, max_chars)
            if problem is not None and second.finish in ("length", "stop"):
                # Cut again, or whole but still too long: the whole sections that fit.
                for cut in (second, first):
                    kept = complete_sections(cut.text, max_chars, cut=cut.finish == "length")
                    if check_summary(kept, "stop", max_chars) is None:
                        answer = dataclasses.replace(answer, text=kept)
                        problem, salvaged = None, True
                        break
        if problem is not None:
            raise SummarizerFailed(problem, retried=retried)
        text, restored = answer.text, 0
        if tenant.summarizer.quality_guard and replaced:
            # In a worker thread: the guard reads every replaced message (about 2 s a
            # megabyte), and the hop costs microseconds next to the call just made.
            guarded = await asyncio.to_thread(
                guard_summary, text, replaced, max_chars, tenant.summarizer.guard_max_share
            )
            text, restored = guarded.summary, guarded.restored
        return SummaryResult(
            text=text,
            restored_references=restored,
            input_tokens=answer.input_tokens,
            output_tokens=answer.output_tokens,
            model=answer.model,
            duration_ms=answer.duration_ms,
            retried=retried,
            salvaged=salvaged,
        )

    async def _call(
        self,
        tenant: Tenant,
        scene: Scene,
        values: Mapping[str, str | int],
        chosen: str,
        credentials: Mapping[str, str],
        max_tokens: int | None,
        length_retry: bool,
        call: SummaryCall,
        background: bool = False,
        riding: Riding | None = None,
    ) -> _Answer:
        options: dict[str, object] = {}
        for key in ("temperature", "top_p"):
            value = getattr(scene, key)
            if value is not None:
                options[key] = value
        if max_tokens is not None:
            options["max_tokens"] = max_tokens
        if riding is not None:
            if tenant.summarizer.upstream is not None:
                raise SummarizerFailed("a riding call goes to the tenant's upstream only")
            instruction = render_riding(scene, values, length_retry=length_retry)
            call = riding.request.call
            try:
                content = riding.request.body(riding.forwarded, instruction, chosen, options)
            except (ValueError, RecursionError):
                raise SummarizerFailed("forwarded body unreadable") from None
        else:
            if tenant.summarizer.upstream is not None:
                call = CHAT_SUMMARY
            system, user = render_values(scene, values, length_retry=length_retry)
            content = json_bytes(call.request(chosen, system, user, options))
        upstream = tenant.summarizer.upstream or tenant.upstream
        headers = {"content-type": "application/json", PURPOSE_HEADER: "summarize", **call.headers}
        if riding is not None:
            headers.update(riding.headers)
        if upstream.api_key:
            headers.update(call.credentials(upstream.api_key))
        else:
            headers.update(credentials)
        timeout = httpx.Timeout(tenant.summarizer.timeout_s, connect=upstream.connect_timeout_s)
        client = self.upstreams.client(tenant.name, upstream)
        start = time.perf_counter()
        slot: contextlib.AbstractAsyncContextManager[object] = (
            contextlib.nullcontext()
            if background
            else self._slots.setdefault(tenant.name, asyncio.Semaphore(1))
        )
        async with slot:
            try:
                with mapped_errors(upstream):
                    request = client.build_request(
                        "POST",
                        upstream_url(upstream, call.path, b""),
                        content=content,
                        # latin-1: the client's key headers are forwarded byte for byte.
                        headers=httpx.Headers(headers, encoding="latin-1"),
                        timeout=timeout,
                    )
                    status, answer = await asyncio.wait_for(
                        _read(client, request),
                        # A hard bound too: a trickling response must not outlive the budget.
                        timeout=tenant.summarizer.timeout_s + upstream.connect_timeout_s,
                    )
            except TimeoutError:
                raise SummarizerFailed("timeout") from None
            except RecapError as err:
                raise SummarizerFailed(err.code or type(err).__name__) from None
            except TooLarge:
                raise SummarizerFailed("answer too large") from None
            except Undecodable:
                raise SummarizerFailed("malformed upstream response") from None
        duration_ms = int((time.perf_counter() - start) * 1000)
        if status != 200:
            raise SummarizerFailed(f"upstream status {status}")
        try:
            read = call.answer(json.loads(answer))
        except (ValueError, KeyError, IndexError, TypeError, AttributeError):
            raise SummarizerFailed("malformed upstream response") from None
        return _Answer(
            text=extract_summary(read.text),
            finish=read.finish,
            input_tokens=read.input_tokens,
            output_tokens=read.output_tokens,
            model=read.model or chosen,
            duration_ms=duration_ms,
        )


def _merged(first: _Answer, second: _Answer) -> _Answer:
    """The second answer, with both calls' tokens and time."""
    return dataclasses.replace(
        second,
        input_tokens=first.input_tokens + second.input_tokens,
        output_tokens=first.output_tokens + second.output_tokens,
        duration_ms=first.duration_ms + second.duration_ms,
    )


def call_limits(
    tenant: Tenant,
    scene: Scene,
    values: Mapping[str, str | int],
    *,
    max_chars: int,
    count_text: Callable[[str], int],
    item_tokens: Callable[[int], int],
) -> CallLimits:
    """The limits of calls rendering `scene` with `values` (their transcript and summary
    left out: the budget is what remains for them); `item_tokens` weighs a message."""
    return limits_of(
        tenant.summarizer.context_window,
        scene.max_tokens,
        scene_tokens(scene, count_text)(values),
        str(values.get("existing_summary") or ""),
        max_chars=max_chars,
        language=str(values.get("language") or ""),
        count_text=count_text,
        item_tokens=item_tokens,
    )


def scene_tokens(
    scene: Scene, count_text: Callable[[str], int]
) -> Callable[[Mapping[str, str | int]], int]:
    """What `scene` weighs rendered with given values, its transcript and summary blank."""

    def weigh(values: Mapping[str, str | int]) -> int:
        blank = {**values, "transcript": "", "existing_summary": ""}
        system, user = render_values(scene, blank)
        return count_text(system) + count_text(user)

    return weigh


class Breaker:
    """After `threshold` consecutive failures in a conversation, skip it for `cooldown_s`.

    `clock` reads the time the cool-down is measured on (monotonic seconds; tests pass
    a fake one they advance)."""

    def __init__(
        self,
        threshold: int,
        cooldown_s: float,
        max_entries: int = 10_000,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.threshold = threshold
        self.cooldown_s = cooldown_s
        self.max_entries = max_entries
        self._clock = clock
        self._failures: dict[ConversationRef, tuple[int, float]] = {}

    def open(self, conv: ConversationRef) -> bool:
        failures, until = self._failures.get(conv, (0, 0.0))
        if failures < self.threshold:
            return False
        if self._clock() < until:
            return True
        # Cool-down over: let one attempt through (half-open); one more failure re-opens.
        self._failures[conv] = (self.threshold - 1, 0.0)
        return False

    def failed(self, conv: ConversationRef) -> None:
        failures = self._failures.get(conv, (0, 0.0))[0] + 1
        until = self._clock() + self.cooldown_s
        if len(self._failures) >= self.max_entries and conv not in self._failures:
            self._failures.pop(next(iter(self._failures)))
        self._failures[conv] = (failures, until if failures >= self.threshold else 0.0)

    def succeeded(self, conv: ConversationRef) -> None:
        self._failures.pop(conv, None)
