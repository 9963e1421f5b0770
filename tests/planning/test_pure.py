"""The planning layer imports no IO: not httpx, aiosqlite, asyncpg nor asyncio.

Checked in a fresh interpreter (the test process has imported all of them already).
"""

from __future__ import annotations

import pkgutil
import subprocess
import sys

import proxy.dialects
import proxy.planning

IO_MODULES = ("httpx", "aiosqlite", "asyncpg", "asyncio", "starlette", "uvicorn")


def _modules(package: object) -> list[str]:
    path = package.__path__  # type: ignore[attr-defined]
    prefix = package.__name__ + "."  # type: ignore[attr-defined]
    return [m.name for m in pkgutil.iter_modules(path, prefix)]


PURE = [
    "proxy.planning",
    *_modules(proxy.planning),
    "proxy.history.identity",
    "proxy.history.messages",
    "proxy.history.conversation",
    # The adapters' parse and render halves (their streams are relayed by bytes).
    "proxy.dialects",
    *_modules(proxy.dialects),
]


def imported_io(module: str) -> list[str]:
    code = (
        f"import sys, importlib; importlib.import_module({module!r}); "
        f"print(','.join(m for m in {IO_MODULES!r} if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.strip()
    return [m for m in out.split(",") if m]


def test_planners_import_no_io() -> None:
    assert len(PURE) > 10
    assert {m: imported_io(m) for m in PURE} == {m: [] for m in PURE}


def test_the_check_sees_io() -> None:
    # The check itself can fail: a stage module does import the store and httpx.
    assert "httpx" in imported_io("proxy.stages.summarize")
    assert "aiosqlite" in imported_io("proxy.stages.session")
