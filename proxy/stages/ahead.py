"""Background pre-compaction: the summary the next turn start needs, made after an answer.

A turn that crosses a session trigger would wait for its summarizer calls before its own
model call. Instead, once an answer has reached its client, `Ahead.after_answer` plans the
compaction the next turn start would make (`session_calls.plan_ahead`: this history plus
one more user message, at the triggers scaled by `precompact_share`) and, when it folds
anything, runs it in the background while the user reads and writes. Its summary is stored
as an ordinary version under the chain hash of what it covers, so the next request applies
it at once when its history extends that prefix, and a history that does not (an edit, a
fork, a regenerated answer) never matches it: a background version is one more version
under the same content-addressed invariant (seed 003's overwrite conflict cannot arise).

Rules, and why:
- Bounded per tenant: at most `max(1, summarizer.max_concurrency // 2)` jobs at once, and
  their calls take none of the live calls' slots, so no request waits in Recap for
  background work. A job over the bound is not queued (it is skipped, and counted): by the
  time a slot frees, the conversation has usually moved on, and the next answer plans
  afresh.
- One job per conversation; it runs under the conversation's lock (the store's, so across
  replicas too). A request of the same conversation that must compact waits on that lock
  and then reuses the version, as it would another request's work.
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
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from proxy.config import Tenant
from proxy.pipeline import Exchange
from proxy.planning.outcome import Layer
from proxy.planning.session_calls import compaction_outcome, plan_ahead
from proxy.stages.audit import log_started
from proxy.stages.session import SessionStage, as_applied
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


@dataclass
class Ahead:
    session: SessionStage
    tenants: Mapping[str, Tenant]
    counts: AheadCounts = field(default_factory=AheadCounts)
    _jobs: dict[ConversationRef, _Job] = field(default_factory=dict)
    _running: dict[str, int] = field(default_factory=dict)

    def bound(self, tenant: Tenant) -> int:
        return max(1, tenant.summarizer.max_concurrency // 2)

    def after_answer(self, ex: Exchange) -> None:
        """Start the next turn's compaction in the background, if it is due (never raises)."""
        policy = ex.tenant.compaction.session
        if not (policy.enabled and policy.precompact) or ex.control != "auto" or ex.held_out:
            return
        if ex.conversation in self._jobs or ex.archive_now is None or ex.archive_failed:
            return
        breaker = self.session.breakers.get(ex.tenant.name)
        if breaker is not None and breaker.open(ex.conversation):
            return
        pinned, body = ex.split
        if len(body) < 2:
            return
        if self._running.get(ex.tenant.name, 0) >= self.bound(ex.tenant):
            self.counts.busy += 1
            return
        # Planning counts the history: cheap next to the call, but not for free, so a
        # history far below the scaled triggers is told without counting.
        bound = ex.measure.at_most(ex.original)
        share = policy.precompact_share
        if bound < share * min(policy.min_new_tokens, ex.context_window * policy.trigger_ratio):
            return
        snap = self.session.snapshot(ex, policy, pinned, body, ex.session_summary)
        plan = plan_ahead(snap, share)
        if not plan.calls:
            return
        end = plan.calls[-1].end
        self._running[ex.tenant.name] = self._running.get(ex.tenant.name, 0) + 1
        task = asyncio.get_running_loop().create_task(self._run(ex))
        self._jobs[ex.conversation] = _Job(task, ex.tenant.name, end, ex.identity.chain[end - 1])
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

    async def _run(self, ex: Exchange) -> None:
        try:
            await self._compact(ex)
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
            run = await stage.summarize(ex, policy, chain, plan, background=True)
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
            _log_done(ex, outcome.action, run.failure, outcome.covers or outcome.count)


def _log_done(ex: Exchange, action: str, failure: str, count: int | None) -> None:
    """One line when a background compaction ends: what it stored, or why not."""
    fields = {
        "msg": "background compaction done",
        "request_id": ex.request_id,
        "tenant": ex.tenant.name,
        "conversation": ex.conversation.key,
        "layer": Layer.SESSION,
        "action": action,
        "failure": failure or None,
        "count": count,
    }
    level = logging.WARNING if failure else logging.INFO
    log.log(level, "background compaction done", extra={"fields": fields})
