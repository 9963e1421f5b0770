"""The pipeline's stages: they call the summarizer and the store, and record outcomes.

One module per stage (session, loop, trim and fit, the token estimate), with the
summarizer client, the audit trail and the operator's manual compaction beside them.
Each stage asks a pure planner (`proxy.planning`) what to do, does the IO, and appends
a typed outcome to the exchange; `app.build_stages` puts them in order.
"""
