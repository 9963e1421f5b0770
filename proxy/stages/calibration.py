"""The budget calibrated from usage: how the upstream's token count compares with Recap's.

Sits between the answer and the next request's planners. Recap estimates with tiktoken;
Qwen, DeepSeek, Llama and others tokenize differently (and count tool schemas and chat
templates that Recap does not see), so a history Recap believes fits may not. Each answer's
`usage.prompt_tokens`, set against Recap's estimate of the messages it forwarded, gives the
ratio for that tenant and model (an exponential moving average, so one odd request moves
it a little); so does an upstream's overflow error that states the prompt's size. The
planners then work with `window(...)`: the configured window divided by the ratio, so
every trigger and the last-resort fit budget in the upstream's own terms.

Bounded: at most `max_entries` (tenant, model) pairs, least recently used dropped first;
prompts under `MIN_ESTIMATE` tokens are not learned from (the fixed overhead of a chat
template would dominate them); the ratio is kept within [`MIN_RATIO`, `MAX_RATIO`]. Lives in
the app state (one per app), never at module level.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Protocol

from proxy.dialects.base import CacheUsage
from proxy.pipeline import Exchange

MIN_ESTIMATE = 1000
# Never below 1: the configured window is the upstream's own; an upstream that counts fewer
# tokens than Recap (or reports a bogus usage, as some fakes and gateways do) never makes
# Recap budget past it.
MIN_RATIO = 1.0
MAX_RATIO = 4.0
# Weight of a new observation in the moving average.
ALPHA = 0.3


@dataclass(frozen=True)
class Ratio:
    value: float
    observations: int


class Calibration:
    def __init__(self, max_entries: int = 4096) -> None:
        if max_entries < 1:
            raise ValueError("max_entries must be >= 1")
        self._max = max_entries
        self._ratios: OrderedDict[tuple[str, str], Ratio] = OrderedDict()

    def __len__(self) -> int:
        return len(self._ratios)

    def observe(self, tenant: str, model: str | None, estimate: int, actual: int) -> None:
        """The upstream counted `actual` tokens where Recap estimated `estimate`."""
        if model is None or estimate < MIN_ESTIMATE or actual <= 0:
            return
        seen = clamp(actual / estimate)
        key = (tenant, model)
        old = self._ratios.pop(key, None)
        value = seen if old is None else old.value + ALPHA * (seen - old.value)
        self._ratios[key] = Ratio(value, (old.observations if old else 0) + 1)
        while len(self._ratios) > self._max:
            self._ratios.popitem(last=False)

    def ratio(self, tenant: str, model: str | None) -> float:
        """Upstream tokens per Recap token for this tenant and model (1.0 before any usage)."""
        if model is None:
            return 1.0
        found = self._ratios.get((tenant, model))
        return found.value if found is not None else 1.0

    def window(self, tenant: str, model: str | None, configured: int) -> int:
        """The configured window in Recap's tokens: what the planners budget with."""
        return max(1, int(configured / self.ratio(tenant, model)))


def calibrate(state: _HasCalibration, ex: Exchange, usage: CacheUsage | None) -> None:
    """Learn from a successful answer's usage (`dialects.base.cache_usage`: the whole
    prompt the upstream counted, Anthropic's cached and cache-written tokens included)
    against the forwarded estimate."""
    estimate = ex.record.input_tokens
    if usage is not None and isinstance(estimate, int):
        # The upstream counted the tool definitions too.
        state.calibration.observe(
            ex.tenant.name, ex.model, estimate + ex.fixed_tokens, usage.input_tokens
        )


class _HasCalibration(Protocol):
    calibration: Calibration


def clamp(ratio: float) -> float:
    return min(MAX_RATIO, max(MIN_RATIO, ratio))
