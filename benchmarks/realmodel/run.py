"""Replay a fixed set through Recap with a real local model as its summarizer, and score it.

Outside the data path, never in CI: `python -m benchmarks.realmodel` installs what it needs
(`benchmarks.realmodel.install`, reused when present), then runs three servers on loopback,
each its own process:

    llama       `python -m llama_cpp.server` serving the GGUF (OpenAI-compatible), Recap's
                `summarizer.upstream`, under `nice -n 19` (the machine may be shared with
                latency measurements: the model takes every core it is given)
    fake        the replay's fake upstream (`benchmarks.fakeup`) as the agent's upstream: it
                answers every step with the recorded assistant message
    recap       `python -m proxy serve`, SQLite in the work directory, operator routes open
                so the harness can read the summaries and the compaction audit

and replays, step by step as `benchmarks.replay` does (`replay_session`), the Chinese
conversations of tests/data/realmodel-zh.json (in each window of --window), --loops long
coding tool loops (`benchmarks.sessions.coding_loop`, window --loop-window: one turn whose
tool loop loop working memory must carry) and the chained τ-bench sessions named by
--chains from tests/data (window --tau-window), in that order. It prints, per conversation:

- gold-fact retention, as the replay harness measures it (`benchmarks.metrics.retention`);
- constraint retention: each summary version that covers the user's constraint holds it
  verbatim (`scoring.constraint_kept`); and whether it is in what went upstream at the end;
- decision-status accuracy: each labelled decision, scored on the latest summary that covers
  the message where it was settled (`scoring.decision_status`);
- each summary's language against the conversation's (`scoring.language_of`); for a tool
  loop its working summaries (read from Recap's SQLite store: no route lists them);
- compactions from Recap's audit: outcome, the cause of each failure, duration, tokens;
  and the summarizer tokens of each summary version;

and writes all of it, with every summary the model wrote, to --out (default
benchmarks/out/realmodel.md; with --docs also docs/realmodel.md).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import shlex
import shutil
import sqlite3
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx

from benchmarks.fakeup import replay_session
from benchmarks.harness import (
    fake_command,
    free_port,
    git_revision,
    in_workdir,
    markdown_table,
    recap_command,
    running,
    write_config,
)
from benchmarks.metrics import Figures, Run, Weigher, add_run
from benchmarks.realmodel.install import DEFAULT_DIR, MODELS, QWEN_1_5B, ensure
from benchmarks.realmodel.scoring import (
    Decision,
    DecisionScore,
    accuracy,
    constraint_kept,
    decision_status,
    language_of,
)
from benchmarks.sessions import (
    TAUBENCH,
    Fact,
    Session,
    chains,
    coding_loop,
    load_taubench,
    model_calls,
)
from proxy.history.tokens import TokenCounter
from proxy.stages.scenes import packaged_scenes

REPO = Path(__file__).resolve().parent.parent.parent
MODULE = "benchmarks.realmodel"
DATA = REPO / "tests" / "data" / "realmodel-zh.json"
OUT = REPO / "benchmarks" / "out"
DOCS = REPO / "docs"


# Four chains of two tasks, 89 to 139 messages each, 48 gold facts at risk in all (tasks2-3,
# 193 messages, would alone take longer than these four).
CHAINS = ("tasks0-1", "tasks4-5", "tasks6-7", "tasks8-9")


def model_for(window: int) -> str:
    return f"realmodel-{window}"


# -- the set --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Item:
    """A conversation to replay and what its summaries are scored against."""

    session: Session
    window: int
    language: str
    constraint: str | None = None
    constraint_at: int | None = None  # index of the user message that states it
    decisions: tuple[tuple[Decision, int], ...] = ()  # with the index where each was settled
    loop: bool = False  # one tool loop: its working summaries are what is scored


def load_chinese(path: Path, window: int) -> list[Item]:
    data = json.loads(path.read_text(encoding="utf-8"))
    items = []
    for conv in data["conversations"]:
        messages: list[dict[str, Any]] = conv["messages"]
        last = list(model_calls(messages))[-1]
        facts = tuple(
            Fact(v, last, "final answer", f"{conv['id']}@{window}") for v in conv["facts"]
        )
        name = f"{conv['id']}@{window}"
        session = Session(name, "chinese", model_for(window), messages, facts)

        def where(text: str, role: str | None = None, msgs: list[dict[str, Any]] = messages) -> int:
            return next(
                i
                for i, m in enumerate(msgs)
                if text in m["content"] and (role is None or m["role"] == role)
            )

        decisions = tuple(
            (Decision(d["id"], tuple(d["keys"]), d["status"]), where(d["settled_by"]))
            for d in conv["decisions"]
        )
        items.append(
            Item(
                session,
                window,
                conv["language"],
                conv["constraint"],
                where(conv["constraint"], "user"),
                decisions,
            )
        )
    return items


def load_tau(names: Sequence[str], tasks_per_chain: int, window: int) -> list[Item]:
    """The chains named (`tasks0-1`, ...), in the order given."""
    if not names:
        return []
    rows = load_taubench(TAUBENCH)
    by_name = {s.id: s for s in chains(rows, tasks_per_chain, model_for(window))}
    unknown = [n for n in names if n not in by_name]
    if unknown:
        raise SystemExit(f"unknown chain {', '.join(unknown)} (known: {', '.join(by_name)})")
    return [Item(by_name[n], window, "en") for n in names]


def load_loops(n: int, rounds: int, window: int, seed: int) -> list[Item]:
    return [
        Item(coding_loop(seed + k, rounds, model_for(window)), window, "en", loop=True)
        for k in range(n)
    ]


# -- scoring one conversation ---------------------------------------------------------------


@dataclass
class Version:
    version: int
    covered: int  # non-pinned messages from the start (the system prompt is pinned); rounds
    # of the tool loop for a loop's working summary
    summary: str
    input_tokens: int
    output_tokens: int
    language: str
    constraint_kept: bool | None  # None: the summary does not cover the constraint


@dataclass
class Result:
    item: Item
    figures: Figures
    seconds: float
    versions: list[Version]
    compactions: list[dict[str, Any]]
    decisions: list[DecisionScore]
    constraint_sent: bool | None
    final_sent: list[dict[str, Any]] = field(default_factory=list)


def extent(item: Item, v: Version) -> str:
    return f"{v.covered} {'rounds' if item.loop else 'messages'}"


def covers(v: Version, index: int, pinned: int) -> bool:
    return pinned <= index < pinned + v.covered


def loop_versions(db: Path, key: str) -> list[dict[str, Any]]:
    """The conversation's loop working summaries, oldest first, shaped like summary versions."""
    with contextlib.closing(sqlite3.connect(db)) as conn:
        rows = conn.execute(
            "SELECT covered_rounds, summary, input_tokens, output_tokens FROM loop_summaries"
            " WHERE key = ? ORDER BY created_at, covered_rounds",
            (key,),
        ).fetchall()
    return [
        dict(version=n, covered=r[0], summary=r[1], input_tokens=r[2], output_tokens=r[3])
        for n, r in enumerate(rows, 1)
    ]


