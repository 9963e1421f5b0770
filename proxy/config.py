"""Typed, frozen configuration loaded from YAML.

Read once at start-up (`load_config`) and handed to `create_app`; nothing else in
the package reads files or the environment for settings. Unknown keys are
rejected by their dotted name, and `${ENV_VAR}` / `${ENV_VAR:-default}` is
interpolated in string values so secrets stay out of the file: `${ENV_VAR}` unset or
empty is an error naming the variable and the key, so a missing secret stops the start
instead of failing every request.
"""

from __future__ import annotations

import dataclasses
import os
import re
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

import yaml


class ConfigError(ValueError):
    """The configuration file is wrong; the message names the key."""


@dataclass(frozen=True)
class Listen:
    host: str = "127.0.0.1"
    port: int = 8080
    # A connection must send a request's complete headers within this long of opening
    # (or of its keep-alive idle time after a response), else it is closed.
    header_timeout_s: float = 15.0
    # A request's body must arrive within this long of its headers, plus a second for every
    # `body_min_rate` bytes received (a large body at a fair rate is never cut), else 408.
    body_timeout_s: float = 20.0
    body_min_rate: float = 4096.0
    # A client that takes none of a response's bytes for this long is cut (and the
    # upstream stream it holds is closed).
    send_timeout_s: float = 60.0
    # Open client connections at most; 0: half the process's file-descriptor limit.
    max_connections: int = 0
    # The HTTP/1.1 parser: httptools (llhttp, in C) or h11 (pure Python, slower).
    http: Literal["httptools", "h11"] = "httptools"
    # A streamed response waiting for a summarizer call sends an SSE comment this often,
    # so that no client or intermediary (nginx: 60 s) takes a slow summary for a dead stream.
    sse_keepalive_s: float = 15.0


@dataclass(frozen=True)
class Upstream:
    base_url: str = "https://api.openai.com/v1"
    # Absent or empty: the client's own Authorization header is forwarded.
    api_key: str = ""
    timeout_s: float = 600.0
    connect_timeout_s: float = 10.0
    max_connections: int = 512
    # How requests go upstream: "fast", Recap's own HTTP/1.1 client (proxy/upstream/transport.py:
    # asyncio Protocols, httptools' C parser); "httpx", httpx's default transport (httpcore).
    transport: Literal["fast", "httpx"] = "fast"


@dataclass(frozen=True)
class SessionCompaction:
    """Session rolling summaries (seed 000 §6, defaults from its §12 table)."""

    enabled: bool = True
    mode: Literal["hybrid", "replace"] = "hybrid"
    min_new_tokens: int = 20000
    trigger_ratio: float = 0.72
    min_new_messages: int = 8
    min_compact_messages: int = 10
    min_saving_tokens: int = 2000
    recent_turns: int = 6
    min_recent_ratio: float = 0.2
    max_batch_messages: int = 200
    max_rounds_per_request: int = 30
    max_summary_chars: int = 6000
    max_item_chars: int = 4000
    failure_threshold: int = 3
    cooldown_s: float = 300.0
    scene: str = "session_compact"
    summary_role: Literal["system", "user"] = "system"
    # Background pre-compaction (stages/ahead.py): after an answer, the summary the next
    # turn would need is made while the user reads and writes, once the next turn start
    # would cross the triggers scaled by `precompact_share`.
    precompact: bool = True
    precompact_share: float = 0.8


@dataclass(frozen=True)
class LoopCompaction:
    """Loop working memory inside one turn's tool loop (seed 000 §7)."""

    enabled: bool = True
    loop_trigger_tool_rounds: int = 5
    loop_trigger_tokens: int = 96000
    loop_recent_tool_rounds: int = 5
    ttl_s: float = 86400.0
    scene: str = "loop_compact"


