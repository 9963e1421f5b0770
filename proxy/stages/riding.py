"""Cache-riding session summarizer calls: which request a compaction rides on, and the call.

Beside the session stage, which asks it (`SessionStage.summarize`, and the background job,
stages/ahead.py). A session scene with `input: cache_riding` has its compaction's one call
sent as the request the conversation forwarded, with the scene's riding instruction last
(planning/riding.py decides when a plan may ride; dialects/riding.py builds each API's
request). The request comes from where it is known exactly: the one just answered (the
background job has its exchange), or, on the request path, the one this history extends,
kept here after its answer (`remember`, `previous`: stages/forwarded.py bounds them).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from types import MappingProxyType

from proxy.config import SessionCompaction
from proxy.dialects.riding import Refusal, riding_request
from proxy.history.messages import Message
from proxy.pipeline import Exchange
from proxy.planning.guard import Earlier, Seen
from proxy.planning.riding import (
    Forwarded,
    RidingFallback,
    RidingPlan,
    SummaryInput,
    plan_riding,
    riding_fits,
)
from proxy.planning.session_calls import CompactionPlan
from proxy.planning.transcript import render_transcript
from proxy.stages.forwarded import LastForwarded
from proxy.stages.scenes import Scene, SceneSet, render_riding
from proxy.stages.summarize import Riding, Summarizer, SummaryResult


class Rider:
    def __init__(self, scenes: Mapping[str, SceneSet], summarizer: Summarizer) -> None:
        self.scenes = scenes
        self.summarizer = summarizer
        # The request each conversation last forwarded (tenants whose scene rides only).
        self.last_forwarded = LastForwarded()

    def previous(self, ex: Exchange) -> Forwarded | None:
        """The request this history extends, as it was forwarded, if it was kept."""
        return self.last_forwarded.get(ex.conversation, ex.identity.chain)

    def remember(self, ex: Exchange) -> None:
        """After a successful answer: keep the request as forwarded when the next turn's
        compaction may ride on it (the tenant's session scene rides, in this API)."""
        policy = ex.tenant.compaction.session
        scenes = self.scenes.get(ex.tenant.name)
        if ex.forwarded is None or scenes is None or not policy.enabled:
            return
        if scenes.get(policy.scene).input is not SummaryInput.CACHE_RIDING:
            return
        if riding_request(ex.dialect.name) is None or ex.tenant.summarizer.upstream is not None:
            return
        self.last_forwarded.keep(ex.conversation, ex.forwarded, ex.identity.chain)

    def plan_for(
        self,
        ex: Exchange,
        policy: SessionCompaction,
        body: Sequence[Message],
        plan: CompactionPlan,
        forwarded: Forwarded | None,
    ) -> RidingPlan | RidingFallback | None:
        """Whether `plan` (over the client's `body`) rides on `forwarded`, the request this
        history went upstream as (None: not known), or why not; None when the scene does
        not ask to ride (planning/riding.py says when a plan rides)."""
        scene = self.scenes[ex.tenant.name].get(policy.scene)
        if scene.input is not SummaryInput.CACHE_RIDING or not plan.calls:
            return None
        if ex.tenant.summarizer.upstream is not None:
            return RidingFallback.SEPARATE_UPSTREAM
        request = riding_request(ex.dialect.name)
        if request is None or (forwarded is not None and forwarded.dialect != ex.dialect.name):
            return RidingFallback.DIALECT
        if forwarded is None:
            return RidingFallback.NOT_FORWARDED
        refused = request.check(forwarded.body)
        if refused is not None:
            return _REFUSALS[refused]
        first = plan.calls[0]
        riding = plan_riding(
            forwarded,
            calls=len(plan.calls),
            start=first.start,
            end=first.end,
            body=body,
            applied_version=plan.applied.version if plan.applied else None,
        )
        if isinstance(riding, RidingFallback):
            return riding
        # The instruction numbers the part as the API's model sees it (its own entries).
        numbered = request.number(forwarded.body, forwarded.view, riding.count)
        if numbered is None:
            return RidingFallback.NOT_SHOWN
        riding = dataclasses.replace(riding, count=numbered.count, role=numbered.role)
        instruction = render_riding(scene, _riding_values(plan, riding))
        fits = riding_fits(
            riding,
            window=ex.tenant.summarizer.context_window,
            max_tokens=request.output_limit(forwarded.body, plan.max_tokens),
            instruction_tokens=ex.measure.text(instruction),
            count=ex.measure.tokens,
        )
        return riding if fits else RidingFallback.TOO_LARGE

    async def summarize(
        self,
        ex: Exchange,
        scene: Scene,
        policy: SessionCompaction,
        plan: CompactionPlan,
        riding: RidingPlan,
        replaced: list[Message | Earlier | Seen],
        background: bool,
    ) -> SummaryResult:
        """The plan's one call as a cache-riding call on `riding`'s forwarded request (raises
        SummarizerFailed as the transcript call does)."""
        request = riding_request(riding.forwarded.dialect)
        assert request is not None  # plan_for checked it
        # The messages after the folded part were shown too: input, never replaced.
        later = render_transcript(list(riding.after), max_item_chars=10**9)
        asked = self.summarizer.summarize(
            ex.tenant,
            scene,
            _riding_values(plan, riding),
            model=ex.model,
            credentials=ex.credentials,
            max_chars=policy.max_summary_chars,
            replaced=[*replaced, *([Seen(later)] if later else [])],
            max_tokens=plan.max_tokens,
            call=ex.dialect.summary_call,
            background=background,
            riding=Riding(
                request,
                riding.forwarded.body,
                {k: ex.headers[k] for k in request.carried if ex.headers.get(k)},
            ),
        )
        return await (asked if background else ex.waiting(asked))


# The dialect's word on a body it cannot ride, as the session layer reports it.
_REFUSALS = MappingProxyType(
    {Refusal.UNREADABLE: RidingFallback.NOT_FORWARDED, Refusal.NO_SUMMARY: RidingFallback.BODY}
)


def _riding_values(plan: CompactionPlan, riding: RidingPlan) -> dict[str, str | int]:
    """The riding instruction's values for `plan`'s one call."""
    return {
        "count": riding.count,
        "role": riding.role,
        "anchor": riding.anchor,
        "summary_shown": "yes" if riding.shown else "",
        "max_summary_chars": plan.values["max_summary_chars"],
        "language": plan.values["language"],
    }
