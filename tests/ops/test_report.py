"""`recap report` as an operator runs it: on a config file, over the store it names (the
numbers themselves: tests/archive/test_holdout.py; agreeing with the page and /metrics:
tests/system/test_holdout.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from proxy.ops.cli import main


def config(tmp_path: Path, tenants: dict[str, object]) -> str:
    path = tmp_path / "config.yaml"
    data = {"store": f"sqlite:///{tmp_path / 'recap.db'}", "tenants": tenants}
    path.write_text(yaml.safe_dump(data), encoding="utf-8")
    return str(path)


def test_an_empty_archive_reports_empty_cohorts_and_no_cost_without_prices(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = config(tmp_path, {"shop": {"holdout": 0.2}})
    assert main(["report", "--config", path, "--since", "24h"]) == 0
    out = capsys.readouterr().out
    assert "tenant shop" in out and "holdout share now 0.2" in out
    assert "(no cost: the tenant sets no prices)" in out
    assert [line.split()[:2] for line in out.splitlines()[3:5]] == [
        ["compacted", "0"],
        ["holdout", "0"],
    ]
    assert "too few" in out


def test_a_tenant_is_named_when_there_are_several_and_since_is_checked(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = config(tmp_path, {"a": {"api_keys": ["ka"]}, "b": {"api_keys": ["kb"]}})
    assert main(["report", "--config", path]) == 1
    assert "name one with --tenant" in capsys.readouterr().err
    assert main(["report", "--config", path, "--tenant", "c"]) == 1
    assert "no tenant 'c'" in capsys.readouterr().err
    assert main(["report", "--config", path, "--tenant", "a", "--since", "soon"]) == 1
    assert "since must be an age" in capsys.readouterr().err


def test_prices_are_checked_as_the_server_checks_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = config(tmp_path, {"a": {"prices": {"input": 1, "output": -1}}})
    assert main(["report", "--config", path]) == 2
    assert "tenants.a.prices.output: must be at least 0" in capsys.readouterr().err
