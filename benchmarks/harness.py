"""The benchmarks' shared harness: servers in their own processes, ports, percentiles, tables.

Outside the data path: every script in `benchmarks/` measures Recap as a real server
(`python -m proxy serve`, its own process) in front of the tests' fake upstream
(`tests/fakes.py`, its own process too), so that no two servers share an event loop or a GIL
with each other or with the load generator. This module starts and stops those processes
(`running`, waiting for `/healthz`), writes Recap's config, serves an app with the uvicorn
settings of `recap serve` (`serve_app`), and formats what the scripts print: the revision and
the stack (`environment`), percentiles, Markdown tables.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import math
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import uvicorn
import yaml

REPO = Path(__file__).resolve().parent.parent


class BenchError(Exception):
    """The benchmark cannot go on (a server did not start, a response was wrong)."""


# -- figures ---------------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between the closest ranks (numpy's default); NaN when empty."""
    if not values:
        return math.nan
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[object]], align: str) -> str:
    """A Markdown table; `align` has one letter per column, `l` (left) or `r` (right)."""
    if len(align) != len(header):
        raise ValueError(f"align {align!r} does not match {len(header)} columns")
    rule = "|" + "|".join("--:" if a == "r" else "---" for a in align) + "|"
    lines = ["| " + " | ".join(header) + " |", rule]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def git_revision() -> str:
    try:
        rev = subprocess.run(
            ["git", "describe", "--always", "--dirty"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        )
        return rev.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def stack() -> str:
    """The servers measured: Recap as `recap serve` runs it (asyncio, `listen.http`'s
    default parser), the bare floor always on asyncio + h11 (benchmarks/overhead.py)."""
    parser = "httptools" if importlib.util.find_spec("httptools") else "h11 (no httptools)"
    return (
        f"uvicorn {uvicorn.__version__}: recap on asyncio + {parser}, bare on asyncio + h11; "
        f"httpx {httpx.__version__}"
    )


def environment() -> str:
    """The line every report starts with: what was measured, on what."""
    return (
        f"revision {git_revision()}; Python {platform.python_version()}; {os.cpu_count()} "
        f"cores; {stack()}"
    )


# -- processes -------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cpu_seconds(pid: int | None) -> float:
    """User + system CPU time of a process (Linux /proc; 0 where it cannot be read); of this
    process when `pid` is None."""
    if pid is None:
        return time.process_time()
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def redact(url: str) -> str:
    """A store URL without its password, for messages."""
    scheme, sep, rest = url.partition("://")
    creds, at, host = rest.rpartition("@")
    if not sep or not at or ":" not in creds:
        return url
    return f"{scheme}://{creds.split(':', 1)[0]}:***@{host}"


@dataclass
class Server:
    name: str
    url: str
    proc: subprocess.Popen[bytes]
    log: Path

    def log_tail(self, lines: int = 12) -> str:
        try:
            text = self.log.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:]) or "(empty log)"


@contextlib.contextmanager
def running(
    name: str,
    cmd: Sequence[str],
    port: int,
    workdir: Path,
    ready_s: float = 30,
    health: str = "/healthz",
) -> Iterator[Server]:
    """Start a server process, wait (at most `ready_s`) until `health` answers 200, stop it
    (SIGINT, then kill)."""
    log = workdir / f"{name}.log"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    with log.open("wb") as out:
        proc = subprocess.Popen(
            cmd, cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT
        )
    server = Server(name, f"http://127.0.0.1:{port}", proc, log)
    try:
        deadline = time.monotonic() + ready_s
        with httpx.Client(trust_env=False, timeout=2) as client:
            while True:
                if proc.poll() is not None:
                    raise BenchError(
                        f"{name} exited with code {proc.returncode} before it was "
                        f"ready; the end of its log ({log}):\n{server.log_tail()}"
                    )
                with contextlib.suppress(httpx.TransportError):
                    if client.get(server.url + health).status_code == 200:
                        break
                if time.monotonic() > deadline:
                    raise BenchError(
                        f"{name} did not answer {health} within {ready_s:g} s:\n{server.log_tail()}"
                    )
                time.sleep(0.05)
        yield server
    finally:
        if proc.poll() is None:
            # SIGINT, not SIGTERM: uvicorn shuts down gracefully on both, then re-raises the
            # signal, and only SIGINT (KeyboardInterrupt) lets cProfile write its stats.
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)


def serve_app(app: Any, port: int, *, backlog: int = 2048) -> None:
    """Serve `app` in this process on 127.0.0.1, with the uvicorn settings of `recap serve`
    (proxy/ops/cli.py), so a fake or a bare proxy differs from Recap only in its application;
    but idle connections close after uvicorn's default 5 s, as uvicorn-based upstreams (vLLM,
    ...) close theirs: the proxy's pool must cope with that, and the soak's connection counts
    fall back to 0 when the load stops."""
    uvicorn.run(
        app,
        host="127.0.0.1",
        port=port,
        log_config=None,
        access_log=False,
        timeout_graceful_shutdown=10,
        server_header=False,
        date_header=False,
        backlog=backlog,
    )


def in_workdir(
    run: Callable[[argparse.Namespace, Sequence[str], Path], int],
    args: argparse.Namespace,
    argv: Sequence[str],
    name: str,
) -> int:
    """Run benchmark `name` in `--workdir` (kept) or a temporary directory; a BenchError ends
    it with its message and exit status 1."""
    try:
        if args.workdir:
            Path(args.workdir).mkdir(parents=True, exist_ok=True)
            return run(args, argv, Path(args.workdir).resolve())
        with tempfile.TemporaryDirectory(prefix=f"recap-{name}-") as tmp:
            return run(args, argv, Path(tmp))
    except BenchError as exc:
        print(f"{name} failed: {exc}", file=sys.stderr)
        return 1


# -- Recap -----------------------------------------------------------------------------------


def write_config(path: Path, data: dict[str, Any]) -> Path:
    """Write Recap's config (the packaged prompts unless the config names a scenes_dir)."""
    path.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    return path


def recap_command(config: Path, port: int, runner: Sequence[str] = ("-m", "proxy")) -> list[str]:
    """`python -m proxy serve` on 127.0.0.1 with JSON logs; `runner` replaces `-m proxy`
    (under cProfile: `-m cProfile -o OUT -m proxy`)."""
    return [
        sys.executable,
        *runner,
        *("serve", "--host", "127.0.0.1", "--port", str(port), "--log-format", "json"),
        *("--config", str(config)),
    ]


def fake_command(module: str, port: int, *options: str) -> list[str]:
    """The command that serves a script's fake upstream: `python -m MODULE --serve-fake`."""
    return [sys.executable, "-m", module, "--serve-fake", "--port", str(port), *options]
