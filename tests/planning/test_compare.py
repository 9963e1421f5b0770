"""Welch's interval and the t quantile against SciPy's (scipy.stats 1.17, worked out once:
SciPy is no dependency), and the comparison of two cohorts' conversations."""

from __future__ import annotations

import pytest

from proxy.planning.cohort import Cohort
from proxy.planning.compare import compare, summarize, t_quantile, welch
from proxy.planning.measures import ConversationMeasures, Measure

pytestmark = pytest.mark.quick


@pytest.mark.parametrize(
    ("df", "scipy"),
    [(1, 12.706204736), (2, 4.302652730), (3, 3.182446305), (7.3, 2.345066737), (50, 2.008559112)],
)
def test_the_t_quantile_is_scipys(df: float, scipy: float) -> None:
    assert t_quantile(0.975, df) == pytest.approx(scipy, abs=0.004)


def test_below_3_degrees_of_freedom_the_quantile_is_never_smaller() -> None:
    # Rounded down to 2 and 1 degrees of freedom: 4.30 and 12.7.
    assert t_quantile(0.975, 2.5) >= 3.5746548  # SciPy's
    assert t_quantile(0.975, 1.5) >= 6.0166631


def test_welchs_interval_is_scipys() -> None:
    # scipy.stats.ttest_ind(a, b, equal_var=False).confidence_interval(0.95)
    a, b = summarize([3, 5, 4, 6, 9, 7]), summarize([1, 2, 2, 3, 4])
    interval = welch(a, b)
    assert interval is not None
    assert interval.difference == pytest.approx(3.266666667)
    assert interval.low == pytest.approx(0.907554892, abs=0.002)
    assert interval.high == pytest.approx(5.625778442, abs=0.002)
    assert not interval.noise


def test_no_interval_under_two_values_and_none_wide_without_spread() -> None:
    assert welch(summarize([1.0]), summarize([1.0, 2.0])) is None
    same = welch(summarize([2.0, 2.0]), summarize([2.0, 2.0]))
    assert same is not None and (same.low, same.high) == (0, 0) and same.noise


def conv(cohort: Cohort | None, turns: float, cost: float | None = None) -> ConversationMeasures:
    values = {Measure.TURNS: turns}
    if cost is not None:
        values[Measure.COST] = cost
    return ConversationMeasures(cohort, requests=int(turns), values=values)


def test_compare_sets_each_cohort_apart_and_leaves_out_the_unmarked() -> None:
    convs = [
        conv(Cohort.COMPACTED, 2, 1.0),
        conv(Cohort.COMPACTED, 4),
        conv(Cohort.HOLDOUT, 1, 0.5),
        conv(None, 9),
    ]
    result = compare(convs, priced=True)
    assert result.mixed == 1
    assert result.counts[Cohort.COMPACTED].conversations == 2
    assert result.counts[Cohort.HOLDOUT].requests == 1
    rows = {row.measure: row for row in result.rows}
    assert rows[Measure.TURNS].compacted.mean == 3 and rows[Measure.TURNS].holdout.n == 1
    assert rows[Measure.TURNS].interval is None  # one held-out conversation
    assert rows[Measure.COST].compacted.n == 1  # only the conversations with a cost
    assert Measure.COST not in {row.measure for row in compare(convs, priced=False).rows}
