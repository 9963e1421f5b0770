"""Forwarding to the upstream API: pooled clients, headers, and the one httpx boundary.

IO edge of the data path. Every httpx exception that can escape a model call is
translated to a RecapError here (`mapped_errors`), so the rest of the proxy never
imports httpx's exception tree. Timeouts are explicit: httpx's 5 s defaults
would kill long model calls.
"""

from __future__ import annotations

import contextlib
import itertools
import ssl
from collections.abc import (
    AsyncIterable,
    AsyncIterator,
    Callable,
    Collection,
    Iterable,
    Iterator,
    Mapping,
    Sequence,
)
from urllib.parse import urlsplit

import httpx

from proxy.config import Upstream
from proxy.errors import RecapError, UpstreamBadResponse, UpstreamTimeout, UpstreamUnreachable
from proxy.upstream.transport import FastTransport

# RFC 9110 §7.6.1 hop-by-hop headers, plus the ones the transport recomputes.
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "trailers",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
    }
)
# Idle pooled connections are dropped after this long: below the 5 s after which
# uvicorn-based upstreams (vLLM, ...) close idle connections, so the proxy never sends a
# request on a connection the upstream is closing at that moment (a 502 on a good request).
KEEPALIVE_S = 4.0
# Recap's own header namespace. A client may send some of them to Recap (e.g.
# x-recap-compaction), which reads them here; none is forwarded, so only the proxy itself
# sets x-recap-* upstream (x-recap-purpose on its summarizer calls) and an upstream
# gateway can trust them.
RECAP_HEADER_PREFIX = "x-recap-"


# Clients per upstream, used in turn. httpcore's pool does O(connections x idle
# connections) bookkeeping on every request (encode/httpcore#1035): with 200 streams
# in flight that was 40% of the proxy's CPU (benchmarks/soak.py); 8 smaller pools
# cost 64 times less, and their connections add up to the same `max_connections`.
# (The fast transport's pool does constant work per request; the shards stay for the
# httpx fallback, and cost it nothing.)
SHARDS = 8


class UpstreamPool:
    """Pooled clients per tenant and upstream config, built at start-up.

    Per tenant even when two tenants' upstream configs are equal: a tenant's
    `max_connections` bounds its own connections only, so one tenant's long or stuck
    streams never make another wait for a connection (with one pool per config, ten
    stuck streams of the open tenant gave another tenant 504s)."""

    def __init__(self, upstreams: Iterable[tuple[str, Upstream]]) -> None:
        self._clients: dict[tuple[str, Upstream], tuple[UpstreamClient, ...]] = {}
        self._turn = itertools.count()
        # One TLS context for every client: each one built its own (the CA bundle parsed
        # again, ~50 ms of CPU), eight per upstream. trust_env=False: as each client.
        self._tls = httpx.create_ssl_context(trust_env=False)
        for tenant, u in upstreams:
            if (tenant, u) not in self._clients:
                self._clients[tenant, u] = _make_clients(u, self._tls)

    def client(self, tenant: str, upstream: Upstream) -> UpstreamClient:
        """A client of `tenant`'s pool for `upstream` (its own, or its summarizer's)."""
        clients = self._clients.get((tenant, upstream))
        if clients is None:  # not known at start-up (e.g. a tenant's summarizer override)
            clients = self._clients[tenant, upstream] = _make_clients(upstream, self._tls)
        return clients[next(self._turn) % len(clients)]

    async def aclose(self) -> None:
        for clients in self._clients.values():
            for client in clients:
                await client.aclose()