def score(item: Item, run: Run, figures: Figures, detail: dict[str, Any], secs: float) -> Result:
    messages = item.session.messages
    pinned = 1 if messages and messages[0].get("role") == "system" else 0
    versions = []
    for v in sorted(detail.get("versions") or [], key=lambda x: int(x["version"])):
        ver = Version(
            int(v["version"]),
            int(v["covered"]),
            str(v["summary"]),
            int(v.get("input_tokens") or 0),
            int(v.get("output_tokens") or 0),
            language_of(str(v["summary"])),
            None,
        )
        at = item.constraint_at
        if item.constraint and at is not None and covers(ver, at, pinned):
            ver.constraint_kept = constraint_kept(item.constraint, ver.summary)
        versions.append(ver)
    decisions = []
    for decision, at in item.decisions:
        covering = [v for v in versions if covers(v, at, pinned)]
        if covering:
            decisions.append(
                DecisionScore(decision, decision_status(decision, covering[-1].summary))
            )
    final = [dict(m) for m in run.steps[-1].sent] if run.steps else []
    sent_text = json.dumps(final, ensure_ascii=False)
    constraint_sent = constraint_kept(item.constraint, sent_text) if item.constraint else None
    return Result(
        item,
        figures,
        secs,
        versions,
        list(detail.get("compactions") or []),
        decisions,
        constraint_sent,
        final,
    )


