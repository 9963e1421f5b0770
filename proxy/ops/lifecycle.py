"""The server's start and stop lines: what `recap serve` says before the first request.

Around the whole process, not the data path: `recap serve` runs the app on a uvicorn
`Server` subclass that logs one line once the socket is bound (the address, the
store without secrets, the prompts, each tenant's upstream host and whether it is
open, the version), one when shutdown starts and one when it is done. The lines
are `recap.server` records with an `event` field; their `msg` says everything, for
the text format and `recap tail`, and the JSON line carries the same as fields.
"""

from __future__ import annotations

import logging
import socket
import time
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as package_version
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit

import uvicorn

from proxy.config import Config

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


def started_fields(config: Config, address: str) -> dict[str, Any]:
    """The start-up line, as fields (pure: the config and the bound address in)."""
    version = recap_version()
    store = safe_url(config.store)
    scenes = str(config.resolve_path(config.scenes_dir)) if config.scenes_dir else "packaged"
    tenants = [
        {"name": t.name, "upstream": upstream_host(t.upstream.base_url), "open": t.is_open}
        for t in config.tenants.values()
    ]
    listed = ", ".join(
        f"{t['name']} \u2192 {t['upstream']} ({'open' if t['open'] else 'keys'})" for t in tenants
    )
    return {
        "event": "started",
        "msg": f"recap {version} listening on {address}; store {store}; prompts {scenes}; "
        f"tenants: {listed}",
        "version": version,
        "address": address,
        "store": store,
        "scenes": scenes,
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

    def __init__(self, recap: Config, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.recap = recap
        self.started_at = time.monotonic()

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if not self.started:
            return
        bound = [s.getsockname() for server in self.servers for s in server.sockets]
        port = bound[0][1] if bound else self.config.port
        self.started_at = time.monotonic()
        fields = started_fields(self.recap, http_address(self.config.host, port))
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
