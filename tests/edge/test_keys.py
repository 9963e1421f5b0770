"""Keys and control headers at the edge (issue 13 item 8), through real servers.

An admin key opens the operator routes and nothing else: with an open tenant it is
still not a chat key (401, never forwarded upstream as the client's bearer). And the
`x-recap-*` namespace belongs to the proxy: what a client sends under it is read by
Recap (x-recap-compaction) or dropped, never forwarded, so an upstream can tell the
proxy's own summarizer calls (x-recap-purpose) from a client's.
"""

from __future__ import annotations

from collections.abc import Callable

import httpx
import openai
import pytest

from tests.fakes import FakeUpstream

pytestmark = pytest.mark.quick

ADMIN = "adm-secret-K9q2"
BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def test_admin_key_is_not_a_chat_key_even_with_an_open_tenant(
    proxy_factory: Callable[..., str], fake: FakeUpstream
) -> None:
    url = proxy_factory(admin_keys=[ADMIN])
    client = openai.OpenAI(base_url=url, api_key=ADMIN, max_retries=0)
    with pytest.raises(openai.AuthenticationError) as info:
        client.chat.completions.create(model="m", messages=BODY["messages"])
    assert info.value.status_code == 401
    # Nor on the pass-through routes.
    r = httpx.get(f"{url}/models", headers={"authorization": f"Bearer {ADMIN}"})
    assert r.status_code == 401
    assert r.json()["error"]["code"] == "invalid_api_key"
    assert fake.requests == []
    # The admin key still opens the operator routes.
    r = httpx.get(f"{url}/recap/conversations", headers={"authorization": f"Bearer {ADMIN}"})
    assert r.status_code == 200
    # And a client's own key still goes through the open tenant to the upstream.
    openai.OpenAI(base_url=url, api_key="sk-own", max_retries=0).chat.completions.create(
        model="m", messages=BODY["messages"]
    )
    (sent,) = fake.chat_requests()
    assert sent.headers["authorization"] == "Bearer sk-own"


@pytest.mark.parametrize("route", ["chat/completions", "echo/x"])
def test_client_sent_recap_headers_are_not_forwarded(
    proxy_url: str, fake: FakeUpstream, route: str
) -> None:
    headers = {
        "x-recap-purpose": "summarize",
        "x-recap-compaction": "off",
        "x-recap-anything": "1",
        "x-custom": "kept",
    }
    r = httpx.post(f"{proxy_url}/{route}", json=BODY, headers=headers)
    assert r.status_code == 200
    (sent,) = fake.requests
    assert sent.purpose == "chat"  # the fake reads x-recap-purpose
    assert not [k for k in sent.headers if k.startswith("x-recap-")]
    assert sent.headers["x-custom"] == "kept"