# -- running --------------------------------------------------------------------------------


RIDING_SCENE = "session_riding.yaml"


def recap_config(args: argparse.Namespace, fake: str, llama: str, workdir: Path) -> Path:
    """Recap's config. `--input transcript`: the model is `summarizer.upstream`. `--input
    cache_riding`: a riding call goes only to the conversation's own upstream, so the model
    sits behind the agent's (the fake relays summarizer calls to it) with its whole context
    as the summarizer's window, and the session scene rides."""
    timeout = args.summarizer_timeout
    summarizer: dict[str, Any] = {
        "timeout_s": timeout,
        "max_concurrency": 1,  # one model on two cores: calls would only queue
    }
    if args.input == "cache_riding":
        summarizer["context_window"] = args.n_ctx
        packaged = (packaged_scenes() / "session_compact.yaml").read_text(encoding="utf-8")
        riding = packaged.replace("\ninput: transcript\n", "\ninput: cache_riding\n")
        (workdir / RIDING_SCENE).write_text(riding, encoding="utf-8")
    else:
        summarizer["upstream"] = {"base_url": llama + "/v1", "timeout_s": timeout}
    tenant: dict[str, Any] = {
        "api_keys": [],
        "upstream": {"base_url": fake + "/v1", "timeout_s": 300},
        "summarizer": summarizer,
        "compaction": {
            "session": {
                "recent_turns": args.recent_turns,
                "min_saving_tokens": args.min_saving_tokens,
                "max_summary_chars": args.max_summary_chars,
            }
        },
    }
    if args.input == "cache_riding":
        tenant["scenes"] = {"session_compact": str(workdir / RIDING_SCENE)}
    windows = sorted({*args.window, args.tau_window, args.loop_window})
    data = {
        "store": f"sqlite:///{workdir / 'recap.db'}",
        "inspection_open": True,
        "models": {model_for(w): {"context_window": w} for w in windows},
        "tenants": {"default": tenant},
    }
    return write_config(workdir / "recap.yaml", data)


def llama_command(python: Path, model: Path, alias: str, port: int, n_ctx: int) -> list[str]:
    """The model server's command, at the lowest CPU priority (`nice -n 19`)."""
    return [
        *("nice", "-n", "19"),
        str(python),
        *("-m", "llama_cpp.server", "--model", str(model), "--model_alias", alias),
        *("--n_ctx", str(n_ctx), "--n_threads", "2", "--n_threads_batch", "2"),
        *("--flash_attn", "true", "--host", "127.0.0.1", "--port", str(port)),
    ]


