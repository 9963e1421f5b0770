"""Replays real agent trajectories through Recap and baseline strategies, and compares them.

Outside the data path: a script that prints figures (never a test). At every point where the
recorded agent called the model (an assistant message after a user or tool message), the
history so far is sent, and a fake upstream answers with the recorded assistant message, so
every strategy sees exactly the recorded conversation and only what goes upstream differs.

    fake upstream   `benchmarks.fakeup` (the tests' fake with the replay's routes), in its
                    own process: recorded answers by step, an extractive summarizer for
                    Recap's summarizer calls (or a relay to a real model with
                    --summarizer-url), a log of what it received
    recap           `python -m proxy serve` in its own process, per Recap variant, with a
                    config this script writes (SQLite in the work directory)
    peer            any OpenAI-compatible proxy (--peer BASE_URL) that forwards to the fake
                    (start it with --fake-port and point it at http://127.0.0.1:PORT/v1)
    baselines       no compaction, sliding window, middle-out: pure functions, in-process

Inputs (`benchmarks.sessions`): the τ-bench airline sessions alone (window --single-window),
chained by --tasks-per-chain tasks into long conversations (window --window), and seeded
generated coding-agent sessions of 500+ messages (window --window). The windows are model
entries in Recap's config (`models: {replay-16000: {context_window: 16000}, ...}`), small
enough that the chained and generated sessions must be compacted.

Figures (`benchmarks.metrics` says exactly how each is computed) go to stdout and to
--out (default benchmarks/out/): replay.md, replay.json and two PNG plots of the first chained
session; with --docs (the default) the Markdown and the plots are also copied to docs/.

`--api messages` does the same in the Anthropic Messages shape (`benchmarks.messages_shape`:
the system prompt as a `system` block, calls as `tool_use` blocks, results as `tool_result`
blocks, the cache breakpoints Claude Code sets), checked as Anthropic would
(`tests.fake_messages.request_problems`); files replay-messages.*.

`--api responses` sends every step to `/v1/responses` instead, in the Responses shape
(`benchmarks.responses_shape`: the system prompt as `instructions`, assistant tool calls as
`function_call` items, tool results as `function_call_output` items, `store` false); the fake
answers in that shape, checks each input as OpenAI would, and logs it in chat form, so every
figure is computed exactly as for chat and the two runs compare on the same sessions. Its
files are named replay-responses.* (the baselines, in-process, are the same for both).

Usage (from the repository root):
    python -m benchmarks.replay [--api chat|responses|messages] [--peer URL]
        [--summarizer-url URL --summarizer-model M] [--singles N] [--chains N] [--generated N]
        [--quick]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shlex
import shutil
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from benchmarks.fakeup import ReplayUpstream, replay_session
from benchmarks.harness import (
    Server,
    fake_command,
    free_port,
    git_revision,
    in_workdir,
    recap_command,
    running,
    serve_app,
    write_config,
)
from benchmarks.metrics import Figures, Run, Step, Weigher, add_run
from benchmarks.report import COLUMNS, Series, details, markdown, plots, verdicts
from benchmarks.sessions import TAUBENCH, Session, chains, generate, load_taubench, singles
from benchmarks.strategies import baselines
from proxy.history.tokens import REPLY_PRIMING_TOKENS, TokenCounter
from proxy.stages.scenes import load_scene, packaged_scenes

REPO = Path(__file__).resolve().parent.parent
MODULE = "benchmarks.replay"
OUT = REPO / "benchmarks" / "out"
DOCS = REPO / "docs"
PATHS = {"chat": "/chat/completions", "responses": "/responses", "messages": "/messages"}

# Recap variants: name -> (description, overrides of tenants.default).
# Tuned for cache: fewer, larger compactions, and fewer rewrites of the prompt between them
# (chosen from a sweep on the chained and generated sessions; defaults in parentheses):
#   session.trigger_ratio 0.8 (0.72)       compact later: more requests share one summary
#                                          prefix (at 0.85, too close to the last resort's 0.9,
#                                          tool loops got raw history dropped more often)
#   session.min_recent_ratio 0.1 (0.2),
#   session.recent_turns 2 (6)             a smaller raw tail: each compaction frees more room,
#                                          so the next one comes later
#   session.min_saving_tokens 4000 (2000)  no small compactions
#   loop: 10 new rounds per compaction (5), 3 kept raw (5)
#   trim.trim_trigger_ratio 0.75 (0.5)     each newly trimmed tool result rewrites the prompt
#                                          from there on, so trim only near the trigger (with
#                                          trimming off, long tool loops hit the last resort)
# session.min_new_tokens stays 20000: under a 16K window the compactable part never reaches it,
# so only the context_ratio trigger fires, with either value.
CACHE_TUNED: dict[str, Any] = {
    "compaction": {
        "session": {
            "trigger_ratio": 0.8,
            "min_recent_ratio": 0.1,
            "recent_turns": 2,
            "min_saving_tokens": 4000,
        },
        "loop": {"loop_trigger_tool_rounds": 10, "loop_recent_tool_rounds": 3},
        "trim": {"trim_trigger_ratio": 0.75},
    }
}
# The session scene switched to cache riding (written into the work directory), and the
# summarizer's window it needs: a riding call carries the whole forwarded request, so under
# the default 16,384 tokens it would not fit the replay's 16,000-token conversations (the
# summarizer is the conversation's own model here, `model: null`, with its real window).
RIDING_SCENE = "session_riding.yaml"
WIDE_SUMMARIZER = {"summarizer": {"context_window": 32768}}
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "recap": ("Recap, default settings (quality guard on)", {}),
    "recap-noguard": (
        "Recap, default settings, quality guard off",
        {"summarizer": {"quality_guard": False}},
    ),
    "recap-cache": (
        "Recap tuned for cache, fewer and larger compactions: session.trigger_ratio 0.8, "
        "min_recent_ratio 0.1, recent_turns 2, min_saving_tokens 4000; loop compactions every "
        "10 rounds keeping 3 raw; trim_trigger_ratio 0.75 (why: CACHE_TUNED in "
        "benchmarks/replay.py)",
        CACHE_TUNED,
    ),
    "recap-wide": (
        "Recap, default settings, summarizer.context_window 32768 (the transcript twin of "
        "recap-riding)",
        WIDE_SUMMARIZER,
    ),
    "recap-riding": (
        "Recap, default settings, summarizer.context_window 32768, the session scene's "
        "`input: cache_riding`: background summaries ride on the request just forwarded",
        {**WIDE_SUMMARIZER, "scenes": {"session_compact": RIDING_SCENE}},
    ),
}
# Run by default (the riding pair on request: --recap recap-wide recap-riding).
DEFAULT_VARIANTS = ["recap", "recap-noguard", "recap-cache"]
# A riding variant and its transcript twin (the same settings, transcript input).
RIDING_TWINS = {"recap-riding": "recap-wide"}


@dataclass
class InputSet:
    name: str
    title: str
    window: int
    sessions: list[Session]


def model_for(window: int) -> str:
    return f"replay-{window}"


def inputs(args: argparse.Namespace) -> list[InputSet]:
    rows = load_taubench(Path(args.data))
    single_model, model = model_for(args.single_window), model_for(args.window)
    ones = singles(rows, single_model)[: args.singles]
    long = chains(rows, args.tasks_per_chain, model)[: args.chains]
    gen = [generate(args.seed + n, args.gen_messages, model) for n in range(args.generated)]
    return [
        s
        for s in (
            InputSet(
                "chained",
                f"Chained τ-bench sessions ({len(long)} conversations of the sessions of "
                f"{args.tasks_per_chain} tasks each, window {args.window})",
                args.window,
                long,
            ),
            InputSet(
                "single",
                f"τ-bench sessions alone ({len(ones)} sessions, window {args.single_window})",
                args.single_window,
                ones,
            ),
            InputSet(
                "generated",
                f"Generated coding-agent sessions ({len(gen)} sessions of {args.gen_messages}+ "
                f"messages, seed {args.seed}, window {args.window})",
                args.window,
                gen,
            ),
        )
        if s.sessions
    ]


# -- running the strategies -----------------------------------------------------------------


def run_baseline(apply: Callable[[Any, int], Any], session: Session, window: int) -> Run:
    steps = []
    for i in session.steps:
        start = time.perf_counter()
        sent = apply(session.messages[:i], window)
        steps.append(Step(i, sent, compute_ms=(time.perf_counter() - start) * 1000))
    return Run(session, steps)


def recap_config(
    fake: str, workdir: Path, name: str, overrides: dict[str, Any], windows: Sequence[int]
) -> Path:
    """Recap's config for one variant: the fake as upstream, `overrides` on the tenant."""
    tenant: dict[str, Any] = {
        "api_keys": [],
        "upstream": {"base_url": fake + "/v1", "timeout_s": 300},
        "summarizer": {"timeout_s": 300},
    }
    for key, value in overrides.items():
        tenant[key] = {**tenant.get(key, {}), **value}
    packaged = (packaged_scenes() / "session_compact.yaml").read_text(encoding="utf-8")
    riding = packaged.replace("\ninput: transcript\n", "\ninput: cache_riding\n")
    (workdir / RIDING_SCENE).write_text(riding, encoding="utf-8")
    data = {
        "store": f"sqlite:///{workdir / (name + '.db')}",
        "models": {model_for(w): {"context_window": w} for w in sorted(set(windows))},
        "tenants": {"default": tenant},
    }
    return write_config(workdir / f"{name}.yaml", data)


