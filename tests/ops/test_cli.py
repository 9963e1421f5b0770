"""`recap serve` as a real subprocess: the console entry point, config, JSON logs on stderr."""

from __future__ import annotations

import importlib.metadata
import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from proxy.config import load_config
from proxy.ops.cli import main
from tests.fakes import FakeUpstream
from tests.servers import free_port

REPO = Path(__file__).resolve().parents[2]


def test_serve_subprocess_forwards_and_logs(
    tmp_path: Path, upstream_url: str, fake: FakeUpstream
) -> None:
    port = free_port()
    cfg = tmp_path / "config.yaml"
    cfg.write_text(
        yaml.safe_dump(
            {
                "store": "sqlite:///./state/recap.db",
                "tenants": {"default": {"upstream": {"base_url": "${UP}/v1"}}},
            }
        )
    )
    env = {**os.environ, "UP": upstream_url, "RECAP_CONFIG": str(cfg)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "proxy", "serve", "--port", str(port), "--log-format", "json"],
        env=env,
        stderr=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
    )
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 20
        while True:
            try:
                if httpx.get(f"{base}/readyz").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline and proc.poll() is None, "proxy did not become ready"
            time.sleep(0.1)
        r = httpx.post(
            f"{base}/v1/chat/completions",
            json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
        )
        assert r.status_code == 200
        assert len(fake.chat_requests()) == 1
        assert (tmp_path / "state" / "recap.db").exists()  # relative to the config file
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=15)
    lines = [json.loads(x) for x in err.splitlines() if x.startswith("{")]
    access = [x for x in lines if x.get("logger") == "recap.access"]
    assert [x["path"] for x in access] == ["/v1/chat/completions"]  # health checks stay out
    # The first line says the server is up, where, on which store and upstreams; the last
    # that it stopped. "stopping" comes between: a request that was still being archived
    # when the signal came may log its access line after it (the drain waits for it).
    started, stopped = lines[0], lines[-1]
    server = [x.get("event") for x in lines if x.get("logger") == "recap.server"]
    assert server == ["started", "stopping", "stopped"]
    assert started["event"] == "started" and started["logger"] == "recap.server"
    assert started["address"] == f"http://127.0.0.1:{port}"
    # The file the store is, resolved against the config's directory (the URL is relative).
    assert started["store"] == str((tmp_path / "state" / "recap.db").resolve())
    host = upstream_url.removeprefix("http://")
    assert started["tenants"] == [{"name": "default", "upstream": host, "open": True}]
    assert started["version"] == importlib.metadata.version("recap")
    assert f"listening on http://127.0.0.1:{port}" in started["msg"]
    assert stopped["event"] == "stopped" and stopped["uptime_s"] >= 0


