"""The start-up line: what it names, and what it never shows (passwords, user parts)."""

from __future__ import annotations

from proxy.config import parse_config
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
