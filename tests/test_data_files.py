"""The suite is self-contained: the data it reads ships in tests/data with its licence."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.trajectories import DATA

pytestmark = pytest.mark.quick

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
# A path that leaves the repository: an absolute machine path, or a walk up past the clone.
OUTSIDE = re.compile(
    r"""["'](/work/|/home/|/tmp/shared)|parents?\[[3-9]\]|"shared"\s*/\s*"data"|REPO\.parent"""
)


def test_the_taubench_sample_ships_in_the_repository() -> None:
    assert DATA.is_relative_to(REPO)
    assert DATA.parent == TESTS / "data"
    rows = [json.loads(line) for line in DATA.read_text(encoding="utf-8").splitlines() if line]
    assert len(rows) == 100
    assert {"task_id", "trial", "messages", "gold_actions"} <= rows[0].keys()
    licence = (DATA.parent / "taubench-LICENSE.txt").read_text(encoding="utf-8")
    assert "MIT License" in licence and "Sierra" in licence
    assert "taubench-LICENSE.txt" in (DATA.parent / "README.md").read_text(encoding="utf-8")


def test_no_test_or_benchmark_reads_outside_the_repository() -> None:
    offenders = [
        f"{path.relative_to(REPO)}:{n}: {line.strip()}"
        for folder in (TESTS, REPO / "benchmarks")
        for path in sorted(folder.rglob("*.py"))
        if path != Path(__file__).resolve()
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if OUTSIDE.search(line)
    ]
    assert offenders == []
