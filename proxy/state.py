"""What lives for the life of the app: built in `create_app`'s lifespan, never global."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from proxy.archive.archiver import Archiver
from proxy.config import Config
from proxy.history.fingerprints import FingerprintCache
from proxy.history.tokens import TokenCounter
from proxy.pipeline import Pipeline
from proxy.stages.ahead import Ahead
from proxy.stages.audit import AuditWriter
from proxy.stages.calibration import Calibration
from proxy.stages.remote import RemoteCompactor
from proxy.stages.session import SessionStage
from proxy.store.base import Store
from proxy.upstream.client import UpstreamPool


@dataclass
class AppState:
    config: Config
    upstreams: UpstreamPool
    counter: TokenCounter
    store: Store
    archiver: Archiver
    fingerprints: FingerprintCache
    pipeline: Pipeline
    # Recap's estimate against the upstream's count, per tenant and model (from usage).
    calibration: Calibration = field(default_factory=Calibration)
    # Monotonic seconds for the request path's cool-downs (circuit breakers); tests fake it.
    clock: Callable[[], float] = time.monotonic
    # Codex remote compaction (proxy/edge/codex.py), built with the pipeline.
    remote: RemoteCompactor | None = None
    # The audit rows and their events, written off the request path (`store.audits`).
    audits: AuditWriter = field(default_factory=AuditWriter)
    # Background pre-compaction (stages/ahead.py), built with the pipeline.
    ahead: Ahead | None = None
    # The session stage, built with the pipeline: it keeps what a riding call rides on.
    session: SessionStage | None = None
