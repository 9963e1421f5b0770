"""The compaction reference (proxy/planning/reference.py): it verifies only for the tenant
and secret it was issued under, and names exactly the summary version it was made for."""

from __future__ import annotations

import base64
import json

import pytest

from proxy.planning.reference import BadReference, Reference, is_recap_reference, issue, verify

pytestmark = pytest.mark.quick

SECRET = b"k" * 32
REF = Reference("01a231c1-session", 3, "ab" * 32)


def test_a_reference_verifies_for_its_tenant_and_names_its_version() -> None:
    token = issue(SECRET, "a", REF)
    assert is_recap_reference(token) and token.isascii()
    assert verify(SECRET, "a", token) == REF
    # Deterministic: the same summary gives the same item (Codex retries, prompt caches).
    assert issue(SECRET, "a", REF) == token


@pytest.mark.parametrize(
    ("tenant", "secret"), [("b", SECRET), ("a", b"x" * 32), ("a\x00", SECRET), ("", SECRET)]
)
def test_another_tenant_or_deployment_cannot_use_it(tenant: str, secret: bytes) -> None:
    with pytest.raises(BadReference, match="another tenant"):
        verify(secret, tenant, issue(SECRET, "a", REF))


def test_a_payload_rewritten_under_the_old_mac_fails() -> None:
    token = issue(SECRET, "a", REF)
    mac = token.rsplit(".", 1)[1]
    for change in ({"v": 2}, {"k": "another"}, {"h": "cd" * 32}):
        body = {"k": REF.key, "v": REF.version, "h": REF.boundary_hash} | change
        raw = json.dumps(body, separators=(",", ":")).encode()
        payload = base64.urlsafe_b64encode(raw).rstrip(b"=").decode()
        with pytest.raises(BadReference, match="altered"):
            verify(SECRET, "a", f"recap1.{payload}.{mac}")


@pytest.mark.parametrize(
    "token",
    [
        None,
        "",
        7,
        "gAAAAB-openai-blob",
        "recap1.",
        "recap1.abc",
        "recap1..x",
        "recap1." + "a" * 5000,
    ],
)
def test_anything_else_is_refused_with_a_reason(token: object) -> None:
    with pytest.raises(BadReference) as caught:
        verify(SECRET, "a", token)
    assert str(caught.value)


def test_a_mac_over_a_payload_that_is_not_json_is_still_refused() -> None:
    payload = base64.urlsafe_b64encode(b"not json").rstrip(b"=").decode()
    # A valid MAC on garbage (as a deployment's own bug could make): malformed, not a crash.
    from proxy.planning.reference import _mac

    with pytest.raises(BadReference, match="malformed"):
        verify(SECRET, "a", f"recap1.{payload}.{_mac(SECRET, 'a', payload)}")


def test_the_cheap_look_finds_compaction_however_it_is_spelt() -> None:
    from proxy.planning.remote import may_hold_compaction, read_input

    assert may_hold_compaction(b'{"input":[{"type":"compaction_trigger"}]}')
    escaped = b'{"input":[{"type":"c\\u006fmpaction_trigger"}]}'
    assert may_hold_compaction(escaped) and read_input(json.loads(escaped)["input"]).triggered
    # Ordinary bodies, non-ASCII text escaped or not, are not parsed a second time.
    assert not may_hold_compaction('{"input":"caf\\u00e9 – ok"}'.encode())
    assert not may_hold_compaction('{"input":"café"}'.encode())