@contextlib.contextmanager
def recap_server(
    fake: str, workdir: Path, name: str, overrides: dict[str, Any], windows: Sequence[int]
) -> Iterator[Server]:
    port = free_port()
    config = recap_config(fake, workdir, name, overrides, windows)
    with running(name, recap_command(config, port), port, workdir) as s:
        yield s


# -- the run --------------------------------------------------------------------------------


# -- cache-riding: the summarizer's input in both styles -------------------------------------
# Cached input is billed at this share of the full price (OpenAI and Anthropic: 10%).
CACHED_PRICE = 0.1


def riding_instruction_tokens(counter: TokenCounter) -> int:
    """The cache-riding call's one instruction message: the session scene's own prompt (its
    system and user templates, the transcript slot left empty), which names the first K
    messages above as the part to summarise."""
    scene = load_scene(packaged_scenes() / "session_compact.yaml", "session_compact")
    return counter.count_text(scene.system + "\n" + scene.user, None)


@dataclass
class Riding:
    """One strategy's summarizer input, as sent today (a transcript) and as a cache-riding
    call would send it: the messages of the conversation's previous forwarded request, byte
    for byte (a provider's prefix cache holds them), then one instruction message."""

    compacting_steps: int = 0  # steps on which the summarizer was called
    cold: int = 0  # of those, with no previous request to ride on (left in transcript style)
    transcript_in: int = 0  # the summarizer input tokens the fake upstream received
    riding_in: int = 0
    riding_cached: int = 0  # the previous request's tokens: what the prefix cache covers

    def add(self, run: Run, weigh: Weigher, instruction: int) -> None:
        for i, step in enumerate(run.steps):
            if not step.summarizer_calls:
                continue
            self.compacting_steps += 1
            self.transcript_in += step.summarizer_in
            if i == 0:
                self.cold += 1
                self.riding_in += step.summarizer_in
                continue
            prefix = weigh.request(run.steps[i - 1].sent) - REPLY_PRIMING_TOKENS
            self.riding_in += prefix + instruction
            self.riding_cached += prefix

    def row(self, strategy: str) -> str:
        def cost(total: int, cached: int) -> float:
            return total - (1 - CACHED_PRICE) * cached

        coverage = self.riding_cached / self.riding_in if self.riding_in else 0.0
        base = cost(self.transcript_in, 0)
        ratio = cost(self.riding_in, self.riding_cached) / base if base else 0.0
        growth = self.riding_in / self.transcript_in if self.transcript_in else 0.0
        return (
            f"| {strategy} | {self.compacting_steps} ({self.cold} cold) | "
            f"{self.transcript_in:,} | {self.riding_in:,} ({growth:.2f}x) | {coverage:.3f} | "
            f"{ratio:.2f}x |"
        )