def progress(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def replay_all(
    args: argparse.Namespace,
    items: list[Item],
    workdir: Path,
    done: Callable[[list[Result]], object] = lambda results: None,
) -> list[Result]:
    """Every item through one set of servers; `done` sees the results after each item."""
    llama_port, fake_port, recap_port = free_port(), free_port(), free_port()
    weigh = Weigher(TokenCounter())
    results = []
    with contextlib.ExitStack() as stack:
        relay: tuple[str, ...] = ()
        summarizer = ""
        if not args.fake_summarizer:
            installed = ensure(Path(args.dir), MODELS[args.model])
            llama_cmd = llama_command(
                installed.python, installed.model, args.model, llama_port, args.n_ctx
            )
            llama = stack.enter_context(
                running("llama", llama_cmd, llama_port, workdir, ready_s=900, health="/v1/models")
            )
            summarizer = llama.url
            if args.input == "cache_riding":
                relay = ("--summarizer-url", llama.url + "/v1", "--summarizer-model", args.model)
        fake_cmd = fake_command("benchmarks.replay", fake_port, *relay)
        fake = stack.enter_context(running("fake", fake_cmd, fake_port, workdir))
        summarizer = summarizer or fake.url  # --fake-summarizer: the fake's extractive ones
        config = recap_config(args, fake.url, summarizer, workdir)
        recap = stack.enter_context(
            running("recap", recap_command(config, recap_port), recap_port, workdir)
        )
        client = stack.enter_context(
            httpx.Client(
                timeout=args.summarizer_timeout * 4,
                trust_env=False,
                headers={"authorization": "Bearer sk-realmodel"},
            )
        )
        for item in items:
            key = f"realmodel/{item.session.id}"
            progress(f"{key}: {len(item.session.steps)} steps, window {item.window}")
            start = time.perf_counter()
            run = replay_session(
                client, recap.url + "/v1/chat/completions", fake.url, item.session, key
            )
            # The summaries made in the background after the last answers count too.
            settle(workdir / "recap.log", key, args.summarizer_timeout * 4)
            secs = time.perf_counter() - start
            detail = client.get(recap.url + "/v1/recap/conversations/" + quote(key, safe=""))
            detail.raise_for_status()
            found = detail.json()
            if item.loop:
                found["versions"] = loop_versions(workdir / "recap.db", key)
            figures = Figures("recap")
            add_run(figures, run, item.window, weigh)
            results.append(score(item, run, figures, found, secs))
            done(results)
            progress(f"  {secs:.0f} s, {len(results[-1].versions)} summary versions")
    return results


def settle(log: Path, key: str, timeout: float) -> None:
    """Until every background compaction of conversation `key` that Recap's log says
    started has logged its end (at most `timeout` seconds: a hang guard)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        started = done = 0
        for line in log.read_text(encoding="utf-8", errors="replace").splitlines():
            if key not in line:
                continue
            try:
                record = json.loads(line)
            except ValueError:
                continue
            fields = record.get("fields") if isinstance(record.get("fields"), dict) else record
            if record.get("logger") != "recap.ahead" or fields.get("conversation") != key:
                continue
            started += record.get("msg") == "compaction started"
            done += record.get("msg") == "background compaction done"
        if started <= done:
            return
        time.sleep(1)


# -- the report -----------------------------------------------------------------------------


def command_line(argv: Sequence[str]) -> str:
    return " ".join([f"python -m {MODULE}", *map(shlex.quote, argv)])


def _share(n: int, d: int) -> str:
    return f"{n}/{d}" if d else "n/a"


def _ratio(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f}"


def summary_table(results: list[Result]) -> str:
    rows = []
    for r in results:
        f = r.figures
        kept = [v.constraint_kept for v in r.versions if v.constraint_kept is not None]
        langs = Counter(v.language for v in r.versions)
        # Summarizer calls only: trims and last-resort drops make none.
        summaries = [c for c in r.compactions if c.get("layer") in ("session", "loop", "manual")]
        failed = [c for c in summaries if c.get("outcome") == "failed"]
        causes = Counter(str(c.get("detail") or "?") for c in failed)
        rows.append(
            (
                r.item.session.id,
                f"{r.item.window:,}",
                len(r.item.session.steps),
                f"{_share(f.facts_retained, f.facts_at_risk)} ({f.facts_checked} checked)",
                _share(sum(kept), len(kept)) if r.item.constraint else "n/a",
                {True: "yes", False: "no", None: "n/a"}[r.constraint_sent],
                f"{_share(sum(s.correct for s in r.decisions), len(r.decisions))}"
                if r.item.decisions
                else "n/a",
                f"{langs.get(r.item.language, 0)}/{len(r.versions)} in {r.item.language}",
                len([c for c in summaries if c.get("outcome") == "ok"]),
                ", ".join(f"{n}× {c}" for c, n in causes.items()) or "0",
                f.drop_steps,
                f"{r.seconds:.0f}",
            )
        )
    return markdown_table(
        (
            "conversation",
            "window",
            "steps",
            "gold facts retained",
            "constraint in summaries",
            "constraint sent at the end",
            "decisions right",
            "summary language",
            "summaries ok",
            "failed (cause)",
            "steps with history dropped",
            "seconds",
        ),
        rows,
        "lrrrrrrlrlrr",
    )


def totals(results: list[Result]) -> list[str]:
    """The set's headline figures, one line each (what issue 15's "done when" asks)."""

    def facts(rs: list[Result]) -> str:
        kept = sum(r.figures.facts_retained for r in rs)
        risk = sum(r.figures.facts_at_risk for r in rs)
        return f"{kept}/{risk} = {_ratio(kept / risk if risk else None)}"

    tau = [r for r in results if r.item.session.kind == "chained"]
    loops = [r for r in results if r.item.loop]
    kept = [v.constraint_kept for r in results for v in r.versions if v.constraint_kept is not None]
    sent = [r.constraint_sent for r in results if r.constraint_sent is not None]
    decisions = [s for r in results for s in r.decisions]
    zh = [v for r in results if r.item.language == "zh" for v in r.versions]
    summaries = [
        c for r in results for c in r.compactions if c.get("layer") in ("session", "loop", "manual")
    ]
    failed = Counter(str(c.get("detail") or "?") for c in summaries if c.get("outcome") == "failed")
    return [
        f"- Gold facts retained on the chained τ-bench sessions: {facts(tau)}"
        + (f"; in the tool loops: {facts(loops)}" if loops else "")
        + f"; everywhere: {facts(results)}.",
        f"- Constraint verbatim in the summaries that cover it: {_share(sum(kept), len(kept))}; "
        f"in what went upstream at the end: {_share(sum(sent), len(sent))}.",
        "- Decisions with the right status: "
        f"{_share(sum(s.correct for s in decisions), len(decisions))}.",
        f"- Summaries of the Chinese conversations in Chinese: "
        f"{_share(sum(v.language == 'zh' for v in zh), len(zh))}.",
        f"- Summarizer calls (compactions) failed: {sum(failed.values())} of {len(summaries)}"
        + (" (" + ", ".join(f"{n}× {c}" for c, n in failed.items()) + ")" if failed else "")
        + ".",
    ]


def calls_table(results: list[Result]) -> str:
    rows = []
    for r in results:
        for c in r.compactions:
            if c.get("layer") == "trim":  # no model call: counted in the note below
                continue
            rows.append(
                (
                    r.item.session.id,
                    c.get("layer"),
                    c.get("reason"),
                    c.get("outcome"),
                    c.get("detail") or "",
                    f"{int(c.get('duration_ms') or 0) / 1000:.1f}",
                    f"{c.get('tokens_before', 0):,} → {c.get('tokens_after', 0):,}",
                )
            )
    return markdown_table(
        (
            "conversation",
            "layer",
            "trigger",
            "outcome",
            "cause",
            "seconds",
            "tokens before → after",
        ),
        rows,
        "lllllrr",
    )


def versions_table(results: list[Result]) -> str:
    rows = []
    for r in results:
        for v in r.versions:
            rows.append(
                (
                    r.item.session.id,
                    v.version,
                    extent(r.item, v),
                    f"{v.input_tokens:,}",
                    f"{v.output_tokens:,}",
                    len(v.summary),
                    v.language,
                    {True: "yes", False: "no", None: "not covered"}[v.constraint_kept],
                )
            )
    return markdown_table(
        (
            "conversation",
            "version",
            "covers",
            "summarizer tokens in",
            "out",
            "chars",
            "language",
            "constraint verbatim",
        ),
        rows,
        "lrrrrrll",
    )


def decisions_table(results: list[Result]) -> str:
    rows = [
        (r.item.session.id, s.decision.id, s.decision.status, s.found, "yes" if s.correct else "no")
        for r in results
        for s in r.decisions
    ]
    return markdown_table(
        ("conversation", "decision", "labelled", "in the summary", "right"), rows, "lllll"
    )


def report(
    args: argparse.Namespace, argv: Sequence[str], results: list[Result], secs: float
) -> str:
    spec = MODELS[args.model]
    lost = [x for r in results for x in r.figures.facts_lost]
    decisions = [s for r in results for s in r.decisions]
    out = [
        "# Real-model evaluation: Recap's summaries written by a local model",
        "",
        f"`{command_line(argv)}`",
        "",
        f"Revision {git_revision()}; Python {platform.python_version()}; {secs:.0f} s in all. "
        + (
            "Summarizer: the replay's extractive fake (`--fake-summarizer`: a dry run, not a "
            "model's summaries), as `summarizer.upstream`; the agent's "
            if args.fake_summarizer
            else f"Summarizer: {spec.filename} ({spec.prefix}1..{spec.parts}=={spec.version} "
            f"on PyPI) served by llama-cpp-python 0.3.36 (`--n_ctx {args.n_ctx} --n_threads 2 "
            "--n_threads_batch 2 --flash_attn true`), as `summarizer.upstream`; the agent's "
        )
        + "upstream is the replay's fake, answering with the recorded messages. Recap's "
        "packaged scenes and quality guard at this revision; the tenant sets "
        "`compaction.session.recent_turns` "
        f"{args.recent_turns}, `min_saving_tokens` {args.min_saving_tokens}, "
        f"`max_summary_chars` {args.max_summary_chars}, `summarizer.timeout_s` "
        f"{args.summarizer_timeout:g} (one model on two cores), the rest default. The tool "
        f"loops run in a {args.loop_window:,}-token window with the loop defaults (a working "
        "summary every 5 rounds once 10 are raw)."
        + (
            " Session summarizer input: cache riding (`--input cache_riding`: the session "
            "scene's `input: cache_riding`, the model behind the agent's upstream, the fake "
            f"relaying summarizer calls to it, `summarizer.context_window` {args.n_ctx}); "
            "the loop layer's input is a transcript either way."
            if args.input == "cache_riding"
            else ""
        ),
        "",
        "## Figures",
        "",
        summary_table(results),
        "",
        *totals(results),
        "",
        f"Decision-status accuracy over all labelled decisions: {_ratio(accuracy(decisions))} "
        f"({sum(s.correct for s in decisions)}/{len(decisions)}). Gold facts lost: "
        + (", ".join(lost) if lost else "none")
        + ".",
        "",
        "How each figure is computed: `benchmarks/realmodel/run.py` and "
        "`benchmarks/realmodel/scoring.py` (docstrings).",
        "",
        "## What this measures, and what not yet",
        "",
        "- The evaluation's set, run once: two Chinese conversations written for it "
        "(tests/data/realmodel-zh.json), each in two windows; chained τ-bench sessions "
        "(tests/data); a generated coding-agent turn that is one long tool loop "
        "(`benchmarks.sessions.coding_loop`). Small samples: read the figures as examples, "
        "not rates.",
        "- The windows are small so that a compaction fires in a short conversation; "
        "`max_summary_chars` is lowered to fit them.",
        "- Gold facts: as the replay harness measures them (a value at risk is retained when it "
        "is still somewhere in what went upstream at the step that needs it). Constraint: "
        "verbatim in every summary that covers the message stating it. Decisions: the status "
        "words on the lines of the latest covering summary that name the decision "
        '(`scoring.decision_status`: a heuristic; "conflicting" when a summary states two '
        'statuses for it, "missing" when no line names it). Language: the share of CJK '
        "ideographs among letters outside headings and identifiers.",
        "- A tool loop's rows score its loop working summaries (the session layer does not "
        "summarise the running turn); its constraint is in the request that starts the turn, "
        "which stays raw, so it is not scored.",
        "- Latency and tokens are per compaction (Recap's audit record and the summary "
        "version's usage), not per HTTP call: a compaction of several batches is one row.",
        "- Not measured: whether the summary is true (invented names, URLs, contradictions): "
        "read the summaries below.",
        "",
        "## Compactions (Recap's audit)",
        "",
        calls_table(results),
        "",
        "Trims of old tool results (no model call) left out: "
        + ", ".join(
            f"{r.item.session.id} {sum(c.get('layer') == 'trim' for c in r.compactions)}"
            for r in results
        )
        + ".",
        "",
        "## Summary versions (the summarizer's tokens per summary)",
        "",
        versions_table(results),
        "",
        "## Decisions",
        "",
        decisions_table(results) if decisions else "No labelled decision was covered by a summary.",
        "",
        "## The summaries the model wrote",
        "",
        "Each current or earlier version, as Recap stored it (after its quality guard).",
        "",
    ]
    for r in results:
        for v in r.versions:
            out += [
                f"### {r.item.session.id}, version {v.version} "
                f"(covers {extent(r.item, v)}; {v.language})",
                "",
                "```text",
                v.summary.replace("```", "ʼʼʼ"),
                "```",
                "",
            ]
        if not r.versions:
            out += [f"### {r.item.session.id}", "", "No summary was made.", ""]
    return "\n".join(out)


def run(args: argparse.Namespace, argv: Sequence[str], workdir: Path) -> int:
    print(f"$ {command_line(argv)}", flush=True)
    started = time.perf_counter()
    items = [item for w in args.window for item in load_chinese(Path(args.data), w)[: args.chinese]]
    # The tool loops before the chains: a run stopped early (the report is written after
    # each conversation) still has one of each kind.
    items += load_loops(args.loops, args.loop_rounds, args.loop_window, args.seed)
    items += load_tau(args.chains, args.tasks_per_chain, args.tau_window)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    def write(results: list[Result]) -> str:
        # After each item too: a run stopped early keeps the report of what it finished.
        text = report(args, argv, results, time.perf_counter() - started)
        if len(results) < len(items):
            text += f"\n\n(Partial: {len(results)} of {len(items)} conversations so far.)"
        (out / "realmodel.md").write_text(text + "\n", encoding="utf-8")
        return text

    results = replay_all(args, items, workdir, write)
    print(write(results))
    if args.docs:
        shutil.copy(out / "realmodel.md", DOCS / "realmodel.md")
    return 0


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.split("\n")[0])
    p.add_argument("--dir", default=str(DEFAULT_DIR), help="install directory (outside the repo)")
    p.add_argument("--model", choices=sorted(MODELS), default=QWEN_1_5B.name)
    p.add_argument("--n-ctx", type=int, default=16384, help="the model server's context")
    p.add_argument("--data", default=str(DATA), help="the Chinese conversations (JSON)")
    p.add_argument("--chinese", type=int, default=2, help="how many Chinese conversations")
    p.add_argument(
        "--window",
        type=int,
        nargs="+",
        default=[2000, 1400],
        help="windows of the Chinese ones (each conversation is replayed in each)",
    )
    p.add_argument(
        "--chains",
        nargs="*",
        default=list(CHAINS),
        help="chained τ-bench sessions, by name (default: %(default)s)",
    )
    p.add_argument("--tasks-per-chain", type=int, default=2)
    p.add_argument("--tau-window", type=int, default=6000, help="window of the τ-bench chains")
    p.add_argument("--loops", type=int, default=1, help="long coding tool loops")
    p.add_argument("--loop-rounds", type=int, default=24, help="tool rounds of each loop")
    p.add_argument("--loop-window", type=int, default=32000, help="window of the tool loops")
    p.add_argument("--seed", type=int, default=7, help="seed of the first tool loop")
    p.add_argument("--recent-turns", type=int, default=2)
    p.add_argument("--min-saving-tokens", type=int, default=300)
    p.add_argument("--max-summary-chars", type=int, default=1200)
    p.add_argument("--summarizer-timeout", type=float, default=900)
    p.add_argument(
        "--input",
        choices=["transcript", "cache_riding"],
        default="transcript",
        help="the session scene's input: a transcript (the model as summarizer.upstream) or "
        "cache riding (the model behind the agent's upstream, the fake relaying to it)",
    )
    p.add_argument(
        "--fake-summarizer",
        action="store_true",
        help="a dry run in seconds: the replay's extractive fake summarizes, not the model "
        "(the windows, the last resort and the harness, not the summaries' quality)",
    )
    p.add_argument("--out", default=str(OUT), help="output directory (default benchmarks/out)")
    p.add_argument("--no-docs", dest="docs", action="store_false", help="do not copy to docs/")
    p.add_argument("--workdir", help="keep configs, databases and logs here (default: temp dir)")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    return in_workdir(run, parse_args(argv), argv, "realmodel")


if __name__ == "__main__":
    sys.exit(main())
