"""The docs are true to the code: docs/configuration.md documents every config key, the README
every stage, and every relative link in the README and docs/ leads somewhere (datasette's habit)."""

from __future__ import annotations

import dataclasses
import re
import typing
import unicodedata
from collections.abc import Mapping
from pathlib import Path

import pytest

from proxy.app import build_stages
from proxy.config import Config

pytestmark = pytest.mark.quick

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")
CONFIGURATION = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
# Every Markdown page a reader reaches from the README.
PAGES = sorted([ROOT / "README.md", ROOT / "CHANGELOG.md", *(ROOT / "docs").rglob("*.md")])


def keys(cls: type, prefix: str = "") -> list[str]:
    """Every config key as the reference names it: `tenants.NAME.upstream.base_url`, ..."""
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


def test_every_config_key_is_in_the_configuration_reference() -> None:
    documented = set(re.findall(r"`([a-z_]+(?:\.[A-Za-z_]+)*)", CONFIGURATION))
    # A grouped row such as `listen.host`, `listen.port` names each key.
    missing = [k for k in keys(Config) if k not in documented and f"{k}.SCENE" not in documented]
    assert missing == [], missing


def test_the_key_check_notices_a_missing_key() -> None:
    # The check above reads the reference itself, not a copy that could drift: a row taken out
    # of it leaves its key undocumented.
    row = next(line for line in CONFIGURATION.splitlines() if line.startswith("| `store` |"))
    without = CONFIGURATION.replace(row + "\n", "")
    assert "store" not in set(re.findall(r"`([a-z_]+(?:\.[A-Za-z_]+)*)", without))


def test_every_stage_is_in_the_readme() -> None:
    class State:  # what build_stages reads
        config = Config()
        store = archiver = fingerprints = upstreams = counter = clock = None

    names = [s.name for s in build_stages(State())]  # type: ignore[arg-type]
    assert names[:2] == ["measure_off_loop", "archive"] and names[-1] == "estimate_tokens"
    for name in names:
        assert f"| `{name}` |" in README, name


def test_the_readme_stays_short() -> None:
    # The reference lives in docs/; the README says what Recap is and how to start.
    assert len(README.splitlines()) <= 250


def unfenced(text: str) -> str:
    """The text without fenced code blocks, where `#` starts no heading."""
    return re.sub(r"^(```|~~~).*?^\1[^\n]*$", "", text, flags=re.M | re.S)


def prose(text: str) -> str:
    """The text without code blocks and inline code, where brackets are not links."""
    return re.sub(r"(`+)(?:(?!\1).)+?\1", "", unfenced(text))


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"`|\*\*?|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip()).lower()
    kept = "".join(c for c in text if c in " -_" or unicodedata.category(c)[0] in "LN")
    return kept.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    out: set[str] = set()
    seen: dict[str, int] = {}
    for line in unfenced(page.read_text(encoding="utf-8")).splitlines():
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            base = slug(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")  # GitHub numbers repeated headings
    return out


def links(page: Path) -> list[str]:
    text = prose(page.read_text(encoding="utf-8"))
    found = re.findall(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)", text)
    return [t for t in found if not re.match(r"[a-z][a-z0-9+.-]*:", t)]  # skip https:, mailto:


def broken(page: Path) -> list[str]:
    out = []
    for target in links(page):
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            out.append(f"{target}: no such file")
        elif anchor and (dest.suffix != ".md" or anchor not in anchors(dest)):
            out.append(f"{target}: no such heading")
    return out


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_lead_somewhere(page: Path) -> None:
    assert broken(page) == []


def test_the_link_check_notices_a_broken_link(tmp_path: Path) -> None:
    (tmp_path / "other.md").write_text("# Other\n\n## A heading (`with/code`)\n", encoding="utf-8")
    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n\n[ok](other.md#a-heading-withcode) [here](#page) `[not](a-link.md)`\n"
        "[gone](missing.md) [bad anchor](other.md#nope) [web](https://example.com/x)\n",
        encoding="utf-8",
    )
    assert broken(page) == ["missing.md: no such file", "other.md#nope: no such heading"]
