"""The server's start and stop lines: what `recap serve` says before the first request.

Around the whole process, not the data path: `recap serve` runs the app on a uvicorn
`Server` subclass that logs one line once the socket is bound (the address, the web
page's URL and where its admin key is, the store (the SQLite file resolved against the
config's directory, or the URL without secrets), the prompts, the context windows in use,
each tenant's upstream host and whether it is open, the version), one when shutdown starts
and one when it is done. The lines are `recap.server` records with an `event` field; their
`msg` says everything, for the text format and `recap tail`, and the JSON line carries the
same as fields.
"""

from __future__ import annotations

import logging
import socket
import time
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as package_version
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit

import uvicorn

from proxy.config import Config
from proxy.ops.admin_key import PageKey
from proxy.store import StoreError, sqlite_path

# Models whose windows the start-up line lists by name; the rest are counted.
LISTED_MODELS = 4

log = logging.getLogger("recap.server")

# Query parameters that may carry a secret (asyncpg takes `password` in the query too).
_SECRET_PARAMS = ("password", "secret", "token", "key")


def recap_version() -> str:
    try:
        return package_version("recap")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"


def safe_url(url: str) -> str:
    """The URL with its password (in the user part or the query) replaced by ***."""
    parts = urlsplit(url)
    pairs = parse_qsl(parts.query, keep_blank_values=True)
    if parts.password is None and not any(_secret(k) for k, _ in pairs):
        return url  # as written (urlsplit would turn sqlite:///x into sqlite://x)
    netloc = parts.netloc
    if parts.password is not None:
        netloc = f"{parts.username or ''}:***@{netloc.rsplit('@', 1)[1]}"
    query = urlencode([(k, "***" if _secret(k) else v) for k, v in pairs], safe="*")
    return parts._replace(netloc=netloc, query=query).geturl()


def _secret(name: str) -> bool:
    return any(s in name.lower() for s in _SECRET_PARAMS)


def upstream_host(base_url: str) -> str:
    """host[:port] of an upstream URL: never its user part, path or query."""
    parts = urlsplit(base_url)
    host = parts.hostname or base_url
    if ":" in host:
        host = f"[{host}]"
    return f"{host}:{parts.port}" if parts.port else host


def http_address(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def store_location(config: Config) -> str:
    """The SQLite file as an absolute path (what `ls` finds), else the URL without secrets."""
    if config.store.startswith("sqlite:"):
        try:
            db = sqlite_path(config.store, config.base_dir)
        except StoreError:  # the store says what is wrong with it when it opens
            return safe_url(config.store)
        return f"sqlite {db}" if db == ":memory:" else str(Path(db).resolve())
    return safe_url(config.store)


def page_url(address: str) -> str:
    """The web page on this machine: a wildcard listen address is reached on loopback."""
    parts = urlsplit(address)
    host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(parts.hostname or "")
    if host is not None:
        address = http_address(host, parts.port or 80)
    return address + "/recap/"


def _page(url: str, key: PageKey) -> str:
    if key.source == "config":
        return f"page {url} (admin keys from the config)"
    if key.source == "file":
        return f"page {url} (admin key in {key.path}{', made now' if key.made else ''})"
    return f"page {url} (no admin key: {key.problem}; set admin_keys)"


def _windows(config: Config) -> str:
    named = [f"{name} {m.context_window:,}" for name, m in config.models.items()]
    if not named:
        return f"every model {config.default_context_window:,}"
    listed = ", ".join(named[:LISTED_MODELS])
    if len(named) > LISTED_MODELS:
        listed += f" and {len(named) - LISTED_MODELS} more"
    return f"{listed}, other models {config.default_context_window:,}"


def started_fields(config: Config, address: str, key: PageKey | None = None) -> dict[str, Any]:
    """The start-up line, as fields (pure: the config, the bound address and where the
    page's admin key came from in)."""
    if key is None:
        key = PageKey("config") if config.admin_keys else PageKey("none", problem="none made")
    version = recap_version()
    store = store_location(config)
    scenes = str(config.resolve_path(config.scenes_dir)) if config.scenes_dir else "packaged"
    page = page_url(address)
    tenants = [
        {"name": t.name, "upstream": upstream_host(t.upstream.base_url), "open": t.is_open}
        for t in config.tenants.values()
    ]
    listed = ", ".join(
        f"{t['name']} \u2192 {t['upstream']} ({'open' if t['open'] else 'keys'})" for t in tenants
    )
    return {
        "event": "started",
        "msg": f"recap {version} listening on {address}; {_page(page, key)}; store {store}; "
        f"prompts {scenes}; context windows: {_windows(config)}; tenants: {listed}",
        "version": version,
        "address": address,
        "page": page,
        "admin_keys": key.source,
        "admin_key_file": str(key.path) if key.path else None,
        "store": store,
        "scenes": scenes,
        "context_windows": {
            "default": config.default_context_window,
            **{name: m.context_window for name, m in config.models.items()},
        },
        "tenants": tenants,
    }


def _duration(seconds: float) -> str:
    s = int(seconds)
    if s < 60:
        return f"{seconds:.1f} s"
    h, rest = divmod(s, 3600)
    return f"{h}h{rest // 60:02d}m" if h else f"{rest // 60}m{rest % 60:02d}s"


class LoggedServer(uvicorn.Server):
    """uvicorn's server with Recap's start and stop lines."""

    def __init__(self, recap: Config, config: uvicorn.Config, key: PageKey | None = None) -> None:
        super().__init__(config)
        self.recap = recap
        self.key = key
        self.started_at = time.monotonic()

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if not self.started:
            return
        bound = [s.getsockname() for server in self.servers for s in server.sockets]
        port = bound[0][1] if bound else self.config.port
        self.started_at = time.monotonic()
        fields = started_fields(self.recap, http_address(self.config.host, port), self.key)
        log.info(fields["msg"], extra={"fields": fields})

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        grace = self.config.timeout_graceful_shutdown
        msg = "recap stopping: finishing open requests" + (f" (up to {grace:g} s)" if grace else "")
        log.info(msg, extra={"fields": {"event": "stopping", "msg": msg}})
        await super().shutdown(sockets)
        uptime = time.monotonic() - self.started_at
        msg = f"recap stopped after {_duration(uptime)}"
        log.info(
            msg, extra={"fields": {"event": "stopped", "msg": msg, "uptime_s": round(uptime, 1)}}
        )
