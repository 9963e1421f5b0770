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


BIDI = ["\u202e", "\u202a", "\u202b", "\u202c", "\u202d", "\u200e", "\u200f", "\u061c"]
ISOLATES = ["\u2066", "\u2067", "\u2068", "\u2069"]


@pytest.mark.parametrize("control", [*BIDI, *ISOLATES, "\u2028", "\u2029", "\x85", "\x9b"])
def test_keys_with_bidi_and_other_controls_are_refused(control: str) -> None:
    """A bidi override makes `invoice<U+202E>gpj.exe` read as another key in the web page,
    the CLI and the logs (on ce59ff6 it was accepted): refused like other controls, from
    the body and from a header (whose bytes are UTF-8 read as latin-1)."""
    bad = f"invoice{control}gpj.exe"
    with pytest.raises(BadRequest, match="control characters"):
        conversation_ref(
            CFG, CFG.tenants["open"], {}, {"messages": [], "metadata": {"conversation_id": bad}}
        )
    if control not in ("\x85", "\x9b"):  # a header's latin-1 bytes 0x80-0x9f are UTF-8's
        as_header = bad.encode("utf-8").decode("latin-1")
        with pytest.raises(BadRequest, match="control characters"):
            conversation_ref(CFG, CFG.tenants["open"], {"x-conversation-id": as_header}, {})


def test_keys_in_any_script_are_kept() -> None:
    for key in ["café-ü-1", "会话-42", "تذكرة-7", "…and more"]:
        body = {"messages": [], "metadata": {"conversation_id": key}}
        assert conversation_ref(CFG, CFG.tenants["open"], {}, body).key == key
        # In a header: its UTF-8 bytes, as uvicorn hands them on (latin-1), kept as sent.
        as_header = key.encode("utf-8").decode("latin-1")
        ref = conversation_ref(CFG, CFG.tenants["open"], {"x-conversation-id": as_header}, {})
        assert ref.key == as_header