@dataclass
class Measured:
    """One strategy's summarizer calls as the fake upstream received them: riding calls
    sent for real (and the transcript calls a riding scene fell back to)."""

    calls: int = 0
    riding: int = 0
    tokens_in: int = 0
    cached: int = 0  # of tokens_in, the leading messages a recent chat request began with

    def add(self, run: Run) -> None:
        for step in run.steps:
            self.calls += step.summarizer_calls
            self.riding += step.riding_calls
            self.tokens_in += step.summarizer_in
            self.cached += step.summarizer_cached

    def cost(self) -> float:
        return self.tokens_in - (1 - CACHED_PRICE) * self.cached

    def row(self, strategy: str, twin: Measured | None, twin_name: str) -> str:
        coverage = self.cached / self.tokens_in if self.tokens_in else 0.0
        versus = (
            f"{self.cost() / twin.tokens_in:.2f}x `{twin_name}` ({twin.tokens_in:,})"
            if twin is not None and twin.tokens_in
            else "—"
        )
        return (
            f"| {strategy} | {self.calls} ({self.riding} riding) | {self.tokens_in:,} | "
            f"{self.cached:,} | {coverage:.3f} | {versus} |"
        )


def measured_section(results: Results) -> str:
    """The riding calls as sent: what the fake upstream received and what a prefix cache
    over the conversation's recent requests would have served of it."""
    lines = [
        "",
        "## Cache-riding calls, sent",
        "",
        "Per input set, the Recap variants whose session scene rides (`input: cache_riding`): "
        "summarizer calls as the fake upstream received them (riding ones, and the transcript "
        "calls they fell back to), their input tokens, the part of it a prefix cache holds "
        f"(its leading messages, the same JSON, as one of the conversation's last "
        "requests began: `benchmarks/fakeup.py`), and the input cost with cached input at "
        f"{CACHED_PRICE:.0%} as a ratio to the transcript twin's input (the same settings, "
        "transcript input). Token counts: Recap's estimate.",
    ]
    for input_set in results.sets:
        rows = []
        for name, twin_name in RIDING_TWINS.items():
            mine = results.measured[input_set.name].get(name)
            if mine is None or not mine.calls:
                continue
            twin = results.measured[input_set.name].get(twin_name)
            rows.append(mine.row(name, twin, twin_name))
        if rows:
            lines += [
                "",
                f"### {input_set.title}",
                "",
                "| strategy | summarizer calls | input | of it cached | prefix-cache coverage "
                "| cost (cached at 10%) vs transcript twin |",
                "| --- | --- | --- | --- | --- | --- |",
                *rows,
            ]
    return "\n".join(lines) + "\n" if len(lines) > 5 else ""


