"""The start-up line: what it names, and what it never shows (passwords, user parts)."""

from __future__ import annotations

from pathlib import Path

from proxy.config import parse_config
from proxy.ops.admin_key import PageKey
from proxy.ops.lifecycle import safe_url, started_fields, upstream_host


def test_store_urls_lose_their_secrets_and_nothing_else() -> None:
    assert safe_url("sqlite:///./data/recap.db") == "sqlite:///./data/recap.db"
    assert safe_url("sqlite:////var/lib/recap.db") == "sqlite:////var/lib/recap.db"
    assert (
        safe_url("postgresql://recap:s3cr%40t@db:5432/recap?search_path=recap")
        == "postgresql://recap:***@db:5432/recap?search_path=recap"
    )
    redacted = safe_url("postgres://db/recap?user=recap&password=s3cret&sslpassword=x")
    assert "s3cret" not in redacted and redacted.count("***") == 2
    assert "user=recap" in redacted
    assert safe_url("postgresql://recap@db/recap") == "postgresql://recap@db/recap"


def test_upstream_host_is_only_the_host_and_port() -> None:
    assert upstream_host("https://api.openai.com/v1") == "api.openai.com"
    assert upstream_host("http://user:key@10.0.0.5:8000/v1?k=1") == "10.0.0.5:8000"
    assert upstream_host("http://[::1]:9000/v1") == "[::1]:9000"


def test_started_fields_name_address_store_tenants_and_version() -> None:
    config = parse_config(
        {
            "store": "postgresql://recap:hunter2@db:5432/recap",
            "tenants": {
                "acme": {
                    "api_keys": ["rk-acme-secret"],
                    "upstream": {"base_url": "https://u:p@llm.example.com/v1", "api_key": "sk-x"},
                },
                "lab": {"upstream": {"base_url": "http://127.0.0.1:9000/v1"}},
            },
        },
        env={},
    )
    fields = started_fields(config, "http://127.0.0.1:8080")
    assert fields["event"] == "started"
    assert fields["address"] == "http://127.0.0.1:8080"
    assert fields["store"] == "postgresql://recap:***@db:5432/recap"
    assert fields["scenes"] == "packaged"
    assert fields["tenants"] == [
        {"name": "acme", "upstream": "llm.example.com", "open": False},
        {"name": "lab", "upstream": "127.0.0.1:9000", "open": True},
    ]
    assert fields["version"]
    msg = fields["msg"]
    assert msg.startswith(f"recap {fields['version']} listening on http://127.0.0.1:8080")
    assert "acme \u2192 llm.example.com (keys)" in msg and "lab \u2192 127.0.0.1:9000 (open)" in msg
    text = repr(fields)
    for secret in ("hunter2", "rk-acme-secret", "sk-x", "u:p"):
        assert secret not in text, secret


def test_the_start_line_names_the_store_file_the_page_and_the_windows(tmp_path: Path) -> None:
    config = parse_config(
        {
            "store": "sqlite:///./data/recap.db",
            "default_context_window": 32000,
            "models": {"gpt-4o": {"context_window": 128000}, "small": {"context_window": 8000}},
        },
        env={},
        base_dir=str(tmp_path),
    )
    key_file = tmp_path / "data" / "recap.db-admin-key"
    fields = started_fields(config, "http://0.0.0.0:8080", PageKey("file", key_file, made=True))
    # The file the store is, resolved against the config's directory, not the URL as written.
    assert fields["store"] == str(tmp_path / "data" / "recap.db")
    assert fields["page"] == "http://127.0.0.1:8080/recap/"  # a wildcard host: this machine's
    assert fields["admin_key_file"] == str(key_file)
    assert fields["context_windows"] == {"default": 32000, "gpt-4o": 128000, "small": 8000}
    msg = fields["msg"]
    assert f"store {tmp_path / 'data' / 'recap.db'};" in msg
    assert f"page http://127.0.0.1:8080/recap/ (admin key in {key_file}, made now)" in msg
    assert "context windows: gpt-4o 128,000, small 8,000, other models 32,000" in msg


def test_the_start_line_says_where_the_admin_keys_are_or_why_there_are_none() -> None:
    config = parse_config({"store": "sqlite:///:memory:"}, env={})
    fields = started_fields(config, "http://[::1]:9000", PageKey("config"))
    assert "page http://[::1]:9000/recap/ (admin keys from the config)" in fields["msg"]
    assert fields["store"] == "sqlite :memory:" and fields["admin_key_file"] is None
    assert "context windows: every model 96,000" in fields["msg"]
    missing = PageKey("none", Path("/ro/recap-admin-key"), problem="cannot write /ro/x: denied")
    fields = started_fields(config, "http://127.0.0.1:1", missing)
    assert "(no admin key: cannot write /ro/x: denied; set admin_keys)" in fields["msg"]


def test_many_models_are_counted_not_listed() -> None:
    models = {f"m{i}": {"context_window": 1000 + i} for i in range(9)}
    fields = started_fields(parse_config({"models": models}, env={}), "http://h:1", None)
    assert (
        "m0 1,000, m1 1,001, m2 1,002, m3 1,003 and 5 more, other models 96,000" in (fields["msg"])
    )
    assert len(fields["context_windows"]) == 10  # the JSON line has them all
