"""Which cohort a conversation is in: compacted, or held out of compaction.

A pure function of the tenant, the conversation key and the tenant's holdout share, through
sha256 (not Python's salted `hash`), so every replica and every restart agrees.
"""

from __future__ import annotations

import enum
import hashlib


class Cohort(enum.Enum):
    COMPACTED = "compacted"
    HOLDOUT = "holdout"


_SCALE = 2**64


def cohort_of(tenant: str, conversation_key: str, holdout: float) -> Cohort:
    """The cohort of a conversation: held out when its hash falls below `holdout` (0..1)."""
    if holdout <= 0:
        return Cohort.COMPACTED
    digest = hashlib.sha256(f"{tenant}\0{conversation_key}".encode()).digest()
    point = int.from_bytes(digest[:8], "big") / _SCALE
    return Cohort.HOLDOUT if point < holdout else Cohort.COMPACTED
