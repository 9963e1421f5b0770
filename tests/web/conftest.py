"""The web page's servers: a fake upstream and a two-tenant compacting proxy, on uvicorn.

`site` serves them and seeds tenant a with one compacted conversation whose
messages carry a `<script>` (the page must show it as text), and tenant b with a
conversation of its own; both are archived before the tests look. `first_start_site`
is the same proxy as an operator starts it: `recap serve` in its own process on a config
with no admin_keys, so its admin key is the one a first start writes to its key file.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import pytest

from proxy.config import parse_config
from tests.fakes import FakeUpstream
from tests.faults import compacting_data, history, post
from tests.servers import free_port, recap_app, serve

ADMIN = "admin-key-0123"
KEYS = {"a": "tenant-a-key", "b": "tenant-b-key"}
SCRIPT = "<script>alert('x')</script>"
CONV_A = "conv-a/1 & <u>x</u>"
CONV_B = "conv-b"


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


@dataclass
class Site:
    url: str  # the proxy's base URL, without /v1
    upstream: FakeUpstream
    admin: str = ADMIN  # an admin key the site takes
    # The key file a first start wrote (`first_start_site` only).
    key_file: Path | None = None

    def chat(self, tenant: str, conv: str, messages: list[dict[str, Any]]) -> None:
        r = post(self.url + "/v1", messages, conv, headers=bearer(KEYS[tenant]))
        assert r.status_code == 200, r.text

    def detail(self, tenant: str, conv: str) -> dict[str, Any]:
        r = httpx.get(
            f"{self.url}/v1/recap/conversations/{quote(conv, safe='')}",
            params={"tenant": tenant},
            headers=bearer(self.admin),
        )
        assert r.status_code == 200, r.text
        data: dict[str, Any] = r.json()
        return data

    def wait_archived(self, tenant: str, conv: str, requests: int) -> None:
        """Events are written just after each response: wait (bounded) for the request's."""
        deadline = time.monotonic() + 10
        while True:
            r = httpx.get(
                f"{self.url}/v1/recap/conversations/{quote(conv, safe='')}/archive",
                params={"tenant": tenant},
                headers=bearer(self.admin),
            )
            kinds = [line.split('"type":')[1][:12] for line in r.text.splitlines()[1:]]
            if r.status_code == 200 and sum('"request"' in k for k in kinds) >= requests:
                return
            assert time.monotonic() < deadline, "the archive did not settle"
            time.sleep(0.02)


def site_data(upstream_url: str, tmp_path: Path) -> dict[str, Any]:
    data = compacting_data(upstream_url, tmp_path)
    tenant = data["tenants"]["default"]
    data["tenants"] = {name: {**tenant, "api_keys": [key]} for name, key in KEYS.items()}
    return data


def site_config(upstream_url: str, tmp_path: Path) -> Any:
    data = {**site_data(upstream_url, tmp_path), "admin_keys": [ADMIN]}
    return parse_config(data, env={}, base_dir=str(tmp_path))


@contextmanager
def in_process(fake: FakeUpstream, tmp_path: Path) -> Iterator[Site]:
    with (
        serve(fake.app) as upstream_url,
        serve(recap_app(site_config(upstream_url, tmp_path))) as url,
    ):
        yield Site(url, fake)


@contextmanager
def recap_serve(fake: FakeUpstream, tmp_path: Path) -> Iterator[Site]:
    """`recap serve` on a config without admin_keys; the key is read from the file its
    start-up line names, as an operator reads it."""
    with serve(fake.app) as upstream_url:
        config = tmp_path / "config.yaml"
        config.write_text(json.dumps(site_data(upstream_url, tmp_path)))  # JSON is YAML
        log = tmp_path / "recap.log"
        port = free_port()
        with log.open("w") as err:
            proc = subprocess.Popen(
                [
                    *(sys.executable, "-m", "proxy", "serve", "--config", str(config)),
                    *("--port", str(port), "--log-format", "json"),
                ],
                stdout=subprocess.DEVNULL,
                stderr=err,
            )
        admin = None
        try:
            deadline = time.monotonic() + 60
            while not log.read_text().strip():
                assert proc.poll() is None, "recap serve exited"
                assert time.monotonic() < deadline, "recap serve did not start"
                time.sleep(0.05)
            started = json.loads(log.read_text().splitlines()[0])
            assert started["event"] == "started", started
            key_file = Path(started["admin_key_file"])
            admin = key_file.read_text().strip()
            yield Site(started["page"].removesuffix("/recap/"), fake, admin, key_file)
        finally:
            proc.terminate()
            proc.wait(timeout=20)
        assert admin is None or admin not in log.read_text()  # the key itself is never logged


@contextmanager
def running_site(
    tmp_path: Path,
    start: Callable[[FakeUpstream, Path], AbstractContextManager[Site]] = in_process,
) -> Iterator[Site]:
    fake = FakeUpstream()
    with start(fake, tmp_path) as s:
        s.chat("a", CONV_A, history(marker=SCRIPT))
        s.wait_archived("a", CONV_A, 1)
        assert s.detail("a", CONV_A)["current_version"] == 1  # it compacted
        # Later requests, longer: the page's "Compact now" can fold more of them.
        for turns in range(48, 61, 3):
            s.chat("a", CONV_A, history(turns=turns, marker=SCRIPT))
        s.chat("b", CONV_B, history(turns=3, marker="tenant b only"))
        s.wait_archived("a", CONV_A, 6)
        s.wait_archived("b", CONV_B, 1)
        yield s


@pytest.fixture
def first_start_site(tmp_path: Path) -> Iterator[Site]:
    """A site as `recap serve` runs it on its first start: its admin key is in a key file."""
    with running_site(tmp_path, recap_serve) as s:
        yield s


@pytest.fixture
def site(tmp_path: Path) -> Iterator[Site]:
    """A site of its own, for tests that change it (compact, roll back)."""
    with running_site(tmp_path) as s:
        yield s


@pytest.fixture(scope="module")
def shared_site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Site]:
    """One site for a module's tests that only look."""
    with running_site(tmp_path_factory.mktemp("web")) as s:
        yield s
