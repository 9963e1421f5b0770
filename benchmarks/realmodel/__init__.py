"""The real-model evaluation (issue 15): a local instruct model as Recap's summarizer.

Never run in CI: `install` fetches a 1.1 GB model and compiles llama.cpp (minutes), and `run`
needs an hour-scale budget on two cores. Only `scoring` (pure functions) is imported by tests.
"""
