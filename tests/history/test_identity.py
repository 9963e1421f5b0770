"""Tenant selection, conversation keys and request classification (pure, no server)."""

from __future__ import annotations

import pytest

from proxy.config import parse_config
from proxy.errors import BadRequest, Unauthorized
from proxy.history.identity import conversation_ref, resolve_tenant
from proxy.history.messages import Classification, classify

pytestmark = pytest.mark.quick

CFG = parse_config(
    {
        "tenants": {
            "acme": {"api_keys": ["rk-acme"]},
            "open": {},
        }
    },
    env={},
)
CLOSED = parse_config({"tenants": {"acme": {"api_keys": ["rk-acme"]}}}, env={})
SYSTEM = {"role": "system", "content": "You are a bot."}


def test_tenant_by_key_then_open_tenant() -> None:
    assert resolve_tenant(CFG, {"authorization": "Bearer rk-acme"}).name == "acme"
    assert resolve_tenant(CFG, {"authorization": "Bearer sk-user-own-key"}).name == "open"
    assert resolve_tenant(CFG, {}).name == "open"
    with pytest.raises(Unauthorized):
        resolve_tenant(CLOSED, {"authorization": "Bearer nope"})
    with pytest.raises(Unauthorized):
        resolve_tenant(CLOSED, {})


def test_key_precedence() -> None:
    tenant = CFG.tenants["open"]
    body = {"messages": [SYSTEM], "metadata": {"conversation_id": "from-body"}}
    headers = {
        "x-conversation-id": "configured",
        "x-session-id": "session",
        "x-claude-session-id": "vendor",
    }
    assert conversation_ref(CFG, tenant, headers, body).key == "configured"
    headers.pop("x-conversation-id")
    assert conversation_ref(CFG, tenant, headers, body).key == "session"
    headers.pop("x-session-id")
    assert conversation_ref(CFG, tenant, headers, body).key == "vendor"
    assert conversation_ref(CFG, tenant, {}, body).key == "from-body"


def test_derived_key_is_stable_and_namespaced() -> None:
    first = [SYSTEM, {"role": "user", "content": "Book a flight"}]
    later = [
        *first,
        {"role": "assistant", "content": "Sure"},
        {"role": "user", "content": "to Paris"},
    ]
    a = conversation_ref(CFG, CFG.tenants["open"], {}, {"messages": first})
    b = conversation_ref(CFG, CFG.tenants["open"], {}, {"messages": later})
    c = conversation_ref(CFG, CFG.tenants["acme"], {}, {"messages": later})
    other = conversation_ref(
        CFG, CFG.tenants["open"], {}, {"messages": [SYSTEM, {"role": "user", "content": "x"}]}
    )
    assert a == b
    assert a.key == c.key and a != c  # same key, different tenant: different conversations
    assert other.key != a.key


@pytest.mark.parametrize("bad", ["x" * 257, "a\nb", "tab\there", "\x7f"])
def test_bad_sent_keys(bad: str) -> None:
    with pytest.raises(BadRequest):
        conversation_ref(CFG, CFG.tenants["open"], {"x-conversation-id": bad}, {"messages": []})
    with pytest.raises(BadRequest):
        conversation_ref(
            CFG, CFG.tenants["open"], {}, {"messages": [], "metadata": {"conversation_id": bad}}
        )


@pytest.mark.parametrize(
    ("last", "expected"),
    [
        ({"role": "user", "content": "hi"}, Classification.TURN_START),
        ({"role": "user", "content": [{"type": "text", "text": "hi"}]}, Classification.TURN_START),
        ({"role": "user", "content": ""}, Classification.TOOL_CONTINUATION),
        ({"role": "user", "content": None}, Classification.TOOL_CONTINUATION),
        ({"role": "tool", "tool_call_id": "c", "content": "42"}, Classification.TOOL_CONTINUATION),
        ({"role": "assistant", "content": "prefill"}, Classification.OTHER),
        ({"role": "system", "content": "x"}, Classification.OTHER),
    ],
)
def test_classify(last: dict, expected: Classification) -> None:
    assert classify([SYSTEM, last]) == expected


def test_classify_garbage() -> None:
    assert classify([]) == Classification.OTHER
    assert classify(["not a dict"]) == Classification.OTHER


def test_admin_key_is_never_a_tenant_key() -> None:
    cfg = parse_config({"admin_keys": ["adm-1"], "tenants": {"open": {}}}, env={})
    with pytest.raises(Unauthorized):
        resolve_tenant(cfg, {"authorization": "Bearer adm-1"})
    assert resolve_tenant(cfg, {"authorization": "Bearer adm-2"}).name == "open"
