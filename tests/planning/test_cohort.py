from proxy.planning.cohort import Cohort, cohort_of

KNOWN = ["compacted", "compacted", "compacted", "holdout"]


def test_cohort_is_stable_across_calls() -> None:
    first = [cohort_of("acme", f"conv-{i}", 0.5) for i in range(200)]
    assert first == [cohort_of("acme", f"conv-{i}", 0.5) for i in range(200)]


def test_cohort_matches_share_within_tolerance() -> None:
    n = 20000
    held = sum(cohort_of("acme", f"conv-{i}", 0.3) is Cohort.HOLDOUT for i in range(n))
    assert abs(held / n - 0.3) < 0.015


def test_share_bounds_and_tenant_matters() -> None:
    assert all(cohort_of("t", str(i), 0.0) is Cohort.COMPACTED for i in range(500))
    assert all(cohort_of("t", str(i), 1.0) is Cohort.HOLDOUT for i in range(500))
    a = [cohort_of("a", str(i), 0.5) for i in range(500)]
    assert a != [cohort_of("b", str(i), 0.5) for i in range(500)]


def test_known_value_is_fixed() -> None:
    # A fixed value: sha256 is the same on every replica and after every restart.
    assert cohort_of("acme", "conv-1", 0.5) is cohort_of("acme", "conv-1", 0.5)
    assert [cohort_of("acme", f"k{i}", 0.5).value for i in range(4)] == KNOWN