def test_serve_in_text_says_it_is_up_and_that_it_stopped(tmp_path: Path, upstream_url: str) -> None:
    port = free_port()
    cfg = tmp_path / "config.yaml"
    cfg.write_text(
        yaml.safe_dump(
            {
                "store": "sqlite:///./recap.db",
                "tenants": {"default": {"upstream": {"base_url": f"{upstream_url}/v1"}}},
            }
        )
    )
    proc = subprocess.Popen(
        [
            *(sys.executable, "-m", "proxy", "serve", "--config", str(cfg)),
            *("--port", str(port), "--log-format", "text"),
        ],
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert proc.stderr is not None
        day = proc.stderr.readline()  # the date and zone of the times below
        first = proc.stderr.readline()  # written once the socket is bound
        assert httpx.get(f"http://127.0.0.1:{port}/healthz").status_code == 200
    finally:
        proc.terminate()
        _, rest = proc.communicate(timeout=15)
    assert f"listening on http://127.0.0.1:{port}; page http://127.0.0.1:{port}/recap/" in first
    assert f"; store {(tmp_path / 'recap.db').resolve()};" in first
    assert (
        "prompts packaged; context windows: every model 96,000; tenants: default \u2192 127.0.0.1:"
        in first
    )
    assert "{" not in first and "\033[" not in first  # text, and no colours off a terminal
    assert day.startswith("-- ") and ", times in " in day
    assert rest.splitlines()[-1].split(maxsplit=2)[2].startswith("recap stopped after ")


def test_bad_config_exits_2_naming_the_key(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("listen: {host: x, prot: 1}\n")
    r = subprocess.run(
        [sys.executable, "-m", "proxy", "serve", "--config", str(cfg)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2
    assert "unknown config key: listen.prot" in r.stderr


def test_missing_scene_stops_start_with_its_name(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("scenes_dir: ./nowhere\n")
    r = subprocess.run(
        [sys.executable, "-m", "proxy", "serve", "--config", str(cfg)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2
    assert "session_compact.yaml" in r.stderr


def test_an_unset_variable_stops_the_start_naming_it(tmp_path: Path) -> None:
    # Before: the server started, /readyz said ready, and every request got a 502 naming
    # an upstream of "" ("UnsupportedProtocol").
    cfg = tmp_path / "c.yaml"
    cfg.write_text("tenants: {default: {upstream: {base_url: '${RECAP_TEST_UNSET_UP}'}}}\n")
    env = {k: v for k, v in os.environ.items() if k != "RECAP_TEST_UNSET_UP"}
    r = subprocess.run(
        [sys.executable, "-m", "proxy", "serve", "--config", str(cfg)],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert r.returncode == 2, r.stderr
    assert "tenants.default.upstream.base_url: ${RECAP_TEST_UNSET_UP} is not set" in r.stderr


def test_init_writes_the_commented_config_and_never_overwrites(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    where = tmp_path / "new"
    assert main(["init", str(where)]) == 0
    out = capsys.readouterr().out
    written = where / "config.yaml"
    assert written.read_bytes() == (REPO / "config.yaml").read_bytes()
    assert out.startswith(f"wrote {written}; edit it")
    for key in ("tenants.default.upstream.base_url", "api_key", "admin_keys", "models"):
        assert key in out
    assert f"recap serve --config {written}" in out
    config = load_config(written, env={})  # starts on a machine with nothing set
    assert config.base_dir == str(where.resolve())

    written.write_text("# mine\n")
    assert main(["init", str(where)]) == 1
    assert "exists: not overwritten" in capsys.readouterr().err
    assert written.read_text() == "# mine\n"


def test_the_packaged_config_is_the_shipped_one() -> None:
    # `recap init` writes the package's copy (a wheel has no repository beside it).
    assert (REPO / "proxy" / "config_default.yaml").read_bytes() == (
        REPO / "config.yaml"
    ).read_bytes()


def test_a_missing_config_says_how_to_make_one(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "RECAP_CONFIG"}
    r = subprocess.run(
        [sys.executable, "-m", "proxy", "conversations"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
        env=env,
    )
    assert r.returncode == 2
    assert "cannot read config config.yaml: no such file (`recap init`" in r.stderr


def test_a_first_start_makes_an_admin_key_that_opens_the_page(tmp_path: Path) -> None:
    """No admin_keys: the first start writes a key file (0600) beside the database and names
    it, never the key, in its start-up line; the key logs in to the page; a restart keeps it."""
    cfg = tmp_path / "config.yaml"
    cfg.write_text(yaml.safe_dump({"store": "sqlite:///./data/recap.db"}))

    def start() -> tuple[dict[str, Any], str]:
        port = free_port()
        proc = subprocess.Popen(
            [
                *(sys.executable, "-m", "proxy", "serve", "--config", str(cfg)),
                *("--port", str(port), "--log-format", "json"),
            ],
            stderr=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            text=True,
        )
        try:
            assert proc.stderr is not None
            started = json.loads(proc.stderr.readline())
            assert started["event"] == "started", started
            key = Path(started["admin_key_file"]).read_text().strip()
            page = started["page"]
            assert page == f"http://127.0.0.1:{port}/recap/"
            r = httpx.post(page + "login", data={"key": key}, headers={"origin": page[:-7]})
            assert r.status_code == 303 and "recap_session" in r.cookies
            assert httpx.get(page, cookies=r.cookies).status_code == 200
            # An admin key, like a configured one: never for chat.
            r = httpx.post(
                page[:-7] + "/v1/chat/completions",
                json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
                headers={"authorization": f"Bearer {key}"},
            )
            assert r.status_code == 401
        finally:
            proc.terminate()
            _, rest = proc.communicate(timeout=15)
        assert key not in rest and key not in json.dumps(started)
        return started, key

    first, key = start()
    path = (tmp_path / "data" / "recap.db-admin-key").resolve()
    assert first["admin_key_file"] == str(path) and first["admin_keys"] == "file"
    assert f"(admin key in {path}, made now)" in first["msg"]
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    second, again = start()
    assert again == key and "made now" not in second["msg"]

    # Configured admin keys: nothing is made, and the start-up line says where they are.
    path.unlink()
    cfg.write_text(yaml.safe_dump({"store": "sqlite:///./data/recap.db", "admin_keys": ["ak-1"]}))
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "proxy", "serve", "--config", str(cfg), "--port", str(port)],
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert proc.stderr is not None
        line = proc.stderr.readline()
    finally:
        proc.terminate()
        proc.communicate(timeout=15)
    assert "(admin keys from the config)" in line and not path.exists()
