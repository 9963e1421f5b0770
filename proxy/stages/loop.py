"""The loop stage: inside one turn's tool loop, older rounds -> the turn's working summary.

Runs on tool_continuation requests, after the session stage (it works on the view the
session stage assembled). Planning is pure and one call (`loop_calls.plan_loop_compaction`:
`plan_loop`'s decision, the one summarizer call with its transcript, the scene's values and
limits); this stage does the IO around it:

    a cheap pre-check, then `may_apply`: below both triggers, nothing to look up (pure)
    find the working summary covering a prefix of this turn's rounds exactly    (store)
    plan                                                                         (pure)
    when rounds are due, under the conversation's lock: re-read, and re-plan if
    another step of this loop stored a working summary meanwhile          (store, pure)
    send the planned call (the due rounds merged into the working summary), store
    what it returns under the hash of what it now covers, with a TTL (summarizer, store)
    report (`compaction_outcome`), queue the audit row             (pure, audit writer)
    assemble up to the turn's user message, the working summary, the newest rounds
    raw (`applied_view`)                                                         (pure)

Each working summary is stored under the chain hash of the client's history through the
last round it covers, so it applies only when the request holds that history, in order,
unchanged (the same rule as session summaries); the longest match wins.
The client re-sends the whole loop on every step, so the stored working summary is
reused without a new call until the next `loop_trigger_tool_rounds` rounds are due.
A client that keeps its own sliding window of rounds, a retried or forked turn, or
another user on a shared derived key sends a different history: the hashes differ, and
no summary made from another history applies.
A failure sends the working set as it was (the trim stage still runs after this one).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Mapping

from proxy.config import LoopCompaction
from proxy.history.conversation import is_turn_start, tool_rounds, turn_starts
from proxy.history.messages import Classification, Message
from proxy.pipeline import Exchange
from proxy.planning.guard import Earlier, Seen
from proxy.planning.loop import LoopState, trigger_tokens
from proxy.planning.loop_calls import (
    LoopBasis,
    LoopCompactionPlan,
    LoopSnapshot,
    applied_view,
    compaction_outcome,
    failed_outcome,
    may_apply,
    plan_loop_compaction,
    replaced_chars,
    with_applied,
)
from proxy.planning.outcome import CompactionOutcome, Layer, done_words, retry_detail
from proxy.planning.session_calls import NO_ROOM, SceneWeight
from proxy.stages.audit import audit, log_started
from proxy.stages.scenes import SceneSet
from proxy.stages.summarize import Summarizer, SummarizerFailed, SummaryResult, scene_tokens
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
        # Planned ahead (stages/ahead.py), the next step's round counts already.
        ahead = ex.tenant.compaction.session.precompact
        if self._quiet(messages, policy, ex, ahead):
            return
        covers = self._covers(ex, messages)
        if covers is None:
            return
        turn_hash, hashes, ends = covers
        snap = self._snapshot(ex, policy, messages)
        if not may_apply(snap):
            # The working set only grows within a turn: if it is below both triggers
            # now, no earlier step compacted it, so there is no summary to look up.
            if ahead:
                ex.loop_basis = LoopBasis(snap, turn_hash, tuple(hashes), tuple(ends))
            return
        state = await self.state(ex, hashes)
        snap = dataclasses.replace(snap, state=state)
        # The next step's working summary can be made while the model works on this one.
        ex.loop_basis = LoopBasis(snap, turn_hash, tuple(hashes), tuple(ends))
        plan = plan_loop_compaction(snap)
        outcome = plan.skipped()
        if plan.compacts and not await ex.ensure_archived():
            outcome = dataclasses.replace(outcome, skip_reason="archive_failed")
        elif plan.compacts:
            async with self.store.conversation_lock(ex.conversation):
                # Another step of this loop may have summarised these rounds meanwhile.
                fresher = await self.state(ex, hashes)
                if fresher != state:
                    state = fresher
                    snap = dataclasses.replace(snap, state=state)
                    plan = plan_loop_compaction(snap)
                    outcome = dataclasses.replace(outcome, skip_reason=plan.decision.skip_reason)
                if plan.compacts:
                    state, outcome = await self._compact(ex, snap, plan, turn_hash, hashes)
        if state is not None and state.covered_rounds > 0:
            ex.messages = applied_view(snap, plan, state)
            index = plan.summary_index
            if index is not None:
                ex.loop_summary_index = index
                outcome = with_applied(outcome, state)
        ex.report(outcome)

    def _snapshot(
        self, ex: Exchange, policy: LoopCompaction, messages: list[Message]
    ) -> LoopSnapshot:
        """What the planner reads, the working summary not yet looked up."""
        scene = self.scenes[ex.tenant.name].get(policy.scene)
        return LoopSnapshot(
            messages,
            None,
            policy,
            ex.tenant.compaction.session,
            ex.context_window,
            ex.measure.tokens,
            ex.measure.text,
            SceneWeight(
                ex.tenant.summarizer.context_window,
                scene.max_tokens,
                scene_tokens(scene, ex.measure.text),
            ),
        )

    @staticmethod
    def _quiet(
        messages: list[Message], policy: LoopCompaction, ex: Exchange, ahead: bool = False
    ) -> bool:
        """Cheap pre-check: too few rounds and tokens for any trigger in this turn so far
        (`ahead`: even with the next step's round).

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
        rounds_needed -= 1 if ahead else 0
        if calls >= rounds_needed:
            return False
        measure = ex.measure
        budget = trigger_tokens(policy, ex.context_window)
        return measure.at_most(messages) < budget or measure.total(messages) < budget

    @staticmethod
    def _covers(ex: Exchange, view: list[Message]) -> tuple[str, list[str], list[int]] | None:
        """(chain hash through the turn's user message, hashes[k - 1]: the chain hash of the
        client's history through the turn's k-th tool round, ends[k - 1]: where that round
        ends in the client's body), from the client's messages.

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
        return ident.chain[turn], [ident.chain[r.end - 1] for r in rounds], [r.end for r in rounds]

    async def state(self, ex: Exchange, hashes: list[str]) -> LoopState | None:
        found = await self.store.find_loop_summary(ex.conversation, hashes, time.time())
        if found is None or not 0 < found.covered_rounds <= len(hashes):
            return None
        if hashes[found.covered_rounds - 1] != found.covers_hash:
            return None  # defensive: a row under a hash it does not cover is not used
        return LoopState(found.summary, found.covered_rounds)

    async def _compact(
        self,
        ex: Exchange,
        snap: LoopSnapshot,
        plan: LoopCompactionPlan,
        turn_hash: str,
        hashes: list[str],
    ) -> tuple[LoopState | None, CompactionOutcome]:
        """Send the planned call, store the working summary it returns, report."""
        start = time.perf_counter()
        log_started(log, ex, Layer.LOOP, plan.decision.trigger)
        await ex.notify("recap compacting")
        try:
            result = await self.summarize(ex, snap, plan)
        except SummarizerFailed as exc:
            duration_ms = int((time.perf_counter() - start) * 1000)
            failed = failed_outcome(plan, snap, exc.reason, exc.retried, duration_ms)
            await self.audit(ex, plan, failed, "", (0, 0))
            await ex.notify(f"recap compaction failed: {exc.reason}")
            log.warning("loop compaction failed, working set sent as it was: %s", exc.reason)
            return snap.state, failed
        new = await self.store_summary(ex, snap.policy, plan, result, turn_hash, hashes)
        duration_ms = int((time.perf_counter() - start) * 1000)
        outcome = compaction_outcome(plan, snap, new, result, duration_ms)
        await self.audit(ex, plan, outcome, result.model, replaced_chars(plan, snap, new))
        await ex.notify(done_words(outcome))
        return new, outcome

    async def summarize(
        self, ex: Exchange, snap: LoopSnapshot, plan: LoopCompactionPlan, background: bool = False
    ) -> SummaryResult:
        """The planned call; `background`: ahead of the next step (stages/ahead.py), so no
        client waits or is told."""
        call = plan.call
        assert call is not None
        if call.transcript is None:
            # The scene and the working summary alone fill summarizer.context_window.
            raise SummarizerFailed(NO_ROOM)
        state = snap.state
        asked = self.summarizer.summarize(
            ex.tenant,
            self.scenes[ex.tenant.name].get(snap.policy.scene),
            {"transcript": call.transcript, **plan.values},
            model=ex.model,
            credentials=ex.credentials,
            max_chars=snap.session.max_summary_chars,
            call=ex.dialect.summary_call,
            replaced=[
                *([Earlier(state.summary)] if state else []),  # the stored working summary
                *call.span,
                Seen(plan.goal),  # shown, not replaced: the goal stays raw
            ],
            max_tokens=plan.max_tokens,
            background=background,
        )
        return await (asked if background else ex.waiting(asked))

    async def store_summary(
        self,
        ex: Exchange,
        policy: LoopCompaction,
        plan: LoopCompactionPlan,
        result: SummaryResult,
        turn_hash: str,
        hashes: list[str],
    ) -> LoopState:
        """Kept under the chain hash of what it covers: it applies to that history only."""
        now = time.time()
        covered = plan.covered_after
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

    async def audit(
        self,
        ex: Exchange,
        plan: LoopCompactionPlan,
        outcome: CompactionOutcome,
        model: str,
        chars: tuple[int, int],
        ahead: bool = False,
    ) -> None:
        """The compaction's audit row and event (`ahead`: made in the background)."""
        decision = plan.decision
        await audit(
            self.store,
            ex.conversation,
            CompactionRecord(
                layer=Layer.LOOP,
                reason=plan.reason,
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
                "covered_rounds_before": decision.covered_rounds,
                "covered_rounds": decision.compact_rounds[1] if decision.compact_rounds else None,
                "tool_rounds": len(decision.rounds),
                "length_retries": outcome.length_retries,
                "salvaged": outcome.salvaged,
                **({"ahead": True} if ahead else {}),
            },
        )
