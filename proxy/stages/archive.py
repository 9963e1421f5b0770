"""The archive stage, first in the pipeline: how the client's messages are identified and
archived (the archiver itself, its writer and journal: proxy/archive/archiver.py).

Their identity (fingerprints and chain hashes, from the fingerprint cache) and the rows the
archive lacks are worked out when first needed: for a small request that compacts nothing,
once it is forwarded (`Archiver.begin`); by a compacting stage, in `ensure_archived`, before
anything replaces an original.
"""

from __future__ import annotations

from proxy.archive.archiver import Archiver
from proxy.history.fingerprints import FingerprintCache
from proxy.pipeline import Exchange, History
from proxy.stages.offload import OFF_LOOP_BYTES, off_loop


class ArchiveOriginals:
    """Sets the exchange's identity and archive hooks; a large body's identity and rows
    are made now, its rows off the loop (proxy.stages.offload)."""

    name = "archive"

    def __init__(self, archiver: Archiver, fingerprints: FingerprintCache) -> None:
        self.archiver = archiver
        self.cache = fingerprints

    async def __call__(self, ex: Exchange, /) -> None:
        ex.identify = lambda: self._identify(ex)
        # The first fingerprint or count asked for makes the identity, which seeds what
        # the previous request counted (the planners' first checks need none of it).
        ex.measure.seeder = lambda: ex.identity
        archiver = self.archiver

        async def write_now() -> None:
            ex.unarchived = archiver.unarchived(ex)
            await archiver.write(ex.conversation, ex.unarchived)

        ex.archive_now = write_now
        if ex.body_bytes >= OFF_LOOP_BYTES:
            _ = ex.identity  # made on the loop: the fingerprint cache is the loop's
            ex.unarchived = await off_loop(ex.body_bytes, lambda: archiver.unarchived(ex))

    def _identify(self, ex: Exchange) -> History:
        ex.measure.seeder = None  # this is the seeding: its own misses hash directly
        ident = self.cache.identity(
            ex.conversation, ex.original, ex.model, ex.body_bytes, ex.measure.fingerprint
        )
        ex.measure.seed(ex.original, ident.fingerprints, ident.counts)
        p = ident.pinned
        return History(ex.original[:p], ex.original[p:], ident.chain, ident.fingerprints)
