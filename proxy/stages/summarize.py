"""The summarizer step: scene -> one non-streamed model call -> a checked summary text.

IO edge of compaction (httpx through the shared upstream pool). The caller gives
the rendered values; this module sends them to the tenant's upstream (or its
`summarizer.upstream`), bounded per tenant by `summarizer.max_concurrency`, and
returns a `SummaryResult` or raises `SummarizerFailed` with a short reason
(never the text). The `Breaker` keeps a conversation whose summaries keep failing
from paying for a failing call on every turn.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from proxy.config import Tenant
from proxy.errors import RecapError
from proxy.messages import json_bytes
from proxy.planning.framing import check_summary, extract_summary
from proxy.planning.guard import guard_summary
from proxy.scenes import Scene, render
from proxy.store.base import ConversationRef
from proxy.upstream import UpstreamPool, mapped_errors, upstream_url

# Marks the proxy's own calls, so an upstream gateway can tell them from the client's.
PURPOSE_HEADER = "x-recap-purpose"


class SummarizerFailed(Exception):
    """The summary could not be made; `reason` is short and safe to log."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class SummaryResult:
    text: str
    input_tokens: int
    output_tokens: int
    model: str
    duration_ms: int
    # References the quality guard put back that the model's summary had lost.
    restored_references: int = 0


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
        authorization: str | None,
        max_chars: int,
        replaced: Sequence[Any] = (),
    ) -> SummaryResult:
        """One summarizer call; `replaced` are the messages the summary stands for (guarded)."""
        system, user = render(scene, **values)
        chosen = scene.model or model
        if not chosen:
            raise SummarizerFailed("no model for the summarizer call")
        body: dict[str, object] = {
            "model": chosen,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
            "stream": False,
        }
        for key in ("temperature", "top_p", "max_tokens"):
            value = getattr(scene, key)
            if value is not None:
                body[key] = value
        upstream = tenant.summarizer.upstream or tenant.upstream
        headers = {"content-type": "application/json", PURPOSE_HEADER: "summarize"}
        if upstream.api_key:
            headers["authorization"] = f"Bearer {upstream.api_key}"
        elif authorization:
            headers["authorization"] = authorization
        timeout = httpx.Timeout(tenant.summarizer.timeout_s, connect=upstream.connect_timeout_s)
        client = self.upstreams.client(upstream)
        start = time.perf_counter()
        async with self._slots.setdefault(tenant.name, asyncio.Semaphore(1)):
            try:
                with mapped_errors(upstream):
                    response = await asyncio.wait_for(
                        client.post(
                            upstream_url(upstream, "/v1/chat/completions", b""),
                            content=json_bytes(body),
                            # latin-1: the client's Authorization is forwarded byte for byte.
                            headers=httpx.Headers(headers, encoding="latin-1"),
                            timeout=timeout,
                        ),
                        # A hard bound too: a trickling response must not outlive the budget.
                        timeout=tenant.summarizer.timeout_s + upstream.connect_timeout_s,
                    )
            except TimeoutError:
                raise SummarizerFailed("timeout") from None
            except RecapError as err:
                raise SummarizerFailed(err.code or type(err).__name__) from None
        duration_ms = int((time.perf_counter() - start) * 1000)
        if response.status_code != 200:
            raise SummarizerFailed(f"upstream status {response.status_code}")
        try:
            data = response.json()
            choice = data["choices"][0]
            raw_text = choice["message"].get("content")
            finish = choice.get("finish_reason")
            usage = data.get("usage") or {}
        except (ValueError, KeyError, IndexError, TypeError, AttributeError):
            raise SummarizerFailed("malformed upstream response") from None
        text = extract_summary(raw_text if isinstance(raw_text, str) else None)
        problem = check_summary(text, finish, max_chars)
        if problem is not None:
            raise SummarizerFailed(problem)
        restored = 0
        if tenant.summarizer.quality_guard and replaced:
            guarded = guard_summary(text, replaced, max_chars, tenant.summarizer.guard_max_share)
            text, restored = guarded.summary, guarded.restored
        return SummaryResult(
            text=text,
            restored_references=restored,
            input_tokens=int(usage.get("prompt_tokens") or 0),
            output_tokens=int(usage.get("completion_tokens") or 0),
            model=str(data.get("model") or chosen),
            duration_ms=duration_ms,
        )


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
