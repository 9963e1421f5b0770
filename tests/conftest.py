"""Shared fixtures: a fake upstream and a Recap proxy, each on a real uvicorn on loopback."""

from __future__ import annotations

import io
import json
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest

from proxy.config import Config, parse_config
from proxy.ops.logs import JsonFormatter
from tests.fakes import FakeUpstream
from tests.faults import SummarizerFake, compacting_config
from tests.servers import recap_app, serve

REPO = Path(__file__).resolve().parent.parent
DATA = REPO / "tests" / "data" / "taubench-airline-dev.jsonl"


def load_sessions() -> list[dict[str, Any]]:
    with DATA.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


@pytest.fixture(scope="session")
def taubench() -> list[dict[str, Any]]:
    # No skip when the file is missing: it ships in tests/data, so missing means a broken checkout.
    return load_sessions()


@pytest.fixture
def fake() -> Iterator[FakeUpstream]:
    yield FakeUpstream()


@pytest.fixture
def upstream_url(fake: FakeUpstream) -> Iterator[str]:
    with serve(fake.app) as url:
        yield url


class LogCapture:
    """The proxy's log lines as parsed JSON records (what operators would read)."""

    def __init__(self) -> None:
        self.stream = io.StringIO()
        self.handler = logging.StreamHandler(self.stream)
        self.handler.setFormatter(JsonFormatter())

    @property
    def text(self) -> str:
        return self.stream.getvalue()

    def records(self, logger: str | None = None) -> list[dict[str, Any]]:
        out = [json.loads(line) for line in self.text.splitlines() if line.strip()]
        return [r for r in out if logger is None or r.get("logger") == logger]

    def access(self, expect: int = 1, timeout: float = 30.0) -> list[dict[str, Any]]:
        """Access lines; waits for `expect` of them, since a line is written just after
        the response has gone out (the client may read it first). `timeout` is a hang
        guard for a loaded machine: it returns as soon as they are there."""
        deadline = time.monotonic() + timeout
        while len(lines := self.records("recap.access")) < expect and time.monotonic() < deadline:
            time.sleep(0.01)
        return lines


@pytest.fixture
def logs() -> Iterator[LogCapture]:
    cap = LogCapture()
    root = logging.getLogger("recap")
    old_level = root.level
    root.addHandler(cap.handler)
    root.setLevel(logging.INFO)
    yield cap
    root.removeHandler(cap.handler)
    root.setLevel(old_level)


def make_config(upstream_url: str, tmp_path: Path, **overrides: Any) -> Config:
    data: dict[str, Any] = {
        "store": f"sqlite:///{tmp_path / 'recap.db'}",
        "tenants": {
            "default": {
                "api_keys": [],
                "upstream": {"base_url": f"{upstream_url}/v1", "timeout_s": 30},
            }
        },
    }
    for key, value in overrides.items():
        data[key] = value
    return parse_config(data, env={}, base_dir=str(tmp_path))


@pytest.fixture
def proxy_factory(upstream_url: str, tmp_path: Path) -> Iterator[Callable[..., str]]:
    """Start a proxy with config overrides; returns its base URL (ending in /v1)."""
    with ExitStack() as stack:

        def start(config: Config | None = None, **overrides: Any) -> str:
            cfg = config or make_config(upstream_url, tmp_path, **overrides)
            return stack.enter_context(serve(recap_app(cfg))) + "/v1"

        yield start


@pytest.fixture
def proxy_url(proxy_factory: Callable[..., str]) -> str:
    return proxy_factory()


# -- the fault tests' servers: an upstream whose summarizer calls a test scripts, and
# proxies that compact against it (tests/faults.py) ----------------------------------------


@pytest.fixture
def upstream() -> Iterator[tuple[SummarizerFake, str]]:
    fake = SummarizerFake()
    with serve(fake) as url:
        yield fake, url


@pytest.fixture
def start(tmp_path: Path) -> Iterator[Callable[..., str]]:
    """Start a compacting proxy on an upstream URL, with config overrides; returns its /v1 URL."""
    with ExitStack() as stack:

        def run(upstream_url: str, **kwargs: Any) -> str:
            config = compacting_config(upstream_url, tmp_path, **kwargs)
            return stack.enter_context(serve(recap_app(config))) + "/v1"

        yield run
