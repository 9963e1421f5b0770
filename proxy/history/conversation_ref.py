"""Which conversation a request belongs to: a tenant and the client's key within it.

A value type shared by the pure side (identity, planners, fingerprints) and the store;
it lives apart from `proxy.store` so that naming a conversation never imports a driver.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ConversationRef:
    """A conversation is identified by its tenant and the client's key within that tenant."""

    tenant: str
    key: str
