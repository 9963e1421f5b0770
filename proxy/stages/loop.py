"""The loop stage: inside one turn's tool loop, older rounds -> the turn's working summary.

Runs on tool_continuation requests, after the session stage (it works on the view the
session stage assembled). Planning is pure (`loop.plan_loop`); this stage does the IO:

    find the working summary that covers a prefix of this turn's rounds exactly: each is
    stored under the chain hash of the client's history through the last round it covers,
    so it applies only when the request holds that history, in order, unchanged (the same
    rule as session summaries); the longest match wins
    plan; when rounds are due, under the conversation's lock re-check (another step of
    the same loop may have done it), summarise the due rounds merged into the working
    summary, store it under the hash of what it now covers (kept for the turn, with a TTL)
    assemble: up to the turn's user message, the working summary, the newest rounds raw

The client re-sends the whole loop on every step, so the stored working summary is
reused without a new call until the next `loop_trigger_tool_rounds` rounds are due.
A client that keeps its own sliding window of rounds, a retried or forked turn, or
another user on a shared derived key sends a different history: the hashes differ, and
no summary made from another history applies.
A failure sends the working set as it was (the trim stage still runs after this one).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Mapping

from proxy.config import LoopCompaction
from proxy.history.conversation import is_turn_start, tool_rounds, turn_starts
from proxy.history.messages import Classification, Message, is_pinned
from proxy.pipeline import Exchange
from proxy.planning.budget import (
    MIN_TRANSCRIPT_TOKENS,
    CallLimits,
    TranscriptBudget,
    item_weights,
)
from proxy.planning.framing import prompt_chars, summary_message
from proxy.planning.guard import Earlier, Seen
from proxy.planning.loop import LoopPlan, LoopState, loop_view, plan_loop, trigger_tokens
from proxy.planning.outcome import CompactionOutcome, Layer, done_words, retry_detail
from proxy.planning.transcript import (
    content_text,
    detect_language,
    head_tail,
    render_within,
)
from proxy.stages.audit import audit, log_started
from proxy.stages.scenes import SceneSet
from proxy.stages.summarize import (
    Summarizer,
    SummarizerFailed,
    SummaryResult,
    call_limits,
)
from proxy.store.base import CompactionRecord, LoopSummary, Store

log = logging.getLogger("recap.loop")


class LoopStage:
    name = "loop"

    def __init__(
        self,
        store: Store,
        summarizer: Summarizer,
        scenes: Mapping[str, SceneSet],
    ) -> None:
        self.store = store
        self.summarizer = summarizer
        self.scenes = scenes

    async def __call__(self, ex: Exchange, /) -> None:
        policy = ex.tenant.compaction.loop
        if ex.control == "off" or not policy.enabled:
            return
        if ex.classification != Classification.TOOL_CONTINUATION:
            return
        messages = ex.messages
        if self._quiet(messages, policy, ex):
            return
        covers = self._covers(ex, messages)
        if covers is None:
            return
        turn_hash, hashes = covers
        count = ex.measure.tokens

        probe = plan_loop(messages, None, policy, count, ex.context_window)
        if probe.skip_reason == "below_threshold" or not probe.rounds:
            # The working set only grows within a turn: if it is below both triggers
            # now, no earlier step compacted it, so there is no summary to look up.
            return
        rounds = {"tool_rounds": len(probe.rounds)}
        state = await self._state(ex, hashes)

        def replan(state: LoopState | None) -> LoopPlan:
            def budget() -> TranscriptBudget:
                return self._limits(ex, policy, probe, state).budget

            return plan_loop(messages, state, policy, count, ex.context_window, budget)

        plan = replan(state)
        outcome = CompactionOutcome(
            Layer.LOOP, "skipped", plan.trigger, plan.skip_reason, extra=rounds
        )
        if plan.compact_rounds is not None and not await ex.ensure_archived():
            outcome = dataclasses.replace(outcome, skip_reason="archive_failed")
        elif plan.compact_rounds is not None:
            async with self.store.conversation_lock(ex.conversation):
                # Another step of this loop may have summarised these rounds meanwhile.
                fresher = await self._state(ex, hashes)
                if fresher != state:
                    state = fresher
                    plan = replan(state)
                    outcome = dataclasses.replace(outcome, skip_reason=plan.skip_reason)
                if plan.compact_rounds is not None:
                    state, outcome = await self._compact(ex, policy, plan, state, turn_hash, hashes)
                    outcome = dataclasses.replace(outcome, extra=rounds)
        if state is not None and state.covered_rounds > 0:
            language = detect_language(messages[: (plan.turn_start or 0) + 1])
            message = summary_message(
                state.summary, ex.tenant.compaction.session.summary_role, language, "loop"
            )
            ex.messages = loop_view(messages, state.covered_rounds, message)
            if plan.turn_start is not None and ex.messages is not messages:
                ex.loop_summary_index = plan.turn_start + 1
                if outcome.action == "skipped":
                    # A stored working summary applied: that is this layer's work too.
                    outcome = dataclasses.replace(outcome, action="applied")
                outcome = dataclasses.replace(outcome, covers=state.covered_rounds)
        ex.report(outcome)

    @staticmethod
    def _quiet(messages: list[Message], policy: LoopCompaction, ex: Exchange) -> bool:
        """Cheap pre-check: too few rounds and tokens for any trigger in this turn so far.

        The working set only grows within a turn, so then no step compacted it and
        there is no working summary to look up either.
        """
        calls = 0
        for m in reversed(messages):
            if is_turn_start(m):
                break
            calls += m.get("role") == "assistant" and bool(m.get("tool_calls"))
        rounds_needed = max(policy.loop_recent_tool_rounds, 1) + max(
            policy.loop_trigger_tool_rounds, 1
        )
        if calls >= rounds_needed:
            return False
        measure = ex.measure
        budget = trigger_tokens(policy, ex.context_window)
        return measure.at_most(messages) < budget or measure.total(messages) < budget

    @staticmethod
    def _covers(ex: Exchange, view: list[Message]) -> tuple[str, list[str]] | None:
        """(chain hash through the turn's user message, hashes[k - 1]: the chain hash of the
        client's history through the turn's k-th tool round), from the client's messages.

        The running turn must be in the view exactly as the client sent it (earlier
        stages only rewrite what comes before it); otherwise None: no loop layer.
        """
        ident = ex.identity
        starts, view_starts = turn_starts(ident.body), turn_starts(view)
        if not starts or not view_starts:
            return None
        turn, view_turn = starts[-1], view_starts[-1]
        sent, seen = ident.body[turn:], view[view_turn:]
        if len(sent) != len(seen) or any(a is not b for a, b in zip(sent, seen, strict=True)):
            return None
        rounds = [r for r in tool_rounds(ident.body) if r.start > turn]
        return ident.chain[turn], [ident.chain[r.end - 1] for r in rounds]

    async def _state(self, ex: Exchange, hashes: list[str]) -> LoopState | None:
        found = await self.store.find_loop_summary(ex.conversation, hashes, time.time())
        if found is None or not 0 < found.covered_rounds <= len(hashes):
            return None
        if hashes[found.covered_rounds - 1] != found.covers_hash:
            return None  # defensive: a row under a hash it does not cover is not used
        return LoopState(found.summary, found.covered_rounds)

    async def _compact(
        self,
        ex: Exchange,
        policy: LoopCompaction,
        plan: LoopPlan,
        state: LoopState | None,
        turn_hash: str,
        hashes: list[str],
    ) -> tuple[LoopState | None, CompactionOutcome]:
        """Summarise the due rounds into the working summary, store it, report."""
        assert plan.compact_rounds is not None
        start = time.perf_counter()
        log_started(log, ex, Layer.LOOP, plan.trigger)
        await ex.notify("recap compacting")
        before = sum(ex.measure.tokens(m) for m in ex.messages)
        try:
            result = await self._summarize(ex, policy, plan, state)
        except SummarizerFailed as exc:
            failed = CompactionOutcome(
                Layer.LOOP,
                "failed",
                plan.trigger,
                failure=exc.reason,
                tokens_before=before,
                tokens_after=before,
                duration_ms=int((time.perf_counter() - start) * 1000),
                length_retries=int(exc.retried),
            )
            await self._audit(ex, plan, failed, "", (0, 0))
            await ex.notify(f"recap compaction failed: {exc.reason}")
            log.warning("loop compaction failed, working set sent as it was: %s", exc.reason)
            return state, failed
        new = await self._store(ex, policy, plan, result, turn_hash, hashes)
        outcome = self._outcome(ex, plan, state, new, result, before, start)
        await self._audit(ex, plan, outcome, result.model, self._chars(ex, plan, state, new))
        await ex.notify(done_words(outcome))
        return new, outcome

    @staticmethod
    def _values(ex: Exchange, plan: LoopPlan, state: LoopState | None) -> dict[str, str | int]:
        """The scene's values but the transcript."""
        assert plan.turn_start is not None
        messages = ex.messages
        session = ex.tenant.compaction.session
        goal = head_tail(
            content_text(messages[plan.turn_start].get("content")), session.max_item_chars
        )
        return {
            "existing_summary": state.summary if state else "",
            "goal": goal,
            "max_summary_chars": prompt_chars(session.max_summary_chars),
            "language": detect_language(messages[: plan.turn_start + 1]),
        }

    def _limits(
        self, ex: Exchange, policy: LoopCompaction, plan: LoopPlan, state: LoopState | None
    ) -> CallLimits:
        """The summarizer's limits for this call; a message weighs what it takes in the
        transcript (instructions: nothing, they are not summarised)."""
        session = ex.tenant.compaction.session
        messages = ex.messages
        item_tokens = item_weights(messages, session.max_item_chars, ex.measure.text)

        return call_limits(
            ex.tenant,
            self.scenes[ex.tenant.name].get(policy.scene),
            self._values(ex, plan, state),
            max_chars=session.max_summary_chars,
            count_text=ex.measure.text,
            item_tokens=item_tokens,
        )

    async def _summarize(
        self, ex: Exchange, policy: LoopCompaction, plan: LoopPlan, state: LoopState | None
    ) -> SummaryResult:
        span = plan.compact_span
        assert span is not None and plan.turn_start is not None
        session = ex.tenant.compaction.session
        # Instructions in the span stay in the view (loop_view): not summarised.
        folded = [m for m in ex.messages[span[0] : span[1]] if not is_pinned(m)]
        limits = self._limits(ex, policy, plan, state)
        values = self._values(ex, plan, state)
        room = limits.budget.first
        if room < MIN_TRANSCRIPT_TOKENS:
            # The scene and the working summary alone fill summarizer.context_window.
            raise SummarizerFailed("summarizer context_window too small")
        return await ex.waiting(
            self.summarizer.summarize(
                ex.tenant,
                self.scenes[ex.tenant.name].get(policy.scene),
                {
                    # The rounds fit `room`; a single round too large for it is cut to fit.
                    "transcript": render_within(
                        folded, session.max_item_chars, room, ex.measure.text
                    ),
                    **values,
                },
                model=ex.model,
                credentials=ex.credentials,
                max_chars=session.max_summary_chars,
                call=ex.dialect.summary_call,
                replaced=[
                    *([Earlier(state.summary)] if state else []),  # the stored working summary
                    *folded,
                    Seen(str(values["goal"])),  # shown, not replaced: the goal stays raw
                ],
                max_tokens=limits.max_tokens,
            )
        )

    async def _store(
        self,
        ex: Exchange,
        policy: LoopCompaction,
        plan: LoopPlan,
        result: SummaryResult,
        turn_hash: str,
        hashes: list[str],
    ) -> LoopState:
        """Kept under the chain hash of what it covers: it applies to that history only."""
        assert plan.compact_rounds is not None
        now = time.time()
        covered = plan.compact_rounds[1]
        await self.store.put_loop_summary(
            ex.conversation,
            LoopSummary(
                turn_hash=turn_hash,
                covered_rounds=covered,
                summary=result.text,
                input_tokens=result.input_tokens,
                output_tokens=result.output_tokens,
                model=result.model,
                created_at=now,
                expires_at=now + policy.ttl_s,
                covers_hash=hashes[covered - 1],
            ),
        )
        return LoopState(result.text, covered)

    @staticmethod
    def _outcome(
        ex: Exchange,
        plan: LoopPlan,
        old: LoopState | None,
        new: LoopState,
        result: SummaryResult,
        before: int,
        start: float,
    ) -> CompactionOutcome:
        assert plan.compact_span is not None
        measure = ex.measure
        folded = ex.messages[plan.boundary(plan.covered_rounds) : plan.compact_span[1]]
        after = (
            before
            - sum(measure.tokens(m) for m in folded)
            + measure.text(new.summary)
            - (measure.text(old.summary) if old else 0)
        )
        return CompactionOutcome(
            Layer.LOOP,
            "compacted",
            plan.trigger,
            tokens_before=before,
            tokens_after=after,
            duration_ms=int((time.perf_counter() - start) * 1000),
            count=new.covered_rounds - plan.covered_rounds,
            covers=new.covered_rounds,
            summarizer_tokens_in=result.input_tokens,
            summarizer_tokens_out=result.output_tokens,
            restored_references=result.restored_references,
            calls=1,
            length_retries=int(result.retried),
            salvaged=int(result.salvaged),
        )

    @staticmethod
    def _chars(
        ex: Exchange, plan: LoopPlan, old: LoopState | None, new: LoopState
    ) -> tuple[int, int]:
        """Characters of what the summary replaced (old summary + rounds) and of itself."""
        assert plan.compact_span is not None
        folded = ex.messages[plan.boundary(plan.covered_rounds) : plan.compact_span[1]]
        before = sum(len(json.dumps(m, ensure_ascii=False)) for m in folded)
        return before + (len(old.summary) if old else 0), len(new.summary)

    async def _audit(
        self,
        ex: Exchange,
        plan: LoopPlan,
        outcome: CompactionOutcome,
        model: str,
        chars: tuple[int, int],
    ) -> None:
        await audit(
            self.store,
            ex.conversation,
            CompactionRecord(
                layer=Layer.LOOP,
                reason=str(plan.trigger),
                outcome="failed" if outcome.failure else "ok",
                detail=retry_detail(outcome.failure, outcome.length_retries, outcome.salvaged),
                tokens_before=outcome.tokens_before or 0,
                tokens_after=outcome.tokens_after or 0,
                chars_before=chars[0],
                chars_after=chars[1],
                model=model,
                duration_ms=outcome.duration_ms or 0,
            ),
            {
                "request_id": ex.request_id,
                "covered_rounds_before": plan.covered_rounds,
                "covered_rounds": plan.compact_rounds[1] if plan.compact_rounds else None,
                "tool_rounds": len(plan.rounds),
                "length_retries": outcome.length_retries,
                "salvaged": outcome.salvaged,
            },
        )
