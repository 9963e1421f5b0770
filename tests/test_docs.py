"""The README documents every config key and every stage (datasette's habit)."""

from __future__ import annotations

import dataclasses
import re
import typing
from collections.abc import Mapping
from pathlib import Path

from proxy.app import build_stages
from proxy.config import Config

README = (Path(__file__).resolve().parent.parent / "README.md").read_text(encoding="utf-8")


def keys(cls: type, prefix: str = "") -> list[str]:
    """Every config key as the README names it: `tenants.NAME.upstream.base_url`, ..."""
    out: list[str] = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name in ("base_dir", "name"):  # not config keys: set by the loader
            continue
        tp = hints[f.name]
        args = typing.get_args(tp)
        if dataclasses.is_dataclass(tp):
            out += keys(tp, f"{prefix}{f.name}.")  # type: ignore[arg-type]
        elif typing.get_origin(tp) in (Mapping, dict) and dataclasses.is_dataclass(args[1]):
            out += keys(args[1], f"{prefix}{f.name}.NAME.")
        else:  # a leaf, a mapping of strings, or an optional section documented as one row
            out.append(prefix + f.name)
    return out


def test_every_config_key_is_in_the_readme() -> None:
    documented = set(re.findall(r"`([a-z_]+(?:\.[A-Za-z_]+)*)", README))
    # A grouped row such as `listen.host`, `listen.port` names each key.
    missing = [k for k in keys(Config) if k not in documented and f"{k}.SCENE" not in documented]
    assert missing == [], missing


def test_every_stage_is_in_the_readme() -> None:
    class State:  # what build_stages reads
        config = Config()
        store = archiver = fingerprints = upstreams = counter = None

    names = [s.name for s in build_stages(State())]  # type: ignore[arg-type]
    assert names[0] == "archive" and names[-1] == "estimate_tokens"
    for name in names:
        assert f"| `{name}` |" in README, name
