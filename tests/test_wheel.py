"""The package as a user installs it: a wheel in a fresh venv, a config in another directory.

The default summarizer prompts are package data (the top-level scenes/, shipped as
proxy/scenes_default/): a wheel without them starts nowhere but in a clone; so is the
commented config `recap init` writes (proxy/config_default.yaml). This builds the wheel from
the sources alone, installs it into a new venv in a temporary directory and runs its `recap
serve` against a fake upstream until a request compacts with the packaged prompt.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import time
import venv
import zipfile
from pathlib import Path

import httpx
import pytest
import yaml

from tests.fakes import FakeUpstream
from tests.faults import compacting_data, history, summaries_in
from tests.servers import free_port

REPO = Path(__file__).resolve().parent.parent


def build_wheel(out: Path) -> Path:
    """`pip wheel --no-deps` on a copy of what the build reads (no build/ or egg-info in
    the clone; no build isolation, so nothing is downloaded: setuptools is a test extra)."""
    src = out / "src"
    src.mkdir(parents=True)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    for folder in ("proxy", "scenes"):
        shutil.copytree(REPO / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run(
        [
            *(sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation"),
            *("-w", str(out), str(src)),
        ],
        check=True,
    )
    (wheel,) = out.glob("recap-*.whl")
    return wheel


def fresh_venv(where: Path, wheel: Path) -> Path:
    """A new venv with the wheel installed; its dependencies come from this test's
    environment through a .pth line (so no download), but `proxy` only from the wheel."""
    venv.EnvBuilder(with_pip=False).create(where)
    python = where / "bin" / "python"
    subprocess.run(
        [
            *(sys.executable, "-m", "pip", "--python", str(python), "install", "-q"),
            *("--no-deps", "--no-index", str(wheel)),
        ],
        check=True,
    )
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    # Paths named in a .pth are added to sys.path, but .pth files inside them are not read:
    # this environment's editable install of the clone stays out of the fresh venv.
    (Path(site) / "test-deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return python


@pytest.mark.timeout(600)  # subprocess starts: seconds of CPU each
def test_a_wheel_in_a_fresh_venv_compacts_with_its_packaged_prompts(
    tmp_path: Path, upstream_url: str, fake: FakeUpstream
) -> None:
    wheel = build_wheel(tmp_path / "wheel")
    names = set(zipfile.ZipFile(wheel).namelist())
    packaged = {n for n in names if n.startswith("proxy/scenes_") and n.endswith(".yaml")}
    assert packaged == {
        "proxy/scenes_default/session_compact.yaml",
        "proxy/scenes_default/loop_compact.yaml",
    }
    # Every folder of the package is in the wheel (pyproject.toml lists them by name).
    folders = {p.relative_to(REPO).as_posix() for p in (REPO / "proxy").rglob("__init__.py")}
    assert folders and folders <= names
    python = fresh_venv(tmp_path / "venv", wheel)
    where = subprocess.run(
        [str(python), "-c", "import proxy; print(proxy.__file__)"],
        check=True,
        capture_output=True,
        text=True,
        cwd=tmp_path,
    ).stdout
    assert Path(where).resolve().is_relative_to((tmp_path / "venv").resolve())

    # The commented config is package data: `recap init` writes it with no clone about.
    assert "proxy/config_default.yaml" in zipfile.ZipFile(wheel).namelist()
    init = subprocess.run(
        [str(python.parent / "recap"), "init", "first"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=True,
    )
    assert init.stdout.startswith("wrote first/config.yaml")
    assert (tmp_path / "first" / "config.yaml").read_bytes() == (REPO / "config.yaml").read_bytes()

    # A config in a directory of its own, naming no scenes_dir; the server runs from there.
    home = tmp_path / "elsewhere"
    home.mkdir()
    config = compacting_data(upstream_url, home, store="sqlite:///./state/recap.db")
    (home / "recap.yaml").write_text(yaml.safe_dump(config))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "RECAP_CONFIG")}
    port = free_port()
    proc = subprocess.Popen(
        [
            *(str(python.parent / "recap"), "serve", "--config", "recap.yaml"),
            *("--port", str(port), "--log-format", "json"),
        ],
        cwd=home,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120  # a hang guard
        while True:
            try:
                if httpx.get(f"{base}/readyz").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None, "recap serve exited"
            assert time.monotonic() < deadline, "recap serve did not become ready"
            time.sleep(0.2)
        r = httpx.post(
            f"{base}/v1/chat/completions",
            json={"model": "small", "messages": history()},
            headers={"x-conversation-id": "from-a-wheel"},
            timeout=60,
        )
        assert r.status_code == 200
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=20)

    # The summarizer got the packaged prompt, and the model a history with its summary.
    scene = yaml.safe_load((REPO / "scenes" / "session_compact.yaml").read_text())
    (summarize,) = fake.chat_requests("summarize")
    system = summarize.json["messages"][0]
    assert system["role"] == "system"
    assert system["content"].startswith(scene["system"].strip().splitlines()[0])
    assert summaries_in(fake.chat_requests()[-1].json["messages"]) != []
    assert (home / "state" / "recap.db").exists()
    access = [json.loads(x) for x in err.splitlines() if '"recap.access"' in x]
    assert len(access) == 1, err


def test_the_dockerfile_builds_from_what_the_wheel_needs() -> None:
    """The image installs the package as the quick start does (`pip install .` into a venv)
    from files that exist, and needs no scenes beside its config."""
    text = (REPO / "Dockerfile").read_text(encoding="utf-8")
    sources = [
        src for line in text.splitlines() if line.startswith("COPY ") for src in line.split()[1:-1]
    ]
    assert sources, "no COPY in the Dockerfile"
    assert [s for s in sources if not (REPO / s).exists()] == []
    assert {"pyproject.toml", "README.md", "proxy"} <= set(sources)
    assert "pip install" in text and "venv" in text
    assert "pip install ." in (REPO / "README.md").read_text(encoding="utf-8")
