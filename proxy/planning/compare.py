"""The two cohorts side by side: each measure's mean per cohort and when a difference is noise.

Pure: conversations' measures in (`proxy/planning/measures.py`), a `Comparison` out, which
`recap report`, the web page's report and the `/metrics` holdout series all show, so they
cannot disagree.

The interval is Welch's two-sample t interval, 95%, of the difference of the means
(compacted minus holdout), over conversations. Welch's because the cohorts differ in size
(a 10% holdout is a ninth of the other) and in spread (compaction changes the spread of
token counts), which Student's pooled interval assumes away; a closed form rather than a
bootstrap because it is exact arithmetic, the same on every surface and every run, and
costs one pass over the data. It leans on the central limit theorem: with few
conversations, or a measure that is almost always 0, it is only a rough guide. A
difference whose interval holds 0 is noise at that level.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from statistics import NormalDist

from proxy.planning.cohort import Cohort
from proxy.planning.measures import ConversationMeasures, ErrorKind, Finish, Measure

LEVEL = 0.95


def t_quantile(p: float, df: float) -> float:
    """Student's t quantile (0.5 <= p < 1): exact for 1 and 2 degrees of freedom, and for
    fewer than 3 those rounded down (a wider interval, never a narrower one); from 3 on the
    Cornish-Fisher expansion around the normal quantile (within 0.004 of the tables)."""
    if df < 2:
        return math.tan(math.pi * (p - 0.5))
    if df < 3:
        return (2 * p - 1) / math.sqrt(2 * p * (1 - p))
    z = NormalDist().inv_cdf(p)
    g1 = (z**3 + z) / 4
    g2 = (5 * z**5 + 16 * z**3 + 3 * z) / 96
    g3 = (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / 384
    g4 = (79 * z**9 + 776 * z**7 + 1482 * z**5 - 1920 * z**3 - 945 * z) / 92160
    return z + g1 / df + g2 / df**2 + g3 / df**3 + g4 / df**4


@dataclass(frozen=True)
class Summary:
    """One cohort's values of one measure: how many conversations, their mean and variance."""

    n: int
    mean: float | None
    variance: float | None  # the sample variance (n - 1); None under 2 values


def summarize(values: Sequence[float]) -> Summary:
    n = len(values)
    if n == 0:
        return Summary(0, None, None)
    mean = math.fsum(values) / n
    variance = math.fsum((v - mean) ** 2 for v in values) / (n - 1) if n > 1 else None
    return Summary(n, mean, variance)


@dataclass(frozen=True)
class Interval:
    """Compacted minus holdout: the difference of the means and its interval."""

    difference: float
    low: float
    high: float

    @property
    def noise(self) -> bool:
        """True when the interval holds 0: no difference to speak of at this level."""
        return self.low <= 0 <= self.high


def welch(a: Summary, b: Summary, level: float = LEVEL) -> Interval | None:
    """Welch's interval of mean(a) - mean(b); None when either has fewer than 2 values."""
    if a.variance is None or b.variance is None or a.mean is None or b.mean is None:
        return None
    difference = a.mean - b.mean
    va, vb = a.variance / a.n, b.variance / b.n
    se = math.sqrt(va + vb)
    if se == 0:
        return Interval(difference, difference, difference)
    df = (va + vb) ** 2 / (va**2 / (a.n - 1) + vb**2 / (b.n - 1))
    half = t_quantile(1 - (1 - level) / 2, df) * se
    return Interval(difference, difference - half, difference + half)


@dataclass(frozen=True)
class Row:
    measure: Measure
    compacted: Summary
    holdout: Summary
    interval: Interval | None


@dataclass(frozen=True)
class CohortCounts:
    """A cohort's size, and what its answers ended with."""

    conversations: int = 0
    requests: int = 0
    finishes: Counter[Finish] = field(default_factory=Counter)
    errors: Counter[ErrorKind] = field(default_factory=Counter)


@dataclass(frozen=True)
class Comparison:
    counts: dict[Cohort, CohortCounts]
    rows: list[Row]
    # Conversations in no single cohort (archived before the tenant ran a holdout, or while
    # its share changed): left out.
    mixed: int = 0


def compare(conversations: Iterable[ConversationMeasures], priced: bool) -> Comparison:
    """Both cohorts' summaries of every measure (cost only when `priced`)."""
    by_cohort: dict[Cohort, list[ConversationMeasures]] = {c: [] for c in Cohort}
    mixed = 0
    for conv in conversations:
        if conv.cohort is None:
            mixed += 1
        else:
            by_cohort[conv.cohort].append(conv)
    counts = {
        cohort: CohortCounts(
            conversations=len(convs),
            requests=sum(c.requests for c in convs),
            finishes=sum((c.finishes for c in convs), Counter()),
            errors=sum((c.errors for c in convs), Counter()),
        )
        for cohort, convs in by_cohort.items()
    }
    rows = []
    for m in Measure:
        if m is Measure.COST and not priced:
            continue
        compacted, holdout = (
            summarize([c.values[m] for c in by_cohort[cohort] if m in c.values])
            for cohort in (Cohort.COMPACTED, Cohort.HOLDOUT)
        )
        rows.append(Row(m, compacted, holdout, welch(compacted, holdout)))
    return Comparison(counts, rows, mixed)