def riding_section(results: Results) -> str:
    lines = [
        "",
        "## Summarizer input: transcript vs cache-riding",
        "",
        "Per input set and Recap variant: the summarizer input tokens as sent (a transcript of "
        "the messages to summarise, not cached), and as a cache-riding call would send them "
        "(the conversation's previous forwarded request, then one instruction message of "
        f"{results.instruction} tokens: the session scene's prompt). Coverage: the share of "
        "the cache-riding input a provider's prefix cache holds (the previous request). Cost: "
        f"input cost with cached input at {CACHED_PRICE:.0%} of the price, as a ratio to the "
        "transcript style's. A compacting step with no previous request (the first of a "
        "conversation) stays in transcript style (cold). Token counts: Recap's estimate.",
    ]
    for input_set in results.sets:
        ridings = results.riding[input_set.name]
        if not ridings:
            continue
        lines += [
            "",
            f"### {input_set.title}",
            "",
            "| strategy | compacting steps | transcript input | cache-riding input "
            "| prefix-cache coverage | cost (cached at 10%) vs transcript |",
            "| --- | --- | --- | --- | --- | --- |",
            *(r.row(name) for name, r in ridings.items()),
        ]
    return "\n".join(lines) + "\n"


# -- end cache-riding --


class Results:
    """Figures per input set and strategy, and the per-step series of the plotted session."""

    def __init__(self, sets: list[InputSet], counter: TokenCounter) -> None:
        self.sets = sets
        self.weigh = Weigher(counter)
        self.figures: dict[str, dict[str, Figures]] = {s.name: {} for s in sets}
        self.series: list[Series] = []
        self.plotted = sets[0].sessions[0].id if sets else ""
        self.instruction = riding_instruction_tokens(counter)
        self.riding: dict[str, dict[str, Riding]] = {s.name: {} for s in sets}
        self.measured: dict[str, dict[str, Measured]] = {s.name: {} for s in sets}

    def add(self, strategy: str, input_set: InputSet, run: Run) -> None:
        fig = self.figures[input_set.name].setdefault(strategy, Figures(strategy))
        sent = add_run(fig, run, input_set.window, self.weigh)
        if strategy in RIDING_TWINS:
            # Its calls ride for real: measured as sent (measured_section), not estimated.
            self.measured[input_set.name].setdefault(strategy, Measured()).add(run)
        elif any(s.summarizer_calls for s in run.steps) or strategy in self.riding[input_set.name]:
            riding = self.riding[input_set.name].setdefault(strategy, Riding())
            riding.add(run, self.weigh, self.instruction)
            self.measured[input_set.name].setdefault(strategy, Measured()).add(run)
        if run.session.id == self.plotted and input_set is self.sets[0]:
            summ = [s.summarizer_in + s.summarizer_out for s in run.steps]
            self.series.append(Series(strategy, sent, summ))


