"""Pure planners: decisions over a neutral history, no IO.

Session and loop plans, trimming, the window fit, summary framing and its guard, the
fidelity check, the summarizer's transcript, and the typed outcomes the stages report; the
holdout's cohort, its outcome measures and the comparison of the two cohorts.
They read messages in the neutral view (`proxy.history.messages`, `proxy.history.conversation`; see
`proxy.dialects` for how each API maps onto it) and return plans; the stages in
`proxy.stages` carry them out. Nothing here imports httpx, aiosqlite or asyncio
(tests/test_layers.py says so), so every planner is tested directly.
"""