@dataclass(frozen=True)
class TrimCompaction:
    """Model-free trimming of old, large tool results (seed 002 micro_compact)."""

    enabled: bool = True
    trim_trigger_ratio: float = 0.5
    trim_keep_recent: int = 3
    trim_min_chars: int = 2000
    trim_exclude_tools: tuple[str, ...] = ()
    # Decreasing fidelity (seed 000 §8): older than the session's recent turns, an
    # assistant message's text over this many characters keeps its head and tail...
    fidelity_max_chars: int = 4000
    # ...and its tool-call arguments over this many are shortened (0 disables either).
    fidelity_max_args_chars: int = 1000


@dataclass(frozen=True)
class Compaction:
    session: SessionCompaction = field(default_factory=SessionCompaction)
    loop: LoopCompaction = field(default_factory=LoopCompaction)
    trim: TrimCompaction = field(default_factory=TrimCompaction)


@dataclass(frozen=True)
class Summarizer:
    # None: summarizer calls go to the tenant's own upstream.
    upstream: Upstream | None = None
    timeout_s: float = 120.0
    max_concurrency: int = 4
    # Tokens the summarizer model's context holds: each call's prompt (scene, transcript,
    # summary so far, current message) plus its max_tokens stays within it, so session
    # batches and loop inputs are bounded by it as well as by message counts.
    context_window: int = 16384
    # Restore critical references a summary lost (identifiers, paths, URLs, numbers with
    # units, error lines, quoted constraints), within this share of max_summary_chars.
    quality_guard: bool = True
    guard_max_share: float = 0.25


@dataclass(frozen=True)
class Prices:
    """A tenant's prices in money per million tokens, for the holdout report's cost
    (docs/holdout.md): uncached input, input its prompt cache served, and output."""

    input: float
    output: float
    # None: cached input at the input price (an upstream without a cache discount).
    cached_input: float | None = None

    def cost(self, input_tokens: int, cached_tokens: int, output_tokens: int) -> float:
        """`input_tokens` counts all of the input, the cached part too."""
        cached = self.input if self.cached_input is None else self.cached_input
        uncached = max(0, input_tokens - cached_tokens)
        return (uncached * self.input + cached_tokens * cached + output_tokens * self.output) / 1e6


@dataclass(frozen=True)
class Tenant:
    name: str
    api_keys: tuple[str, ...] = ()
    upstream: Upstream = field(default_factory=Upstream)
    compaction: Compaction = field(default_factory=Compaction)
    summarizer: Summarizer = field(default_factory=Summarizer)
    # Scene name -> file path, overriding the shared scenes directory per tenant.
    scenes: Mapping[str, str] = field(default_factory=dict)
    # Codex remote compaction (`/v1/responses/compact`, `compaction_trigger`, `compaction`
    # items): "recap" answers it from Recap's own summaries on any upstream; "passthrough"
    # forwards it untouched, for an upstream that is OpenAI itself (docs/codex.md).
    remote_compaction: Literal["recap", "passthrough"] = "recap"
    # Share (0..1) of this tenant's conversations held out of compaction, chosen by a stable
    # hash of tenant + conversation key (proxy/planning/cohort.py; docs/holdout.md).
    holdout: float = 0.0
    # Per million tokens; None: the holdout report shows no cost.
    prices: Prices | None = None

    @property
    def is_open(self) -> bool:
        return not self.api_keys


@dataclass(frozen=True)
class Model:
    context_window: int = 96000


@dataclass(frozen=True)
class Archive:
    """Retention of the lossless archive (whole conversations, with their summaries)."""

    # 0 keeps everything forever; otherwise conversations idle this long are deleted.
    retention_days: float = 0.0
    # How often the server prunes when retention_days > 0.
    prune_interval_s: float = 3600.0
    # Each request's record is appended to a journal before the answer's last bytes, and
    # stored in batches after (proxy/archive/journal.py); false: stored before the last bytes.
    journal: bool = True
    # Where: null is beside an SQLite file, else `recap-journal` beside the config.
    journal_dir: str | None = None


