"""The pipeline's stages: they call the summarizer and the store, and record outcomes.

One module per stage (offload's measure, archive, session, loop, trim and fit, the
token estimate, the Codex remote compactor), with what they share beside them: the
summarizer client and its scenes, the audit trail and the compaction-started line, the
operator's manual compaction, and the window calibrated from usage. Each stage asks a
pure planner (`proxy.planning`) what to do, does the IO, and appends a typed outcome
to the exchange; `app.build_stages` puts them in order.

May import: the archive, the upstream client, the pipeline, the store and the pure
layers; never the HTTP side (tests/test_layers.py).
"""
