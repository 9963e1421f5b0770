"""Config: typed and frozen, unknown keys rejected by name, ${ENV} interpolation."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import yaml

from proxy.config import (
    ConfigError,
    Prices,
    Tenant,
    load_config,
    parse_config,
    parse_store_settings,
)

pytestmark = pytest.mark.quick

REPO = Path(__file__).resolve().parent.parent


def test_shipped_config_runs_as_is() -> None:
    cfg = load_config(REPO / "config.yaml", env={})
    (tenant,) = cfg.tenants.values()
    assert tenant.is_open
    assert tenant.upstream.base_url == "https://api.openai.com/v1"
    assert tenant.upstream.api_key == ""
    assert cfg.store.startswith("sqlite:///")
    cfg = load_config(
        REPO / "config.yaml",
        env={"OPENAI_BASE_URL": "http://vllm:8000/v1", "OPENAI_API_KEY": "sk-x"},
    )
    (tenant,) = cfg.tenants.values()
    assert tenant.upstream.base_url == "http://vllm:8000/v1"
    assert tenant.upstream.api_key == "sk-x"


@pytest.mark.parametrize(
    ("data", "name"),
    [
        ({"listne": {}}, "listne"),
        ({"listen": {"hots": "x"}}, "listen.hots"),
        ({"tenants": {"a": {"upstream": {"base_ur": "x"}}}}, "tenants.a.upstream.base_ur"),
        (
            {"tenants": {"a": {"compaction": {"session": {"recent_turn": 3}}}}},
            "tenants.a.compaction.session.recent_turn",
        ),
        ({"models": {"gpt-4o": {"window": 1}}}, "models.gpt-4o.window"),
    ],
)
def test_unknown_keys_rejected_by_name(data: dict, name: str) -> None:
    with pytest.raises(ConfigError, match=f"unknown config key: {name}$"):
        parse_config(data, env={})


@pytest.mark.parametrize(
    ("data", "fragment"),
    [
        ({"listen": {"port": "eighty"}}, "listen.port: expected a number"),
        ({"listen": {"http": "uvloop"}}, "listen.http: must be one of httptools, h11"),
        (
            {"tenants": {"a": {"compaction": {"session": {"mode": "zip"}}}}},
            "must be one of hybrid, replace",
        ),
        (
            {"tenants": {"a": {"compaction": {"session": {"enabled": "yes"}}}}},
            "expected true or false",
        ),
        ({"tenants": {}}, "at least one tenant"),
        (
            {"tenants": {"a": {"api_keys": ["k"]}, "b": {"api_keys": ["k"]}}},
            "also used by tenant a",
        ),
        ({"tenants": {"a": {}, "b": {}}}, "at most one tenant may be open"),
        (
            {"tenants": {"a": {"remote_compaction": "openai"}}},
            "tenants.a.remote_compaction: must be one of recap, passthrough",
        ),
        ({"compaction_secret": "short"}, "compaction_secret: must be at least 32"),
        (
            {"tenants": {"a": {"upstream": {"transport": "h2"}}}},
            "tenants.a.upstream.transport: must be one of fast, httpx",
        ),
    ],
)
def test_bad_values_rejected_with_key(data: dict, fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        parse_config(data, env={})


def test_env_interpolation_and_defaults() -> None:
    cfg = parse_config(
        {
            "tenants": {
                "a": {"upstream": {"base_url": "${UP:-http://fallback/v1}", "api_key": "${KEY}"}}
            }
        },
        env={"KEY": "sk-secret"},
    )
    assert cfg.tenants["a"].upstream.base_url == "http://fallback/v1"
    assert cfg.tenants["a"].upstream.api_key == "sk-secret"


def test_config_is_frozen_and_models_have_windows() -> None:
    cfg = parse_config(
        {"models": {"small": {"context_window": 8000}}, "default_context_window": 32000}, env={}
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.store = "x"  # type: ignore[misc]
    assert cfg.context_window("small") == 8000
    assert cfg.context_window("other") == 32000
    assert cfg.context_window(None) == 32000


def test_unreadable_and_invalid_yaml(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("listen: [unclosed\n")
    with pytest.raises(ConfigError, match="invalid YAML"):
        load_config(bad)


@pytest.mark.parametrize(
    ("data", "name"),
    [
        (
            {"tenants": {"a": {"compaction": {"session": {"trigger_ratio": -3}}}}},
            "tenants.a.compaction.session.trigger_ratio",
        ),
        (
            {"tenants": {"a": {"compaction": {"session": {"trigger_ratio": 1.5}}}}},
            "tenants.a.compaction.session.trigger_ratio",
        ),
        ({"default_context_window": -5}, "default_context_window"),
        (
            {"tenants": {"a": {"upstream": {"max_connections": 0}}}},
            "tenants.a.upstream.max_connections",
        ),
        ({"tenants": {"a": {"upstream": {"timeout_s": 0}}}}, "tenants.a.upstream.timeout_s"),
        (
            {"tenants": {"a": {"summarizer": {"upstream": {"max_connections": -1}}}}},
            "tenants.a.summarizer.upstream.max_connections",
        ),
        ({"models": {"m": {"context_window": 0}}}, "models.m.context_window"),
        ({"max_body_bytes": 0}, "max_body_bytes"),
        ({"listen": {"port": 70000}}, "listen.port"),
        (
            {"tenants": {"a": {"compaction": {"loop": {"ttl_s": float("nan")}}}}},
            "tenants.a.compaction.loop.ttl_s",
        ),
        (
            {"tenants": {"a": {"compaction": {"trim": {"trim_keep_recent": -1}}}}},
            "tenants.a.compaction.trim.trim_keep_recent",
        ),
        (
            {"tenants": {"a": {"summarizer": {"context_window": 2047}}}},
            "tenants.a.summarizer.context_window",
        ),
        (
            {"tenants": {"a": {"summarizer": {"context_window": 0}}}},
            "tenants.a.summarizer.context_window",
        ),
        (
            {"tenants": {"a": {"summarizer": {"context_window": 10**8}}}},
            "tenants.a.summarizer.context_window",
        ),
        ({"tenants": {"a": {"holdout": 1.5}}}, "tenants.a.holdout"),
        ({"tenants": {"a": {"holdout": -0.1}}}, "tenants.a.holdout"),
        (
            {"tenants": {"a": {"compaction": {"session": {"precompact_share": 0}}}}},
            "tenants.a.compaction.session.precompact_share",
        ),
        (
            {"tenants": {"a": {"compaction": {"session": {"precompact_share": 1.2}}}}},
            "tenants.a.compaction.session.precompact_share",
        ),
    ],
)
def test_out_of_range_numbers_rejected_by_name(data: dict, name: str) -> None:
    with pytest.raises(ConfigError, match=f"^{name}: must be"):
        parse_config(data, env={})


def test_in_range_edges_load() -> None:
    cfg = parse_config(
        {
            "default_context_window": 1,
            "tenants": {
                "a": {
                    "upstream": {"max_connections": 1},
                    "compaction": {"session": {"trigger_ratio": 1, "min_recent_ratio": 0}},
                }
            },
        },
        env={},
    )
    assert cfg.tenants["a"].compaction.session.trigger_ratio == 1
    assert Tenant("t").summarizer.context_window == 16384
    edge = {"tenants": {"a": {"summarizer": {"context_window": 2048}}}}
    assert parse_config(edge, env={}).tenants["a"].summarizer.context_window == 2048


@pytest.mark.parametrize("env", [{}, {"KEY": ""}], ids=["unset", "empty"])
def test_an_unset_or_empty_variable_is_an_error_naming_it_and_its_key(env: dict) -> None:
    data = {"tenants": {"a": {"upstream": {"base_url": "${UP}/v1", "api_key": "${KEY}"}}}}
    with pytest.raises(ConfigError) as err:
        parse_config(data, env={"UP": "http://x", **env})
    message = str(err.value)
    assert message.startswith("tenants.a.upstream.api_key: ")
    assert "${KEY}" in message and "${KEY:-}" in message  # how to say empty is fine


def test_a_variable_in_a_list_is_named_with_its_index() -> None:
    with pytest.raises(ConfigError, match=r"^admin_keys\[1\]: \$\{RECAP_ADMIN_KEY\} is not set"):
        parse_config({"admin_keys": ["k-0123", "${RECAP_ADMIN_KEY}"]}, env={})


def test_the_default_form_may_be_empty() -> None:
    cfg = parse_config(
        {"tenants": {"a": {"upstream": {"api_key": "${KEY:-}", "base_url": "${U:-http://d/v1}"}}}},
        env={"KEY": "", "U": ""},
    )
    assert cfg.tenants["a"].upstream.api_key == ""
    assert cfg.tenants["a"].upstream.base_url == "http://d/v1"  # empty takes the default too


@pytest.mark.parametrize(
    ("upstream", "where"),
    [
        ({"upstream": {"base_url": "/v1"}}, "tenants.a.upstream.base_url"),
        ({"upstream": {"base_url": "ftp://host/v1"}}, "tenants.a.upstream.base_url"),
        ({"upstream": {"base_url": "http:///v1"}}, "tenants.a.upstream.base_url"),
        (
            {"summarizer": {"upstream": {"base_url": "localhost:8000/v1"}}},
            "tenants.a.summarizer.upstream.base_url",
        ),
    ],
)
def test_an_upstream_url_must_be_http_or_https(upstream: dict, where: str) -> None:
    with pytest.raises(ConfigError, match=f"^{re.escape(where)}: must be an http:// or https://"):
        parse_config({"tenants": {"a": upstream}}, env={})


def test_the_shipped_config_starts_with_no_variable_set() -> None:
    # A fresh machine: none of its variables is set, and it loads (the :- form where it must).
    cfg = load_config(REPO / "config.yaml", env={})
    assert cfg.admin_keys == () and cfg.tenants["default"].upstream.api_key == ""


def test_the_shipped_config_hints_parse_when_uncommented() -> None:
    # Each "e.g." of the shipped config, put in place of its value, is valid YAML and config.
    text = (REPO / "config.yaml").read_text(encoding="utf-8")
    hints = re.findall(r"^(\s*)([a-z_]+): [^#\n]*# e\.g\. (.+)$", text, flags=re.M)
    assert hints, "the shipped config has no e.g. hints"
    for indent, key, example in hints:
        line = f"{key}: {example.strip()}"
        value = yaml.safe_load(line)[key]
        if not indent:
            parse_config({key: value}, env={"RECAP_ADMIN_KEY": "an-admin-key-0123"})


def test_holdout_share_loads_with_default_zero() -> None:
    cfg = parse_config({"tenants": {"a": {}, "b": {"api_keys": ["k"], "holdout": 0.5}}}, env={})
    assert cfg.tenants["a"].holdout == 0.0
    assert cfg.tenants["b"].holdout == 0.5


def test_background_precompaction_is_on_by_default_and_can_be_switched_off() -> None:
    session = {"precompact": False, "precompact_share": 1}
    b = {"api_keys": ["k"], "compaction": {"session": session}}
    cfg = parse_config({"tenants": {"a": {}, "b": b}}, env={})
    assert cfg.tenants["a"].compaction.session.precompact is True
    assert cfg.tenants["a"].compaction.session.precompact_share == 0.8
    assert cfg.tenants["b"].compaction.session.precompact is False
    assert cfg.tenants["b"].compaction.session.precompact_share == 1


def test_prices_are_optional_typed_and_checked() -> None:
    raw = {"input": 2.5, "output": "${OUT}", "cached_input": 1.25}
    cfg = parse_config(
        {"tenants": {"a": {"prices": raw}, "b": {"api_keys": ["k"]}}}, env={"OUT": "10"}
    )
    assert cfg.tenants["a"].prices == Prices(input=2.5, output=10.0, cached_input=1.25)
    assert cfg.tenants["b"].prices is None
    assert cfg.store_settings().prices == {"a": cfg.tenants["a"].prices}
    assert Prices(input=2, output=8).cost(1000, 400, 10) == pytest.approx((2000 + 80) / 1e6)
    for bad, where in (
        ({"input": 1}, "missing config key: tenants.a.prices.output"),
        ({"input": -1, "output": 1}, "tenants.a.prices.input: must be at least 0"),
        ({"input": 1, "output": 1, "cached_input": -2}, "tenants.a.prices.cached_input"),
        ({"input": 1, "output": 1, "cache": 1}, "unknown config key: tenants.a.prices.cache"),
        ({"input": "cheap", "output": 1}, "tenants.a.prices.input: expected a number"),
    ):
        with pytest.raises(ConfigError, match=re.escape(where)):
            parse_config({"tenants": {"a": {"prices": bad}}}, env={})


def test_the_store_settings_carry_prices_and_shares_for_recap_report() -> None:
    data = {"tenants": {"a": {"holdout": 0.25, "prices": {"input": 1, "output": 2}}, "b": None}}
    settings = parse_store_settings(data, env={})
    assert settings.holdouts == {"a": 0.25, "b": 0.0}
    assert settings.prices == {"a": Prices(input=1, output=2)}
    with pytest.raises(ConfigError, match=r"tenants\.a\.holdout"):
        parse_store_settings({"tenants": {"a": {"holdout": 2}}}, env={})