def progress(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def run_servers(
    args: argparse.Namespace, sets: list[InputSet], results: Results, workdir: Path
) -> None:
    windows = [s.window for s in sets]
    fake_port = args.fake_port or free_port()
    relay = ("--summarizer-url", args.summarizer_url, "--summarizer-model", args.summarizer_model)
    cmd = fake_command(MODULE, fake_port, *(relay if args.summarizer_url else ()))
    targets: list[tuple[str, str | None]] = [(v, None) for v in args.variants]
    if args.peer:
        targets.append((args.peer_name, args.peer.rstrip("/") + PATHS[args.api]))
    with (
        running("fake", cmd, fake_port, workdir) as fake,
        httpx.Client(
            timeout=600, trust_env=False, headers={"authorization": "Bearer sk-replay"}
        ) as client,
    ):
        for name, url in targets:
            with contextlib.ExitStack() as stack:
                if url is None:
                    overrides = args.variants[name][1]
                    server = recap_server(fake.url, workdir, name, overrides, windows)
                    url = stack.enter_context(server).url
                    url += "/v1" + PATHS[args.api]
                for input_set in sets:
                    start = time.perf_counter()
                    for session in input_set.sessions:
                        conversation = f"{name}/{session.id}"
                        run = replay_session(client, url, fake.url, session, conversation, args.api)
                        results.add(name, input_set, run)
                    progress(f"  {name} on {input_set.name}: {time.perf_counter() - start:.1f} s")


def command_line(argv: Sequence[str]) -> str:
    return " ".join([f"python -m {MODULE}", *map(shlex.quote, argv)])


def api_line(api: str) -> str:
    if api == "chat":
        return "chat completions (`/v1/chat/completions`)"
    if api == "messages":
        return (
            "Anthropic Messages (`/v1/messages`, Claude Code's cache breakpoints; figures "
            "computed on the forwarded request read back as chat messages, a system or user "
            "block each, invalid also counting what the upstream's Anthropic check rejects)"
        )
    return (
        "Responses (`/v1/responses`; figures computed on the forwarded input read back as "
        "chat messages, invalid also counting what the upstream's input check rejects)"
    )


def report(args: argparse.Namespace, argv: Sequence[str], results: Results, elapsed: float) -> str:
    order = ["none", "window", "middle-out", *args.variants, args.peer_name if args.peer else ""]
    sets = {
        s.name: (
            s.title,
            [results.figures[s.name][k] for k in order if k in results.figures[s.name]],
        )
        for s in results.sets
    }
    strategies = [f"- `{b.name}`: {b.describe}" for b in baselines(lambda m: 0, args.keep_messages)]
    strategies += [f"- `{v}`: {d}" for v, (d, _) in args.variants.items()]
    if args.peer:
        strategies.append(f"- `{args.peer_name}`: the proxy at {args.peer}")
    summarizer = (
        f"the model {args.summarizer_model or '(the request model)'} at {args.summarizer_url}"
        if args.summarizer_url
        else "the harness's deterministic extractive summarizer (`benchmarks/fakeup.py`)"
    )
    head = [
        "## Replay of real agent trajectories",
        "",
        f"`{command_line(argv)}`",
        "",
        f"Revision {git_revision()}; Python {platform.python_version()}; {os.cpu_count()} cores; "
        f"{elapsed:.0f} s. Summarizer: {summarizer}. API: {api_line(args.api)}.",
        "",
        "Strategies:",
        "",
        *strategies,
        "",
        COLUMNS,
        "",
    ]
    return markdown(head, sets, details(results.figures), "chained")


def run(args: argparse.Namespace, argv: Sequence[str], workdir: Path) -> int:
    print(f"$ {command_line(argv)}", flush=True)
    started = time.perf_counter()
    sets = inputs(args)
    counter = TokenCounter()
    results = Results(sets, counter)
    for s in sets:
        steps = sum(len(x.steps) for x in s.sessions)
        progress(f"{s.name}: {len(s.sessions)} sessions, {steps} steps")
    weigh = results.weigh
    for baseline in baselines(weigh.message, args.keep_messages):
        for s in sets:
            for session in s.sessions:
                weigh.remember(session)  # middle-out counts the session's own messages
                results.add(baseline.name, s, run_baseline(baseline.apply, session, s.window))
        progress(f"  {baseline.name}: done")
    run_servers(args, sets, results, workdir)
    text = report(args, argv, results, time.perf_counter() - started)
    text += riding_section(results) + measured_section(results)
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = "replay" if args.api == "chat" else f"replay-{args.api}"
    (out / f"{stem}.md").write_text(text, encoding="utf-8")
    data = {
        "command": command_line(argv),
        "revision": git_revision(),
        "api": args.api,
        "sets": {
            s.name: {
                "title": s.title,
                "window": s.window,
                "figures": {k: f.as_json() for k, f in results.figures[s.name].items()},
                "targets": [
                    {"met": ok, "target": t}
                    for ok, t in verdicts(list(results.figures[s.name].values()))
                ],
            }
            for s in sets
        },
        "plotted_session": {
            "session": results.plotted,
            "series": {
                x.strategy: {"sent": x.sent, "summarizer": x.summarizer} for x in results.series
            },
        },
    }
    (out / f"{stem}.json").write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    pngs = (
        plots(results.series, sets[0].window, f"{results.plotted} ({sets[0].name})", out, stem)
        if sets
        else None
    )
    if pngs is None:
        progress("matplotlib is not installed (pip install '.[bench]'): plots skipped")
    written = [out / f"{stem}.md", out / f"{stem}.json", *(pngs or ())]
    if args.docs:
        DOCS.mkdir(exist_ok=True)
        for path in [out / f"{stem}.md", *(pngs or ())]:
            shutil.copy(path, DOCS / path.name)
            written.append(DOCS / path.name)
    progress(
        "wrote "
        + ", ".join(str(p.relative_to(REPO)) if p.is_relative_to(REPO) else str(p) for p in written)
    )
    return 0


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.replay", description=__doc__.split("\n")[0] if __doc__ else None
    )
    p.add_argument(
        "--api",
        choices=list(PATHS),
        default="chat",
        help="send the histories to /v1/chat/completions (default) or, in the Responses "
        "shape, to /v1/responses",
    )
    p.add_argument("--data", default=str(TAUBENCH), help="τ-bench JSONL (default: tests/data)")
    p.add_argument("--window", type=int, default=16000, help="window of chained/generated sessions")
    p.add_argument("--single-window", type=int, default=8000, help="window of single sessions")
    p.add_argument("--singles", type=int, default=100, help="τ-bench sessions alone (default 100)")
    p.add_argument("--chains", type=int, default=5, help="chained conversations (default 5)")
    p.add_argument("--tasks-per-chain", type=int, default=10, help="tasks per chain (default 10)")
    p.add_argument("--generated", type=int, default=2, help="generated sessions (default 2)")
    p.add_argument("--gen-messages", type=int, default=520, help="messages per generated session")
    p.add_argument("--seed", type=int, default=1, help="seed of the first generated session")
    p.add_argument("--keep-messages", type=int, default=40, help="the sliding window's size")
    p.add_argument(
        "--recap",
        nargs="*",
        default=DEFAULT_VARIANTS,
        choices=list(VARIANTS),
        help=f"Recap variants to run (default {' '.join(DEFAULT_VARIANTS)})",
    )
    p.add_argument(
        "--recap-config",
        action="append",
        default=[],
        metavar="NAME=JSON",
        help="also run Recap with these overrides of tenants.default (JSON), as NAME",
    )
    p.add_argument(
        "--peer", help="base URL of another OpenAI-compatible proxy (e.g. http://h:p/v1)"
    )
    p.add_argument("--peer-name", default="peer", help="its name in the tables")
    p.add_argument("--fake-port", type=int, help="fixed port of the fake upstream (for a peer)")
    p.add_argument("--summarizer-url", default="", help="real summarizer: an OpenAI base URL")
    p.add_argument("--summarizer-model", default="", help="model name for --summarizer-url")
    p.add_argument(
        "--quick", action="store_true", help="a small run: 10 singles, 1 chain, 1 generated"
    )
    p.add_argument("--out", default=str(OUT), help="output directory (default benchmarks/out)")
    p.add_argument("--no-docs", dest="docs", action="store_false", help="do not copy to docs/")
    p.add_argument("--workdir", help="keep configs, databases and logs here (default: temp dir)")
    p.add_argument("--serve-fake", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.singles, args.chains = min(args.singles, 10), min(args.chains, 1)
        args.generated = min(args.generated, 1)
    args.variants = {v: VARIANTS[v] for v in args.recap}
    for spec in args.recap_config:
        name, sep, raw = spec.partition("=")
        try:
            overrides = json.loads(raw) if sep else None
        except ValueError:
            overrides = None
        if not name or not isinstance(overrides, dict):
            p.error(f"--recap-config wants NAME=JSON (an object), got {spec!r}")
        args.variants[name] = (f"Recap with `{raw}`", overrides)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.serve_fake:
        serve_app(ReplayUpstream(args.summarizer_url, args.summarizer_model).app, args.port)
        return 0
    return in_workdir(run, args, argv, "replay")


if __name__ == "__main__":
    sys.exit(main())
