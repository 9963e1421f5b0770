"""Background pre-compaction: the summaries the next request needs, made before it comes.

A turn that crosses a session trigger would wait for its summarizer calls before its own
model call. Instead, once an answer has reached its client, `Ahead.after_answer` plans the
compaction the next turn start would make (`session_calls.plan_ahead`: this history plus
stand-ins for this turn's answer and the next user message, weighed like the last turn's,
at the triggers scaled by `precompact_share`) and, when it folds
anything, runs it in the background while the user reads and writes. Its summary is stored
as an ordinary version under the chain hash of what it covers, so the next request applies
it at once when its history extends that prefix, and a history that does not (an edit, a
fork, a regenerated answer) never matches it: a background version is one more version
under the same content-addressed invariant (seed 003's overwrite conflict cannot arise).

Inside a tool loop the same is done for loop working memory, and earlier: once a tool
continuation is forwarded, while the model works on it, `Ahead.after_forward` plans the loop
compaction the next step would make (`loop_calls.plan_loop_ahead`: this view and one more
tool round) and, when it folds rounds this request already holds, makes that working summary
in the background, stored under the hash of the rounds it covers like any other.

Rules, and why:
- Bounded per tenant: at most `max(1, summarizer.max_concurrency // 2)` jobs at once, and
  their calls take none of the live calls' slots, so no request waits in Recap for
  background work. A job over the bound is not queued (it is skipped, and counted): by the
  time a slot frees, the conversation has usually moved on, and the next answer plans
  afresh.
- One job per conversation (session or loop); it runs under the conversation's lock (the
  store's, so across replicas too). A request of the same conversation that must compact
  waits on that lock and then reuses the version, as it would another request's work.
- Cancelled when the conversation moves on so that it is useless: a request of the
  conversation whose history no longer holds the prefix the job folds (`moved_on`). A
  cancelled job stores nothing more (a version already stored stays: it is valid).
- The client leaving changes nothing: the answer is complete when a job starts.
- Never for a request whose client said `x-recap-compaction` off or force, a held-out one,
  a failed answer, or a conversation whose summaries keep failing (the session circuit
  breaker).
- Shutdown cancels what runs (`aclose`) before the store closes.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Coroutine, Mapping
from dataclasses import dataclass, field
from typing import Any

from proxy.config import Tenant
from proxy.history.tokens import REPLY_PRIMING_TOKENS
from proxy.pipeline import Exchange
from proxy.planning import loop_calls
from proxy.planning.outcome import Layer
from proxy.planning.session_calls import compaction_outcome, last_turn_tokens, plan_ahead
from proxy.stages.audit import log_started
from proxy.stages.loop import LoopStage
from proxy.stages.session import SessionStage, as_applied
from proxy.stages.summarize import SummarizerFailed
from proxy.store.base import ConversationRef, StoreError

log = logging.getLogger("recap.ahead")


@dataclass
class AheadCounts:
    """What background pre-compaction did since start (tests, benchmarks, the tail)."""

    started: int = 0
    stored: int = 0  # jobs that stored at least one version
    failed: int = 0
    cancelled: int = 0
    busy: int = 0  # jobs skipped: the tenant's bound was reached


@dataclass
class _Job:
    task: asyncio.Task[None]
    tenant: str
    # The prefix it folds: body[:end], whose chain hash is `boundary`.
    end: int
    boundary: str


# The framing of the next turn's messages, generously: their text is weighed apart, as the
# last turn's (`last_turn_tokens`), or not at all for a history of one turn, which planning
# ahead extends by one empty user message (`session_calls.NEXT_TURN`).
NEXT_TURN_TOKENS = 16


def weight_bound(ex: Exchange) -> int:
    """An upper bound of the client's history's tokens, with the next turn's message: exact
    when the request's planning counted every message (as it does on its way upstream), else
    the bound of its size (`Measure.at_most`, which tokenizes nothing). Both are without
    tokenizing anything more."""
    counts = ex.measure.counted(ex.original)
    if all(n is not None for n in counts):
        return sum(n for n in counts if n is not None) + REPLY_PRIMING_TOKENS + NEXT_TURN_TOKENS
    return ex.measure.at_most(ex.original) + NEXT_TURN_TOKENS


@dataclass
class Ahead:
    session: SessionStage
    loop: LoopStage
    tenants: Mapping[str, Tenant]
    counts: AheadCounts = field(default_factory=AheadCounts)
    _jobs: dict[ConversationRef, _Job] = field(default_factory=dict)
    _running: dict[str, int] = field(default_factory=dict)

    def bound(self, tenant: Tenant) -> int:
        return max(1, tenant.summarizer.max_concurrency // 2)

    def after_answer(self, ex: Exchange) -> None:
        """Start the next turn's compaction in the background, if it is due (never raises:
        compaction is an optimisation, and this runs as the request finishes)."""
        try:
            self._after_answer(ex)
        except Exception:
            log.exception("planning ahead failed", extra={"request_id": ex.request_id})

    def after_forward(self, ex: Exchange) -> None:
        """While the model works on a tool continuation, make the working summary its next
        step will need, if one is due then (never raises)."""
        try:
            self._after_forward(ex)
        except Exception:
            log.exception("planning ahead failed", extra={"request_id": ex.request_id})

    def _after_answer(self, ex: Exchange) -> None:
        policy = ex.tenant.compaction.session
        pinned, body = ex.split
        if not policy.enabled or len(body) < 2:
            return
        breaker = self.session.breakers.get(ex.tenant.name)
        if (breaker is not None and breaker.open(ex.conversation)) or not self._may_start(ex):
            return
        # Planning counts the history: cheap next to the call, but not for free (about as
        # much as the request's own planning), so a history below the scaled triggers is
        # told from its weight alone.
        bound = weight_bound(ex)
        share = policy.precompact_share
        # With what the next turn adds, weighed like the last one (counted by now).
        bound += last_turn_tokens(body, ex.measure.tokens)
        if bound < share * min(policy.min_new_tokens, ex.context_window * policy.trigger_ratio):
            return
        snap = self.session.snapshot(ex, policy, pinned, body, ex.session_summary)
        plan = plan_ahead(snap, share)
        if not plan.calls:
            return
        self._start(ex, plan.calls[-1].end, self._compact(ex))

    def _after_forward(self, ex: Exchange) -> None:
        basis = ex.loop_basis
        if basis is None or not basis.snap.policy.enabled or not self._may_start(ex):
            return
        _, plan = loop_calls.plan_loop_ahead(basis.snap)
        if not plan.compacts:
            return
        # The rounds it folds end at body[:end] of the client's history, whose hash it is.
        covered = plan.covered_after
        end, boundary = basis.ends[covered - 1], basis.hashes[covered - 1]
        self._start_at(ex, boundary, self._compact_loop(ex, basis), end)

    def _may_start(self, ex: Exchange) -> bool:
        policy = ex.tenant.compaction.session
        if not policy.precompact or ex.control != "auto" or ex.held_out:
            return False
        return not (ex.conversation in self._jobs or ex.archive_now is None or ex.archive_failed)

    def _start(self, ex: Exchange, end: int, work: Coroutine[Any, Any, None]) -> None:
        """Run `work`, a job folding the client's body[:end]."""
        self._start_at(ex, ex.identity.chain[end - 1], work, end)

    def _start_at(
        self, ex: Exchange, boundary: str, work: Coroutine[Any, Any, None], end: int
    ) -> None:
        if self._running.get(ex.tenant.name, 0) >= self.bound(ex.tenant):
            # Due, but the tenant's bound is reached: skipped, not queued.
            self.counts.busy += 1
            work.close()
            return
        self._running[ex.tenant.name] = self._running.get(ex.tenant.name, 0) + 1
        task = asyncio.get_running_loop().create_task(self._run(ex, work))
        self._jobs[ex.conversation] = _Job(task, ex.tenant.name, end, boundary)
        self.counts.started += 1
        task.add_done_callback(lambda _: self._done(ex.conversation, ex.tenant.name))

    def moved_on(self, ex: Exchange) -> None:
        """A new request of a conversation with a job running: cancel the job when this
        history no longer holds the prefix it folds (an edit or a fork made it useless)."""
        job = self._jobs.get(ex.conversation)
        if job is None:
            return
        _, body = ex.split
        if len(body) >= job.end and ex.chain[job.end - 1] == job.boundary:
            return
        job.task.cancel()
        self.counts.cancelled += 1

    async def settled(self) -> None:
        """Until no job runs (tests and benchmarks wait for it; nothing on the request path)."""
        while self._jobs:
            await asyncio.gather(
                *(j.task for j in list(self._jobs.values())), return_exceptions=True
            )

    async def aclose(self) -> None:
        for job in list(self._jobs.values()):
            job.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.settled()

    def running(self, tenant: str) -> int:
        return self._running.get(tenant, 0)

    def _done(self, conv: ConversationRef, tenant: str) -> None:
        self._jobs.pop(conv, None)
        self._running[tenant] = max(0, self._running.get(tenant, 0) - 1)

    async def _run(self, ex: Exchange, work: Coroutine[Any, Any, None]) -> None:
        try:
            await work
        except asyncio.CancelledError:
            raise
        except Exception:
            # Compaction is an optimisation: a failed background job changes no request.
            self.counts.failed += 1
            log.exception("background compaction failed", extra={"request_id": ex.request_id})

    async def _compact(self, ex: Exchange) -> None:
        stage, policy = self.session, ex.tenant.compaction.session
        pinned, body = ex.split
        conv, chain = ex.conversation, ex.identity.chain
        if not await ex.ensure_archived():
            return
        async with stage.store.conversation_lock(conv):
            # The plan is made under the lock, from what is stored now: another request or
            # replica may have folded this history meanwhile.
            try:
                found = await stage.store.matching_summary(conv, chain)
            except StoreError:
                self.counts.failed += 1
                return
            applied = as_applied(found, len(body) + 1)
            snap = stage.snapshot(ex, policy, pinned, body, applied)
            plan = plan_ahead(snap, policy.precompact_share)
            if not plan.calls:
                return
            start = time.perf_counter()
            log_started(log, ex, Layer.SESSION, f"ahead:{plan.reason}")
            # The request just answered is at hand as it was forwarded: a riding scene's
            # call rides on it (planning/riding.py).
            riding = stage.rider.plan_for(ex, policy, body, plan, ex.forwarded)
            run = await stage.summarize(ex, policy, chain, plan, background=True, riding=riding)
            breaker = stage.breakers.get(ex.tenant.name)
            if breaker is not None:
                if run.failure:
                    breaker.failed(conv)
                else:
                    breaker.succeeded(conv)
            outcome = compaction_outcome(plan, snap, run, int((time.perf_counter() - start) * 1000))
            await stage.audit(ex, body, plan, run, outcome, ahead=True)
            if run.failure:
                self.counts.failed += 1
            elif run.applied is not plan.applied:
                self.counts.stored += 1
            _log_done(ex, Layer.SESSION, outcome.action, run.failure, outcome.count, outcome.extra)

    async def _compact_loop(self, ex: Exchange, basis: loop_calls.LoopBasis) -> None:
        stage = self.loop
        if not await ex.ensure_archived():
            return
        hashes = list(basis.hashes)
        async with stage.store.conversation_lock(ex.conversation):
            # Planned under the lock from what is stored now: the next step may be here.
            try:
                state = await stage.state(ex, hashes)
            except StoreError:
                self.counts.failed += 1
                return
            snap, plan = loop_calls.plan_loop_ahead(dataclasses.replace(basis.snap, state=state))
            if not plan.compacts:
                return
            start = time.perf_counter()
            log_started(log, ex, Layer.LOOP, f"ahead:{plan.reason}")
            try:
                result = await stage.summarize(ex, snap, plan, background=True)
            except SummarizerFailed as exc:
                duration_ms = int((time.perf_counter() - start) * 1000)
                failed = loop_calls.failed_outcome(plan, snap, exc.reason, exc.retried, duration_ms)
                await stage.audit(ex, plan, failed, "", (0, 0), ahead=True)
                self.counts.failed += 1
                _log_done(ex, Layer.LOOP, "failed", exc.reason, None)
                return
            new = await stage.store_summary(ex, snap.policy, plan, result, basis.turn_hash, hashes)
            duration_ms = int((time.perf_counter() - start) * 1000)
            outcome = loop_calls.compaction_outcome(plan, snap, new, result, duration_ms)
            chars = loop_calls.replaced_chars(plan, snap, new)
            await stage.audit(ex, plan, outcome, result.model, chars, ahead=True)
            self.counts.stored += 1
            _log_done(ex, Layer.LOOP, outcome.action, "", outcome.count)


def _log_done(
    ex: Exchange,
    layer: Layer,
    action: str,
    failure: str,
    count: int | None,
    extra: Mapping[str, Any] | None = None,
) -> None:
    """One line when a background compaction ends: what it stored, or why not (`extra`:
    the outcome's, e.g. what the summarizer was given)."""
    fields = {
        "msg": "background compaction done",
        "request_id": ex.request_id,
        "tenant": ex.tenant.name,
        "conversation": ex.conversation.key,
        "layer": layer,
        "action": action,
        "failure": failure or None,
        "count": count,
        **(extra or {}),
    }
    level = logging.WARNING if failure else logging.INFO
    log.log(level, "background compaction done", extra={"fields": fields})
