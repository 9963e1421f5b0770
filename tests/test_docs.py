"""The docs are true to the code (datasette's habit): docs/configuration.md documents every config
key and no other, the README every stage, docs/operating.md only commands, flags and routes that
exist (and every command), the metrics' route labels as counted; every relative link in the
README and docs/ leads somewhere, no page names an issue or a design seed, and the README's
Agents SDK set-up runs through Recap as written."""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import subprocess
import sys
import typing
import unicodedata
from collections.abc import Mapping
from pathlib import Path

import httpx
import pytest

from proxy.app import build_stages, create_app
from proxy.config import Config, parse_config
from proxy.dialects.chat import ChatDialect
from proxy.dialects.responses import ResponsesDialect
from proxy.edge.metrics import route_of
from proxy.ops.cli import build_parser
from proxy.record import RequestRecord
from tests.fake_responses import FakeResponses
from tests.servers import serve

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


# -- docs/operating.md: the CLI, the routes and the metrics it names exist -------------------

OPERATING = (ROOT / "docs" / "operating.md").read_text(encoding="utf-8")


def subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    (sub,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def test_every_cli_command_the_docs_name_exists_and_every_command_is_documented() -> None:
    named = set(re.findall(r"`recap ([a-z][a-z-]*)", OPERATING))
    named |= set(re.findall(r"^recap ([a-z][a-z-]*)", OPERATING, flags=re.M))
    named -= {"stopping", "stopped"}  # the server's last log lines, `recap stopping` and so on
    assert named - set(subcommands()) == set()  # named in the docs, unknown to `recap`
    assert set(subcommands()) - named == set()  # a command the docs never mention


def test_every_flag_of_the_cli_summary_is_a_flag_of_its_command() -> None:
    cli = OPERATING[OPERATING.index("## CLI") :]
    block = cli[cli.index("```bash") : cli.index("```", cli.index("```bash") + 3)]
    lines = [line for line in block.splitlines() if line.startswith("recap ")]
    assert len(lines) == len(subcommands()), "one summary line per command"
    commands = subcommands()
    for line in lines:
        name, _, rest = line.removeprefix("recap ").partition(" ")
        usage = rest.split("#")[0]
        known = set(commands[name]._option_string_actions)
        flags = set(re.findall(r"(?<![\w-])(--?[a-z][a-z-]*)", usage))
        assert flags - known == set(), (name, flags - known)


def test_the_commands_table_names_each_command_once() -> None:
    table = OPERATING[OPERATING.index("| command | reads | needs set |") :].split("\n\n")[0]
    rows = [line.split("|")[1] for line in table.splitlines()[2:]]
    named = [c for row in rows for c in re.findall(r"`([a-z-]+)`", row)]
    assert sorted(named) == sorted(set(subcommands()))


def documented_routes() -> list[tuple[str, str]]:
    found = re.findall(r"`(GET|POST) (/[^`?\s]*)", OPERATING)
    found += [("GET", path) for path in re.findall(r"`(/recap/[a-z]*)`", OPERATING)]
    return sorted(set(found))


def test_every_route_the_docs_name_is_served(tmp_path: Path) -> None:
    """Each route of docs/operating.md, asked of a real app: none is an unknown path. (An
    unknown conversation is a 404 of its own, naming the conversation, not the path.)"""
    routes = documented_routes()
    assert ("POST", "/v1/recap/conversations/{key}/rollback") in routes
    assert ("GET", "/recap/login") in routes and ("GET", "/metrics") in routes
    config = parse_config(
        {"store": f"sqlite:///{tmp_path / 'recap.db'}", "admin_keys": ["docs-admin-key"]},
        env={},
        base_dir=str(tmp_path),
    )
    admin = {"authorization": "Bearer docs-admin-key"}
    with serve(create_app(config)) as url:
        for method, path in routes:
            concrete = path.replace("{key}", "no-such-conversation")
            body = {"version": None} if path.endswith("/rollback") else None
            r = httpx.request(method, url + concrete, headers=admin, json=body, timeout=30)
            text = r.text
            assert r.status_code != 405, (method, path)
            assert "Unknown path" not in text and "No page" not in text, (method, path, text)


def test_the_route_labels_of_the_metrics_are_the_ones_counted() -> None:
    row = next(
        line for line in OPERATING.splitlines() if line.startswith("| `recap_requests_total`")
    )
    labels = row.split("|")[2]
    documented = set(re.findall(r"`([a-z]+)` for", labels))
    # A compacting route is labelled by its dialect; the others by their path.
    by_path = ["/v1/responses/compact", "/v1/recap/x", "/v1/models", "/recap/", "/healthz"]
    counted = {route_of(RequestRecord(path=p)) for p in by_path}
    counted |= {ChatDialect.name, ResponsesDialect.name}
    assert documented == counted
    assert "`passthrough` for any other `/v1/...` path, `/v1/responses/compact` included" in row
    assert route_of(RequestRecord(path="/v1/responses/compact")) == "passthrough"


# -- docs/configuration.md: every key it documents is a key ---------------------------------


def test_every_key_the_configuration_reference_documents_exists() -> None:
    rows = [line for line in CONFIGURATION.splitlines() if line.startswith("| `")]
    documented = {
        k for row in rows for k in re.findall(r"`([a-z_][A-Za-z_.]*)`", row.split("|")[1])
    }
    known = set(keys(Config))
    unknown = {k for k in documented if k not in known and k.removesuffix(".SCENE") not in known}
    assert unknown == set()


# -- the docs read cold ------------------------------------------------------------------------

INTERNAL = re.compile(r"\bissues? \d+|\bseed \d{3}\b|§", re.I)


@pytest.mark.parametrize(
    "page",
    [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))],
    ids=lambda p: str(p.relative_to(ROOT)),
)
def test_no_page_points_at_what_an_outsider_cannot_read(page: Path) -> None:
    # Issue numbers and design-seed sections mean nothing outside the project's tracker.
    found = INTERNAL.findall(page.read_text(encoding="utf-8"))
    assert found == []


def test_the_internal_reference_check_notices_one() -> None:
    assert INTERNAL.findall("as seed 000 §6.7 says, and issue 15's set") == [
        "seed 000",
        "§",
        "issue 15",
    ]


# -- the README's Agents SDK set-up runs as written ------------------------------------------


def test_the_readme_agents_sdk_snippet_runs_through_recap(tmp_path: Path) -> None:
    opening = README.index("```python\n", README.index("**Agents SDK**")) + len("```python\n")
    code = README[opening : README.index("```", opening)]
    assert "set_default_openai_client" in code and "set_tracing_disabled(True)" in code
    fake = FakeResponses()
    with serve(fake.app) as up:
        config = parse_config(
            {
                "store": f"sqlite:///{tmp_path / 'recap.db'}",
                "tenants": {"default": {"upstream": {"base_url": up + "/v1"}}},
            },
            env={},
            base_dir=str(tmp_path),
        )
        with serve(create_app(config)) as url:
            code = code.replace("http://127.0.0.1:8080", url)
            env = {k: v for k, v in os.environ.items() if not k.startswith("OPENAI_")}
            run = subprocess.run(
                [sys.executable, "-c", code],
                capture_output=True,
                text=True,
                timeout=120,
                env=env,
                cwd=tmp_path,
            )
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip()  # the agent's answer, from the fake, through Recap
    assert len(fake.response_requests()) == 1  # the Responses API, as the README says
