"""Replays the τ-bench sessions through a real proxy whose tenant holds out half its
conversations, and prints `recap report` for that tenant.

Outside the data path: a script that prints figures (never a test). Each session is one
conversation (`--tasks-per-chain` chains that many tasks into one); at every point where the
recorded agent called the model, the history so far is sent through Recap (`python -m proxy
serve`, its own process, SQLite in the work directory), and the fake upstream answers with the
recorded assistant message (`benchmarks.fakeup.ReplayUpstream`, its own process). On top of
the replay's fake, this one reports usage as an upstream would:

    prompt_tokens       the request's messages as Recap's token counter counts them
    cached_tokens       a prefix cache: the longest run of whole messages this conversation's
                        previous request began with, counted in 128-token steps, for prompts
                        of 1,024 tokens and more (how OpenAI's prompt cache is documented)
    completion_tokens   the recorded answer's text and tool calls
    a refusal           over --upstream-window tokens the fake answers 400
                        `context_length_exceeded`, with OpenAI's message

Recap's own window for the model (`--window`) is smaller than the upstream's, so the
compacted cohort is compacted and the held-out one, sent as it came, reaches the upstream's
limit in its longest sessions (Recap recovers those refusals, docs/holdout.md).

What it can show: the cost side (tokens, cache, summarizer tokens, cost at the example
prices, added latency, overflows). What it cannot: every answer is the recorded one, whatever
Recap sent, so the agent's behaviour (turns, tool calls, repeats, re-asks, abandonment)
differs between the cohorts only by which sessions the hash put in which: a difference there
is noise by construction, and the intervals should call it so. Only live traffic measures
what compaction does to an agent's behaviour.

Usage (from the repository root):
    python -m benchmarks.holdout [--holdout 0.5] [--window 4000] [--upstream-window 8000]
        [--tasks-per-chain 1] [--sessions 100]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from benchmarks.fakeup import STEP_HEADER, ReplayUpstream, message_key
from benchmarks.harness import (
    REPO,
    environment,
    fake_command,
    free_port,
    in_workdir,
    recap_command,
    running,
    serve_app,
    write_config,
)
from benchmarks.sessions import TAUBENCH, Session, chains, load_taubench, singles
from tests.fakes import Recorded, Reply, ReplyOrAwaitable

MODULE = "benchmarks.holdout"
MODEL = "holdout-model"
# Example prices per million tokens (input, its cached part, output): a list price of a
# current model, only to show the cost measure.
PRICES = {"input": 2.5, "cached_input": 1.25, "output": 10.0}
CACHE_MIN_TOKENS = 1024
CACHE_STEP = 128


class HoldoutUpstream(ReplayUpstream):
    """The replay's fake with an upstream's usage, prefix cache and context limit."""

    def __init__(self, window: int) -> None:
        super().__init__()
        self.window = window
        self.previous: dict[str, list[str]] = {}

    def reply_to(self, request: Recorded, body: dict[str, Any]) -> ReplyOrAwaitable:
        if request.purpose == "summarize":
            return super().reply_to(request, body)
        messages = body.get("messages") or []
        model = body.get("model")
        prompt = self.counter.count_messages(messages, model)
        if self.window and prompt > self.window:
            message = (
                f"This model's maximum context length is {self.window} tokens. However, your "
                f"messages resulted in {prompt} tokens. Please reduce the length of the messages."
            )
            error = {
                "message": message,
                "type": "invalid_request_error",
                "param": "messages",
                "code": "context_length_exceeded",
            }
            return Reply(status=400, error={"error": error})
        reply = super().reply_to(request, body)
        if not isinstance(reply, Reply):
            return reply
        conversation = request.headers.get("x-conversation-id", "")
        keys = [message_key(m) for m in messages]
        before = self.previous.get(conversation, [])
        common = 0
        while common < min(len(keys), len(before)) and keys[common] == before[common]:
            common += 1
        self.previous[conversation] = keys
        prefix = self.counter.count_messages(messages[:common], model) if common else 0
        cached = prefix // CACHE_STEP * CACHE_STEP if prompt >= CACHE_MIN_TOKENS else 0
        if cached < CACHE_MIN_TOKENS:
            cached = 0
        answer = json.dumps(reply.tool_calls) if reply.tool_calls else ""
        completion = self.counter.count_text((reply.content or "") + answer, model)
        usage = {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": min(cached, prompt)},
        }
        return dataclasses.replace(reply, usage=usage)


def progress(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def command_line(argv: Sequence[str]) -> str:
    return " ".join([f"python -m {MODULE}", *map(shlex.quote, argv)])


def sessions(args: argparse.Namespace) -> list[Session]:
    rows = load_taubench(Path(args.data))
    found = (
        singles(rows, MODEL)
        if args.tasks_per_chain <= 1
        else chains(rows, args.tasks_per_chain, MODEL)
    )
    return found[: args.sessions]


def replay(client: httpx.Client, url: str, fake: str, session: Session) -> Counter[int]:
    """Every step of `session` through the proxy, as one conversation; the statuses."""
    messages = session.messages
    answers = [
        {"step": i, "last": message_key(messages[i - 1]), "message": messages[i]}
        for i in session.steps
    ]
    client.post(fake + "/_replay/session", json={"answers": answers}).raise_for_status()
    statuses: Counter[int] = Counter()
    for i in session.steps:
        body = {"model": session.model, "messages": messages[:i]}
        headers = {"x-conversation-id": session.id, STEP_HEADER: str(i)}
        statuses[client.post(url, json=body, headers=headers).status_code] += 1
    client.get(fake + "/_replay/log").raise_for_status()  # read, so the fake forgets it
    return statuses


def run(args: argparse.Namespace, argv: Sequence[str], workdir: Path) -> int:
    print(f"$ {command_line(argv)}")
    print(environment())
    chosen = sessions(args)
    steps = sum(len(s.steps) for s in chosen)
    progress(f"{len(chosen)} conversations, {steps} requests")
    config = write_config(
        workdir / "recap.yaml",
        {
            "store": f"sqlite:///{workdir / 'recap.db'}",
            "models": {MODEL: {"context_window": args.window}},
            "tenants": {
                "default": {
                    "upstream": {"base_url": "http://127.0.0.1:1/v1", "timeout_s": 300},
                    "summarizer": {"timeout_s": 300},
                    "holdout": args.holdout,
                    "prices": PRICES,
                }
            },
        },
    )
    fake_port, port = free_port(), free_port()
    statuses: Counter[int] = Counter()
    started = time.perf_counter()
    fake_cmd = fake_command(MODULE, fake_port, "--upstream-window", str(args.upstream_window))
    with running("fake", fake_cmd, fake_port, workdir) as fake:
        text = config.read_text(encoding="utf-8")
        config.write_text(text.replace("http://127.0.0.1:1/v1", fake.url + "/v1"), "utf-8")
        with (
            running("recap", recap_command(config, port), port, workdir) as recap,
            httpx.Client(timeout=300, trust_env=False) as client,
        ):
            for n, session in enumerate(chosen, 1):
                statuses += replay(client, recap.url + "/v1/chat/completions", fake.url, session)
                if n % 10 == 0:
                    progress(f"  {n} conversations replayed")
    # The proxy has stopped: everything it answered is in the store.
    elapsed = time.perf_counter() - started
    answered = ", ".join(f"{n} × {status}" for status, n in sorted(statuses.items()))
    print(
        f"{len(chosen)} τ-bench conversations ({steps} requests: {answered}) in {elapsed:.0f} s; "
        f"Recap's window {args.window} tokens, the upstream's {args.upstream_window}; "
        f"holdout {args.holdout:g}; prices per million tokens {PRICES}"
    )
    report = [sys.executable, "-m", "proxy", "report", "--config", str(config), "--since", "1d"]
    print(f"$ recap report --config {config.name} --since 1d")
    done = subprocess.run(report, cwd=REPO, capture_output=True, text=True, check=False)
    print(done.stdout.rstrip())
    if done.returncode != 0:
        progress(done.stderr)
    return done.returncode


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog=f"python -m {MODULE}", description=__doc__.split("\n")[0] if __doc__ else None
    )
    p.add_argument("--data", default=str(TAUBENCH), help="τ-bench JSONL (default: tests/data)")
    p.add_argument("--holdout", type=float, default=0.5, help="the tenant's share (default 0.5)")
    p.add_argument("--window", type=int, default=4000, help="Recap's window for the model")
    p.add_argument(
        "--upstream-window", type=int, default=8000, help="the fake refuses prompts above this"
    )
    p.add_argument("--tasks-per-chain", type=int, default=1, help="tasks per conversation")
    p.add_argument("--sessions", type=int, default=100, help="conversations at most")
    p.add_argument("--workdir", help="keep configs, databases and logs here (default: temp dir)")
    p.add_argument("--serve-fake", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.serve_fake:
        serve_app(HoldoutUpstream(args.upstream_window).app, args.port)
        return 0
    return in_workdir(run, args, argv, "holdout")


if __name__ == "__main__":
    sys.exit(main())
