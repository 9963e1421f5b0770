"""The CPU-share script's grouping: a profiled function lands in its group, idle time in none."""

from __future__ import annotations

import cProfile
import json
import pstats

from benchmarks.cpu_share import GROUPS, group, shares


def test_functions_are_grouped_by_where_they_live() -> None:
    site = "/venv/lib/python3.11/site-packages"
    assert group(f"{site}/h11/_connection.py", "send") == "HTTP stack"
    assert group(f"{site}/tiktoken/core.py", "encode") == "tiktoken"
    assert group("/srv/recap/proxy/edge/route.py", "__call__") == "Recap (proxy/)"
    assert group("/usr/lib/python3.11/asyncio/events.py", "_run") == "event loop and sockets"
    assert group("/usr/lib/python3.11/json/encoder.py", "encode") == "json"
    assert group("~", "<method 'send' of '_socket.socket' objects>") == "event loop and sockets"
    assert group("~", "<built-in method builtins.isinstance>") == "builtins"
    assert group("~", "<method 'poll' of 'select.epoll' objects>") is None


def test_the_shares_of_a_real_profile_add_up() -> None:
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(2000):
        json.loads(json.dumps({"a": [1, 2, 3], "b": "x" * 50}))
    profile.disable()
    busy, by_group = shares(pstats.Stats(profile))
    assert busy > 0
    assert set(by_group) == set(GROUPS)
    assert abs(sum(by_group.values()) - 1) < 1e-9
    assert by_group["json"] > 0.2
