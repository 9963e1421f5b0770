"""The lossless archive: every original message on disk, and what is read back from it.

    archiver    the archive on the data path: originals before any compaction, events after
    journal     its write-ahead journal: a record is durable once appended, stored later
    archived    what the archive is known to hold, per conversation in use
    inspection  what an operator can ask: listings, detail, the last view, rollback
    export      one conversation as JSON Lines (`recap-archive/1`)
    retention   deleting whole conversations idle past `archive.retention_days`
    holdout     the holdout report: a tenant's two cohorts compared on what was archived

May import: the store, the history model, the pipeline's types, and below
(tests/test_layers.py).
"""
