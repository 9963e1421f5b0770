"""Odd spellings of a route's path cannot reach the upstream's route around Recap.

`/v1/./chat/completions`, `/v1/chat/../chat/completions`, `/v1//chat/completions` and
`/v1/chat/completions/` name the chat route to the upstream (its server resolves dot
segments, merges slashes or redirects the slash away); on ce59ff6 they went out as
pass-through, so the request was neither archived nor compacted. Recap routes and
forwards the canonical path, so what it archives and compacts is what the upstream
serves. The operator and web paths keep their segments (a conversation key may be `..`).
"""

from __future__ import annotations

import http.client
import json
from collections.abc import Callable
from urllib.parse import unquote, urlsplit

import httpx
import pytest

from proxy.edge.paths import canonical
from tests.fakes import FakeUpstream

ODD = [
    "/v1/./chat/completions",
    "/v1/chat/../chat/completions",
    "/v1//chat/completions",
    "/v1/chat/completions/",
    "/v1/chat/completions//",
    "/v1/chat/%2e/completions",
    "/v1/x/%2E%2E/chat/completions",
    "/../v1/chat/completions",
]


@pytest.mark.parametrize("path", ODD)
def test_odd_spellings_are_the_chat_route(
    path: str, proxy_factory: Callable[..., str], fake: FakeUpstream
) -> None:
    url = proxy_factory(inspection_open=True)
    parts = urlsplit(url)
    # http.client sends the path as written (httpx would resolve the dots itself).
    conn = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=30)
    body = {"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]}
    conn.request(
        "POST",
        path,
        body=json.dumps(body),
        headers={"content-type": "application/json", "x-conversation-id": "odd"},
    )
    answer = conn.getresponse()
    assert answer.status == 200, answer.read()
    answer.read()
    conn.close()
    (sent,) = fake.chat_requests()
    assert sent.path == "/v1/chat/completions"
    # The compacting route took it: the request is in the archive.
    listed = httpx.get(f"{url}/recap/conversations", timeout=30).json()
    assert [c["key"] for c in listed["data"]] == ["odd"]


def test_canonical_paths() -> None:
    for path in ODD:
        # As uvicorn hands it on: percent-decoded.
        assert canonical(unquote(path)) == "/v1/chat/completions", path
    assert canonical("/v1/chat/completions") == "/v1/chat/completions"
    assert canonical("/v1/models/") == "/v1/models"
    assert canonical("/") == "/"
    assert canonical("/healthz") == "/healthz"
    # A conversation key is one segment of the operator and web paths, whatever it is.
    assert canonical("/v1/recap/conversations/../view") == "/v1/recap/conversations/../view"
    assert canonical("/recap/conversation/") == "/recap/conversation/"