@dataclass(frozen=True)
class StorePool:
    """Connections of a PostgreSQL store, per replica (the SQLite store has one connection)."""

    min_size: int = 1
    max_size: int = 10
    # Each compaction in progress holds one of these for its conversation's advisory lock.
    lock_max_size: int = 10
    # Connecting, waiting for a free connection, and one query; past it: store unavailable.
    timeout_s: float = 30.0


@dataclass(frozen=True)
class StoreSettings:
    """What a command that only uses the store reads from a config: the store, its pool,
    the archive settings (journal, retention) and the tenants' names.

    `load_store_settings` resolves `${VAR}` in these keys only, so `recap conversations`
    and the like run in a shell that has none of the server's upstream or admin keys;
    `Config.store_settings()` is the same taken from a whole config.
    """

    store: str
    store_pool: StorePool
    archive: Archive
    tenants: tuple[str, ...]
    base_dir: str
    # For `recap report`: the tenants that set prices, and every tenant's holdout share.
    prices: Mapping[str, Prices] = field(default_factory=dict)
    holdouts: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Config:
    listen: Listen = field(default_factory=Listen)
    store: str = "sqlite:///./data/recap.db"
    store_pool: StorePool = field(default_factory=StorePool)
    conversation_header: str = "X-Conversation-Id"
    max_body_bytes: int = 32 * 1024 * 1024
    # None (or empty): the scenes shipped in the package (scenes/, as proxy.scenes_default).
    scenes_dir: str | None = None
    tenants: Mapping[str, Tenant] = field(default_factory=lambda: {"default": Tenant("default")})
    models: Mapping[str, Model] = field(default_factory=dict)
    default_context_window: int = 96000
    # Keys for the /v1/recap/ operator routes that see every tenant (never valid for chat).
    admin_keys: tuple[str, ...] = ()
    # Whether the open tenant (no api_keys) may use the /v1/recap/ routes without a key.
    inspection_open: bool = False
    archive: Archive = field(default_factory=Archive)
    # Key of the compaction references Recap gives clients (docs/codex.md); empty: one made
    # on first use and kept in the store, shared by every replica on it.
    compaction_secret: str = ""
    # Directory the config file was read from; relative paths resolve against it.
    base_dir: str = "."

    def context_window(self, model: str | None) -> int:
        if model and model in self.models:
            return self.models[model].context_window
        return self.default_context_window

    def store_settings(self) -> StoreSettings:
        prices = {n: t.prices for n, t in self.tenants.items() if t.prices is not None}
        holdouts = {n: t.holdout for n, t in self.tenants.items()}
        return StoreSettings(
            self.store,
            self.store_pool,
            self.archive,
            tuple(self.tenants),
            self.base_dir,
            prices,
            holdouts,
        )

    def resolve_path(self, path: str) -> Path:
        p = Path(path)
        return p if p.is_absolute() else Path(self.base_dir) / p


@dataclass(frozen=True)
class Bound:
    """The range a number in the config must lie in."""

    low: float = 0
    high: float | None = None
    # True: strictly more than `low` (a timeout of 0 is not a timeout).
    above: bool = False

    def check(self, value: float, where: str) -> None:
        if value != value or value in (float("inf"), float("-inf")):
            raise ConfigError(f"{where}: must be a finite number, got {value!r}")
        if self.above and value <= self.low:
            raise ConfigError(f"{where}: must be more than {self.low:g}, got {value!r}")
        if value < self.low:
            raise ConfigError(f"{where}: must be at least {self.low:g}, got {value!r}")
        if self.high is not None and value > self.high:
            raise ConfigError(f"{where}: must be at most {self.high:g}, got {value!r}")


