"""The admin key of a first start: made when the config names none, so the page opens.

Around the process, not the data path: `recap serve` calls `provide_admin_key` before it
builds the app, as Jupyter makes its token. With `admin_keys` configured nothing is made
or read. Without, the key is the one in the key file: made on the first start (random,
`secrets.token_urlsafe(32)`, written with mode 0600) and read again on every later one.
The file is `<database>-admin-key` beside an SQLite file, and `recap-admin-key` in the
config's directory for PostgreSQL or an in-memory store (which have no file of their own).

The key joins the config the app is built from, as its one admin key, so it is held by that
app and nowhere else, and it is an admin key like a configured one: every tenant, on the
page and the `/v1/recap/` routes, never for chat. It is never logged: the start-up line
names the file. A file that cannot be written leaves the page without a key (the proxy
still serves; the start-up line says why); delete the file for a new key.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from proxy.config import Config, ConfigError
from proxy.store import StoreError, sqlite_path
from proxy.store.sqlite import MEMORY

BESIDE_CONFIG = "recap-admin-key"


@dataclass(frozen=True)
class PageKey:
    """Where the app's admin keys came from, for the start-up line (never the key)."""

    source: Literal["config", "file", "none"]
    path: Path | None = None
    # True when this start wrote the file.
    made: bool = False
    # Why no key could be used ("none").
    problem: str | None = None
    # Something the operator should fix, though the key is used.
    warning: str | None = None


def key_file(config: Config) -> Path:
    if config.store.startswith("sqlite:"):
        with contextlib.suppress(StoreError):  # a bad URL: the store says so at start
            db = sqlite_path(config.store, config.base_dir)
            if db != MEMORY:
                return Path(db + "-admin-key")
    return Path(config.base_dir) / BESIDE_CONFIG


def provide_admin_key(config: Config) -> tuple[Config, PageKey]:
    """The config the app is built from, with the key file's key as its admin key when it
    configures none; and what the start-up line says about it."""
    if config.admin_keys:
        return config, PageKey("config")
    path = key_file(config)
    made = False
    try:
        if not path.exists():
            made = _make(path)
        key = path.read_text(encoding="utf-8").strip()
        mode = stat.S_IMODE(path.stat().st_mode)
    except OSError as exc:
        verb = "write" if not path.exists() else "read"
        return config, PageKey("none", path, problem=f"cannot {verb} {path}: {exc.strerror}")
    if not key:
        return config, PageKey(
            "none", path, problem=f"{path} is empty: delete it and restart for a new key"
        )
    for tenant in config.tenants.values():
        if key in tenant.api_keys:
            raise ConfigError(
                f"{path} holds a tenant's proxy key (tenant {tenant.name}): an admin key must "
                "be its own; delete the file for a new one"
            )
    warning = None
    if mode & 0o077:
        warning = f"{path} is readable by others (mode {mode:04o}): chmod 600 it"
    served = dataclasses.replace(config, admin_keys=(key,))
    return served, PageKey("file", path, made=made, warning=warning)


def _make(path: Path) -> bool:
    """Write a new key to `path` whole, or find the one another process wrote first.

    Written to a temporary file and linked into place: the key file is never seen half
    written, and two replicas starting together on one directory share the first key."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{secrets.token_hex(4)}")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.write(secrets.token_urlsafe(32) + "\n")
            out.flush()
            os.fsync(out.fileno())
        os.link(temporary, path)
    except FileExistsError:
        return False
    finally:
        with contextlib.suppress(OSError):
            temporary.unlink()
    return True