class UpstreamClient:
    """One shard of an upstream's connections: httpx builds the request (the upstream's
    timeouts in it), its transport sends it.

    Sent past httpx's client layer, which does what a browser's client should and a shared
    proxy must not: its cookie jar kept every upstream's Set-Cookie and sent it with the
    next request on the same pool, whoever that was for (a CDN's bot cookie set for one
    client went out with another tenant's request). The cookie still goes back to the client
    it was set for, as a response header. Redirects are the client's to follow, and auth is in
    the headers, so nothing else of that layer applies."""

    def __init__(
        self, u: Upstream, *, max_connections: int, tls: ssl.SSLContext | None = None
    ) -> None:
        """`tls`: the TLS context to verify upstreams with (default: a new one)."""
        read = u.timeout_s
        timeout = httpx.Timeout(
            connect=u.connect_timeout_s, read=read, write=read, pool=u.connect_timeout_s
        )
        limits = httpx.Limits(
            max_connections=max_connections,
            max_keepalive_connections=max_connections,
            keepalive_expiry=KEEPALIVE_S,
        )
        self._transport: httpx.AsyncBaseTransport
        if u.transport == "fast":
            # The default: HTTP/1.1 parsed in C on asyncio's own callbacks, a third of
            # httpcore's CPU per request (benchmarks/transport.py). It reads no environment,
            # so HTTP(S)_PROXY meant for the host's tools is never picked up.
            self._transport = FastTransport(ssl_context=tls, limits=limits)
        else:
            # trust_env=False: a proxy must not pick up HTTP(S)_PROXY meant for its host's tools.
            self._transport = httpx.AsyncHTTPTransport(
                verify=tls if tls is not None else True, limits=limits, trust_env=False
            )
        self._client = httpx.AsyncClient(
            transport=self._transport, timeout=timeout, trust_env=False, follow_redirects=False
        )

    def build_request(
        self,
        method: str,
        url: str,
        *,
        headers: httpx.Headers | Sequence[tuple[bytes, bytes]],
        content: bytes | httpx.AsyncByteStream | AsyncIterable[bytes] | None = None,
        timeout: httpx.Timeout | None = None,
    ) -> httpx.Request:
        """`timeout`: this request's, else the upstream's (never None: that is no timeout)."""
        return self._client.build_request(
            method,
            url,
            headers=headers,
            content=content,
            timeout=httpx.USE_CLIENT_DEFAULT if timeout is None else timeout,
        )

    @property
    def transport(self) -> httpx.AsyncBaseTransport:
        """What sends this client's requests (`upstream.transport`)."""
        return self._transport

    async def send(self, request: httpx.Request) -> httpx.Response:
        """The response, its body not yet read (`aiter_raw`, `aread`; `aclose` when done)."""
        response = await self._transport.handle_async_request(request)
        response.request = request
        return response

    async def aclose(self) -> None:
        await self._client.aclose()  # closes the transport too