# Every number in the config is finite and at least 0 unless this table says more;
# a key added later gets that rule without being listed.
AT_LEAST_0 = Bound()
_POSITIVE = Bound(0, above=True)
_AT_LEAST_1 = Bound(1)
_SHARE = Bound(0, 1)
_RATIO = Bound(0, 1, above=True)
BOUNDS: Mapping[tuple[type, str], Bound] = {
    (Listen, "port"): Bound(0, 65535),
    (Listen, "header_timeout_s"): _POSITIVE,
    (Listen, "body_timeout_s"): _POSITIVE,
    (Listen, "body_min_rate"): _POSITIVE,
    (Listen, "send_timeout_s"): _POSITIVE,
    (Listen, "sse_keepalive_s"): _POSITIVE,
    (Upstream, "timeout_s"): _POSITIVE,
    (Upstream, "connect_timeout_s"): _POSITIVE,
    (Upstream, "max_connections"): _AT_LEAST_1,
    (SessionCompaction, "trigger_ratio"): _RATIO,
    (SessionCompaction, "min_recent_ratio"): _SHARE,
    (SessionCompaction, "precompact_share"): _RATIO,
    (SessionCompaction, "min_compact_messages"): _AT_LEAST_1,
    (SessionCompaction, "max_batch_messages"): _AT_LEAST_1,
    (SessionCompaction, "max_rounds_per_request"): _AT_LEAST_1,
    (SessionCompaction, "max_summary_chars"): _AT_LEAST_1,
    (SessionCompaction, "max_item_chars"): _AT_LEAST_1,
    (SessionCompaction, "failure_threshold"): _AT_LEAST_1,
    (LoopCompaction, "loop_trigger_tool_rounds"): _AT_LEAST_1,
    (LoopCompaction, "ttl_s"): _POSITIVE,
    (TrimCompaction, "trim_trigger_ratio"): _RATIO,
    (Summarizer, "timeout_s"): _POSITIVE,
    (Summarizer, "max_concurrency"): _AT_LEAST_1,
    # Below this a scene's own text and a summary leave no room for any transcript.
    (Summarizer, "context_window"): Bound(2048, 10**7),
    (Summarizer, "guard_max_share"): _SHARE,
    (Model, "context_window"): _AT_LEAST_1,
    (Tenant, "holdout"): _SHARE,
    (Config, "max_body_bytes"): _AT_LEAST_1,
    (Config, "default_context_window"): _AT_LEAST_1,
    (Archive, "prune_interval_s"): _POSITIVE,
    (StorePool, "max_size"): _AT_LEAST_1,
    (StorePool, "lock_max_size"): _AT_LEAST_1,
    (StorePool, "timeout_s"): _POSITIVE,
}


# String keys that must hold an http(s) URL. A default is valid, so only a written value is checked.
URLS = {(Upstream, "base_url")}

_ENV = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(:-([^}]*))?\}")


def _interpolate(value: str, env: Mapping[str, str], where: str) -> str:
    """`${VAR}` must be set and not empty; `${VAR:-default}` takes the default when VAR is
    unset or empty (the shell's rule), and the default may itself be empty."""

    def sub(m: re.Match[str]) -> str:
        name, has_default, default = m.group(1), m.group(2), m.group(3)
        found = env.get(name, "")
        if found:
            return found
        if has_default is not None:
            return default
        state = "is empty" if name in env else "is not set"
        raise ConfigError(
            f"{where}: ${{{name}}} {state} (set it, or write ${{{name}:-}} if empty is fine, "
            f"${{{name}:-default}} for a default)"
        )

    return _ENV.sub(sub, value)


def _check_url(value: str, where: str) -> None:
    """An upstream is reached over HTTP: anything else would fail every request later."""
    try:
        parts = urlsplit(value)
        ok = parts.scheme.lower() in ("http", "https") and bool(parts.hostname)
    except ValueError:  # e.g. an unclosed [ of an IPv6 host
        ok = False
    if not ok:
        raise ConfigError(f"{where}: must be an http:// or https:// URL with a host, got {value!r}")


