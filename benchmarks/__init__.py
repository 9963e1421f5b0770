"""Benchmark scripts: they print figures; nothing here asserts on timings (see tests/ for that)."""