def _make_clients(u: Upstream, tls: ssl.SSLContext) -> tuple[UpstreamClient, ...]:
    shards = max(1, min(SHARDS, u.max_connections))
    size = -(-u.max_connections // shards)  # ceil: never fewer connections than asked
    return tuple(UpstreamClient(u, max_connections=size, tls=tls) for _ in range(shards))


# A large body goes upstream in slices, so the transport never copies it whole on the loop.
SLICE_BYTES = 64 * 1024


class RequestBody(httpx.AsyncByteStream):
    """A forwarded body that says when it is all on the wire: `on_sent` runs once the
    transport asks for more after the last slice, which either transport does only once that
    slice is written (handed to the socket, under its write buffer's high-water mark), so
    the call overlaps the upstream's work on the request. (httpcore's trace extension
    tells the same, at the price of a callback on every step of every request.)

    Sent with its Content-Length (`headers`), never chunked."""

    def __init__(self, payload: bytes, on_sent: Callable[[], object] | None = None) -> None:
        self.payload = payload
        self.on_sent = on_sent

    @property
    def headers(self) -> list[tuple[bytes, bytes]]:
        return [(b"content-length", str(len(self.payload)).encode())]

    async def __aiter__(self) -> AsyncIterator[bytes]:
        payload = self.payload
        if len(payload) <= SLICE_BYTES:
            yield payload
        else:
            view = memoryview(payload)
            for i in range(0, len(view), SLICE_BYTES):
                yield bytes(view[i : i + SLICE_BYTES])
        if self.on_sent is not None:
            self.on_sent()


def upstream_url(upstream: Upstream, path: str, query: bytes) -> str:
    """`/v1/chat/completions` on the proxy -> `{base_url}/chat/completions` upstream."""
    suffix = path[3:] if path.startswith("/v1/") else path
    url = upstream.base_url.rstrip("/") + suffix
    return url + "?" + query.decode("latin-1") if query else url


def bearer(api_key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {api_key}"}


def request_headers(
    raw: Iterable[tuple[bytes, bytes]],
    upstream: Upstream,
    *,
    keep_encoding: bool,
    credential_headers: Collection[str] = ("authorization",),
    credentials: Callable[[str], Mapping[str, str]] = bearer,
) -> list[tuple[bytes, bytes]]:
    """Client headers minus hop-by-hop ones; the tenant's upstream key replaces the client's.

    `credential_headers` are where the route's API carries a key (a dialect's), all of
    them dropped when the upstream has a key of its own, which goes up as `credentials`
    writes it (a Bearer token by default).
    Values stay the bytes the client sent: HTTP allows any octet from 0x80 up in a value,
    and httpx would encode a str value as ASCII (and fail the request).
    keep_encoding=False drops Accept-Encoding so httpx negotiates and decodes the
    body itself (used where the proxy must read the answer).
    """
    out: list[tuple[bytes, bytes]] = []
    for k, v in raw:
        name = k.decode("latin-1").lower()
        if name in HOP_BY_HOP or name.startswith(RECAP_HEADER_PREFIX):
            continue
        if name in credential_headers and upstream.api_key:
            continue
        if name == "accept-encoding" and not keep_encoding:
            continue
        out.append((name.encode("latin-1"), v))
    if upstream.api_key:
        for name, value in credentials(upstream.api_key).items():
            out.append((name.encode("latin-1"), value.encode("latin-1")))
    return out


def response_headers(
    headers: httpx.Headers, *, decoded: bool, extra: Mapping[str, str] | None = None
) -> list[tuple[bytes, bytes]]:
    """Upstream response headers for the client.

    When the body is re-emitted decoded, Content-Encoding and Content-Length no
    longer describe it and are dropped (no stale headers, no double decoding).
    """
    out: list[tuple[bytes, bytes]] = []
    recoded = decoded and "content-encoding" in headers
    for k, v in headers.multi_items():
        name = k.lower()
        if name in HOP_BY_HOP and name != "content-length":
            continue
        if recoded and name in ("content-encoding", "content-length"):
            continue
        out.append((name.encode("latin-1"), v.encode("latin-1")))
    for k, v in (extra or {}).items():
        out.append((k.encode("latin-1"), v.encode("latin-1")))
    return out


def upstream_host(upstream: Upstream) -> str:
    """host[:port] of the upstream, for errors and logs (never its path or credentials)."""
    netloc = urlsplit(upstream.base_url).netloc
    return netloc.rpartition("@")[2] or upstream.base_url


def translate(exc: httpx.HTTPError, host: str) -> RecapError:
    """The proxy's own error for a foreign (httpx) one, naming the upstream host."""
    if isinstance(exc, httpx.TimeoutException):
        kind = {
            httpx.ConnectTimeout: "connecting to",
            httpx.ReadTimeout: "reading from",
            httpx.WriteTimeout: "writing to",
            httpx.PoolTimeout: "waiting for a connection to",
        }.get(type(exc), "talking to")
        return UpstreamTimeout(f"Timed out {kind} the upstream API at {host}.")
    if isinstance(exc, httpx.ConnectError):
        return UpstreamUnreachable(f"Could not connect to the upstream API at {host}.")
    if isinstance(exc, httpx.TransportError):
        return UpstreamUnreachable(
            f"The connection to the upstream API at {host} failed: {type(exc).__name__}."
        )
    return UpstreamBadResponse(
        f"The upstream API at {host} sent an answer the proxy cannot read: {type(exc).__name__}."
    )


@contextlib.contextmanager
def mapped_errors(upstream: Upstream) -> Iterator[None]:
    """The one boundary of httpx's exceptions: inside it, each becomes a RecapError.

    Used around every send and every read of an upstream answer (chat, pass-through,
    summarizer), so no other module handles httpx's exception tree.
    """
    try:
        yield
    except httpx.HTTPError as exc:
        raise translate(exc, upstream_host(upstream)) from None