def _build(cls: type, data: Any, where: str, env: Mapping[str, str], extra: dict[str, Any]) -> Any:
    """Build dataclass `cls` from a YAML mapping, rejecting unknown keys by dotted name."""
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where or 'config'}: expected a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    kwargs: dict[str, Any] = dict(extra)
    for key, raw in data.items():
        name = f"{where}.{key}" if where else str(key)
        if key not in fields or key in extra or key == "base_dir":
            raise ConfigError(f"unknown config key: {name}")
        kwargs[key] = _convert(hints[key], raw, name, env)
        value = kwargs[key]
        if isinstance(value, int | float) and not isinstance(value, bool):  # optional ones too
            BOUNDS.get((cls, key), AT_LEAST_0).check(kwargs[key], name)
        if (cls, key) in URLS:
            _check_url(kwargs[key], name)
    for f in fields.values():
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        if required and f.name not in kwargs:
            raise ConfigError(f"missing config key: {where + '.' if where else ''}{f.name}")
    return cls(**kwargs)


def _convert(tp: Any, raw: Any, where: str, env: Mapping[str, str]) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if raw is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _convert(inner, raw, where, env)
    if isinstance(raw, str):
        raw = _interpolate(raw, env, where)
    if dataclasses.is_dataclass(tp):
        return _build(tp, raw, where, env, {})  # type: ignore[arg-type]
    if origin is Literal:
        if raw not in args:
            raise ConfigError(f"{where}: must be one of {', '.join(map(str, args))}, got {raw!r}")
        return raw
    if origin is tuple:
        if not isinstance(raw, list):
            raise ConfigError(f"{where}: expected a list")
        return tuple(_convert(args[0], item, f"{where}[{i}]", env) for i, item in enumerate(raw))
    if origin in (Mapping, dict) or tp is Mapping:
        if not isinstance(raw, Mapping):
            raise ConfigError(f"{where}: expected a mapping")
        return {str(k): _convert(args[1], v, f"{where}.{k}", env) for k, v in raw.items()}
    if tp is bool:
        if not isinstance(raw, bool):
            raise ConfigError(f"{where}: expected true or false, got {raw!r}")
        return raw
    if tp in (int, float):
        if isinstance(raw, bool) or not isinstance(raw, (int, float, str)):
            raise ConfigError(f"{where}: expected a number, got {raw!r}")
        try:
            return tp(raw)
        except ValueError:
            raise ConfigError(f"{where}: expected a number, got {raw!r}") from None
    if tp is str:
        if not isinstance(raw, (str, int, float)) or isinstance(raw, bool):
            raise ConfigError(f"{where}: expected a string, got {raw!r}")
        return str(raw)
    raise ConfigError(f"{where}: unsupported value {raw!r}")  # pragma: no cover


def _build_tenants(raw: Any, env: Mapping[str, str]) -> dict[str, Tenant]:
    if not isinstance(raw, Mapping) or not raw:
        raise ConfigError("tenants: expected a mapping with at least one tenant")
    tenants = {
        str(n): _build(Tenant, t, f"tenants.{n}", env, {"name": str(n)}) for n, t in raw.items()
    }
    seen: dict[str, str] = {}
    for t in tenants.values():
        for key in t.api_keys:
            if key in seen:
                raise ConfigError(f"tenants.{t.name}.api_keys: key also used by tenant {seen[key]}")
            seen[key] = t.name
    if sum(t.is_open for t in tenants.values()) > 1:
        raise ConfigError("tenants: at most one tenant may be open (empty api_keys)")
    return tenants


def parse_config(data: Any, env: Mapping[str, str] | None = None, base_dir: str = ".") -> Config:
    env = os.environ if env is None else env
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ConfigError("config: expected a mapping at the top level")
    data = dict(data)
    tenants = _build_tenants(data.pop("tenants"), env) if "tenants" in data else None
    extra: dict[str, Any] = {"base_dir": base_dir}
    if tenants is not None:
        extra["tenants"] = tenants
    config = typing.cast(Config, _build(Config, data, "", env, extra))
    _check_operator_keys(config)
    return config


def _check_operator_keys(config: Config) -> None:
    tenant_keys = {k: t.name for t in config.tenants.values() for k in t.api_keys}
    for i, key in enumerate(config.admin_keys):
        if not key:
            raise ConfigError(f"admin_keys[{i}]: empty key")
        if key in tenant_keys:
            raise ConfigError(f"admin_keys[{i}]: key also used by tenant {tenant_keys[key]}")
    if config.compaction_secret and len(config.compaction_secret) < 32:
        raise ConfigError("compaction_secret: must be at least 32 characters (or empty)")
    _check_storage(config.store_settings())


def _check_storage(settings: StoreSettings) -> None:
    if settings.archive.retention_days < 0:
        raise ConfigError("archive.retention_days: must be 0 (keep forever) or more")
    if settings.archive.prune_interval_s <= 0:
        raise ConfigError("archive.prune_interval_s: must be more than 0")
    pool = settings.store_pool
    if pool.min_size < 0:
        raise ConfigError("store_pool.min_size: must be 0 or more")
    if pool.max_size < 1 or pool.max_size < pool.min_size:
        raise ConfigError("store_pool.max_size: must be at least 1 and at least min_size")
    if pool.lock_max_size < 1:
        raise ConfigError("store_pool.lock_max_size: must be at least 1")
    if pool.timeout_s <= 0:
        raise ConfigError("store_pool.timeout_s: must be more than 0")


def parse_store_settings(
    data: Any, env: Mapping[str, str] | None = None, base_dir: str = "."
) -> StoreSettings:
    """The store keys of a config, resolved and checked; the rest only named (a key unknown
    at the top level is still an error), so `${VAR}` elsewhere may be unset."""
    env = os.environ if env is None else env
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ConfigError("config: expected a mapping at the top level")
    known = {f.name for f in dataclasses.fields(Config) if f.name != "base_dir"}
    for key in data:
        if key not in known:
            raise ConfigError(f"unknown config key: {key}")
    tenants = data.get("tenants", {"default": None})
    if not isinstance(tenants, Mapping) or not tenants:
        raise ConfigError("tenants: expected a mapping with at least one tenant")
    settings = StoreSettings(
        store=_convert(str, data.get("store", Config.store), "store", env),
        store_pool=_build(StorePool, data.get("store_pool"), "store_pool", env, {}),
        archive=_build(Archive, data.get("archive"), "archive", env, {}),
        tenants=tuple(str(name) for name in tenants),
        base_dir=base_dir,
        prices=_store_prices(tenants, env),
        holdouts=_store_holdouts(tenants, env),
    )
    _check_storage(settings)
    return settings


def _store_prices(tenants: Mapping[Any, Any], env: Mapping[str, str]) -> dict[str, Prices]:
    """The tenants' `prices`, checked as the whole config checks them (`recap report`)."""
    out: dict[str, Prices] = {}
    for name, raw in tenants.items():
        section = raw.get("prices") if isinstance(raw, Mapping) else None
        if section is not None:
            out[str(name)] = _build(Prices, section, f"tenants.{name}.prices", env, {})
    return out


def _store_holdouts(tenants: Mapping[Any, Any], env: Mapping[str, str]) -> dict[str, float]:
    out: dict[str, float] = {}
    for name, raw in tenants.items():
        value = raw.get("holdout", 0.0) if isinstance(raw, Mapping) else 0.0
        where = f"tenants.{name}.holdout"
        out[str(name)] = _convert(float, value, where, env)
        _SHARE.check(out[str(name)], where)
    return out


def _read(path: str | Path) -> tuple[Any, str]:
    """The YAML document of a config file, and the directory its relative paths start from."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"cannot read config {p}: {e.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"{p}: invalid YAML: {e}") from None
    return data, str(p.resolve().parent)


def load_config(path: str | Path, env: Mapping[str, str] | None = None) -> Config:
    data, base_dir = _read(path)
    return parse_config(data, env, base_dir=base_dir)


def load_store_settings(path: str | Path, env: Mapping[str, str] | None = None) -> StoreSettings:
    """What the store commands of `recap` need from a config file (see `StoreSettings`)."""
    data, base_dir = _read(path)
    return parse_store_settings(data, env, base_dir=base_dir)
