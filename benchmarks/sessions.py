"""Replay inputs: τ-bench sessions alone and chained, and generated long agent sessions.

Outside the data path: what `benchmarks.replay` plays through every strategy. A `Session` is
one conversation exactly as the recorded agent's client sent it, plus the facts the agent later
acts on: the string arguments of each gold write action (user, reservation and payment ids,
flight numbers, dates), tied to the step at which the recorded agent makes that call. A step
is an index i where the agent called the model with messages[:i] and answered messages[i].

Three input sets:
  single     every τ-bench session on its own
  chained    the sessions of `tasks_per_chain` consecutive tasks (both trials) as one long
             conversation; only the first system prompt is kept
  generated  seeded coding-agent sessions of 500+ messages with long tool outputs, long tool
             loops (loop working memory fires) and deploy calls that use a ticket and a build
             id seen hundreds of messages earlier (the facts of these sessions)
  loop       one seeded coding-agent turn that is a single long tool loop (`coding_loop`):
             investigate, fix, test, commit, build, more work, then deploy and close the
             ticket with the build id and commit seen many rounds earlier (its facts)
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
TAUBENCH = REPO / "tests" / "data" / "taubench-airline-dev.jsonl"
# Gold actions that only read: their arguments are not facts a later write depends on.
READ_PREFIXES = ("get_", "search_", "list_", "calculate")

Message = dict[str, Any]


@dataclass(frozen=True)
class Fact:
    """A value the agent passes to a write call at `step`; `source` names the session."""

    value: str
    step: int
    action: str
    source: str


@dataclass(frozen=True)
class Session:
    id: str
    kind: str  # "single", "chained", "generated"
    model: str
    messages: list[Message]
    facts: tuple[Fact, ...]

    @property
    def steps(self) -> list[int]:
        return list(model_calls(self.messages))


def model_calls(messages: Sequence[Mapping[str, Any]]) -> Iterator[int]:
    """Indices i where the recorded agent called the model with messages[:i]."""
    for i, m in enumerate(messages):
        if i and m.get("role") == "assistant" and messages[i - 1].get("role") in ("user", "tool"):
            yield i


def gold_values(kwargs: Any) -> set[str]:
    """String arguments that name something (a digit in them, 4+ chars): ids, flights, dates."""
    out: set[str] = set()
    if isinstance(kwargs, Mapping):
        for v in kwargs.values():
            out |= gold_values(v)
    elif isinstance(kwargs, list):
        for v in kwargs:
            out |= gold_values(v)
    elif isinstance(kwargs, str) and len(kwargs) >= 4 and any(c.isdigit() for c in kwargs):
        out.add(kwargs)
    return out


def facts_of(
    messages: Sequence[Mapping[str, Any]],
    gold_actions: Sequence[Mapping[str, Any]],
    span: tuple[int, int],
    source: str,
) -> list[Fact]:
    """Each gold write action's values, at the first step in `span` whose recorded answer
    calls that action (an action the agent never called is skipped)."""
    calls = [i for i in model_calls(messages) if span[0] <= i < span[1]]
    used: set[int] = set()
    facts: list[Fact] = []
    for action in gold_actions:
        name = str(action.get("name"))
        if name.startswith(READ_PREFIXES):
            continue
        values = gold_values(action.get("kwargs"))
        named = [i for i in calls if i not in used and _calls(messages[i], name)]
        # The call that passes all the action's values, else the first one of its name.
        exact = [i for i in named if all(v in _calls(messages[i], name) for v in values)]
        if not named:
            continue
        step = (exact or named)[0]
        used.add(step)
        facts += [Fact(v, step, name, source) for v in sorted(values)]
    return facts


def _calls(message: Mapping[str, Any], name: str) -> str:
    """The arguments of the message's calls to `name`, joined ("" if it makes none)."""
    return "\n".join(
        str(c["function"].get("arguments") or "") or "{}"
        for c in message.get("tool_calls") or []
        if isinstance(c, Mapping)
        and isinstance(c.get("function"), Mapping)
        and c["function"].get("name") == name
    )


def load_taubench(path: Path = TAUBENCH) -> list[dict[str, Any]]:
    with path.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _name(row: Mapping[str, Any]) -> str:
    return f"task{row['task_id']}-trial{row['trial']}"


def singles(rows: Sequence[Mapping[str, Any]], model: str) -> list[Session]:
    out = []
    for row in rows:
        msgs = list(row["messages"])
        facts = facts_of(msgs, row["gold_actions"], (0, len(msgs)), _name(row))
        out.append(Session(_name(row), "single", model, msgs, tuple(facts)))
    return out


def chain(rows: Sequence[Mapping[str, Any]], name: str, model: str) -> Session:
    """Sessions as one conversation: the first system prompt, then every session's
    non-system messages in order (the later system prompts are dropped)."""
    messages: list[Message] = []
    facts: list[Fact] = []
    for n, row in enumerate(rows):
        own = [m for m in row["messages"] if n == 0 or m.get("role") != "system"]
        start = len(messages)
        messages.extend(own)
        facts += facts_of(messages, row["gold_actions"], (start, len(messages)), _name(row))
    return Session(name, "chained", model, messages, tuple(facts))


def chains(rows: Sequence[Mapping[str, Any]], tasks_per_chain: int, model: str) -> list[Session]:
    """Every session of `tasks_per_chain` consecutive tasks per chain, in file order."""
    groups: dict[int, list[Mapping[str, Any]]] = {}
    for row in rows:
        groups.setdefault(int(row["task_id"]) // tasks_per_chain, []).append(row)
    out = []
    for g, members in sorted(groups.items()):
        first, last = g * tasks_per_chain, g * tasks_per_chain + tasks_per_chain - 1
        out.append(chain(members, f"tasks{first}-{last}", model))
    return out


# -- generated sessions ----------------------------------------------------------------------

SYSTEM = (
    "You are a coding agent working in the user's repository. Use the tools to read, search, "
    "edit, test, build and deploy. Never deploy without a passing build and the ticket it "
    "belongs to. Keep answers short; quote file paths and identifiers exactly.\n\n"
    "Tools: read_file(path), grep(pattern), write_file(path, content), run_tests(target), "
    "build(target), deploy(build_id, ticket).\n"
) * 4
MODULES = ("orders", "billing", "auth", "inventory", "search", "notify", "reports", "shipping")
WORDS = (
    "request", "payload", "retry", "cache", "session", "token", "cursor", "batch", "limit",
    "window", "record", "ledger", "quota", "handler", "schema", "index", "queue", "worker",
)  # fmt: skip


class _Gen:
    """One generated session; every choice comes from one seeded Random."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.messages: list[Message] = [{"role": "system", "content": SYSTEM}]
        self.gold: list[dict[str, Any]] = []
        self.calls = 0

    def word(self) -> str:
        return self.rng.choice(WORDS)

    def path(self) -> str:
        return f"src/{self.rng.choice(MODULES)}/{self.word()}_{self.word()}.py"

    def code(self, path: str) -> str:
        lines = [f"# {path}", "from __future__ import annotations", ""]
        for _ in range(self.rng.randint(40, 160)):
            a, b, c, n = self.word(), self.word(), self.word(), self.rng.randint(1, 999)
            lines.append(
                self.rng.choice(
                    (
                        f"def {a}_{b}(self, {c}: int = {n}) -> dict[str, int]:",
                        f"    {a} = self.{b}.get('{c}', {n})",
                        f"    if {a} > MAX_{b.upper()}:  # {c} guard",
                        f"        raise ValueError('{a} over the {b} limit')",
                        f"    return {{'{a}': {a}, '{b}': {n}}}",
                        "",
                    )
                )
            )
        return "\n".join(lines)

    def test_log(self, target: str, failing: int) -> str:
        lines = [f"$ pytest {target} -q"]
        for _ in range(self.rng.randint(20, 90)):
            ok = self.rng.random() > 0.1 or not failing
            lines.append(
                f"tests/test_{self.word()}.py::test_{self.word()}_{self.word()} "
                + ("PASSED" if ok else "FAILED")
            )
        for _ in range(failing):
            lines += [
                f"____ test_{self.word()}_{self.word()} ____",
                f"E   AssertionError: expected {self.rng.randint(1, 500)} "
                f"got {self.rng.randint(1, 500)}",
            ]
        lines.append(f"{failing} failed, {self.rng.randint(20, 300)} passed in 4.2s")
        return "\n".join(lines)

    def call(self, name: str, args: dict[str, Any], content: str | None = None) -> str:
        # Ids repeat across the session (as τ-bench's do): results match the nearest call.
        call_id = f"call_{self.calls % 40}"
        self.calls += 1
        self.messages.append(
            {
                "role": "assistant",
                "content": content,
                "tool_calls": [
                    {
                        "id": call_id,
                        "type": "function",
                        "function": {"name": name, "arguments": json.dumps(args)},
                    }
                ],
            }
        )
        return call_id

    def result(self, call_id: str, name: str, content: str) -> None:
        self.messages.append(
            {"role": "tool", "tool_call_id": call_id, "name": name, "content": content}
        )

    def work_round(self) -> None:
        kind = self.rng.choice(("read", "read", "grep", "test", "write"))
        if kind == "read":
            path = self.path()
            self.result(self.call("read_file", {"path": path}), "read_file", self.code(path))
        elif kind == "grep":
            pattern = f"{self.word()}_{self.word()}"
            hits = "\n".join(
                f"{self.path()}:{self.rng.randint(1, 400)}:    {self.word()} = {pattern}("
                f"{self.word()})"
                for _ in range(self.rng.randint(5, 40))
            )
            self.result(self.call("grep", {"pattern": pattern}), "grep", hits)
        elif kind == "test":
            target = f"tests/test_{self.rng.choice(MODULES)}.py"
            log = self.test_log(target, self.rng.choice((0, 0, 1, 2)))
            self.result(self.call("run_tests", {"target": target}), "run_tests", log)
        else:
            path = self.path()
            cid = self.call("write_file", {"path": path, "content": self.code(path)[:1500]})
            self.result(cid, "write_file", f"wrote {path}")

    def turn(self, user: str, rounds: int, answer: str) -> None:
        self.messages.append({"role": "user", "content": user})
        for _ in range(rounds):
            self.work_round()
        self.messages.append({"role": "assistant", "content": answer})

    def epic(self) -> None:
        """Six turns on one ticket: investigate, fix, build, more work, release."""
        module = self.rng.choice(MODULES)
        ticket = f"OPS-{self.rng.randint(1000, 9999)}"
        self.turn(
            f"Ticket {ticket}: the {module} service drops {self.word()}s under load. Find out "
            f'why. Constraint: "do not change the public API of {module}".',
            self.rng.randint(8, 14),
            f"Found it: the {self.word()} guard in src/{module} rejects retries. Plan: relax it.",
        )
        self.turn(
            "Go ahead and fix it, with tests.",
            self.rng.randint(4, 9),
            "Fixed and tested; all tests pass now.",
        )
        self.messages.append({"role": "user", "content": f"Build {module} for release."})
        build_id = f"bld-{self.rng.getrandbits(32):08x}"
        target = f"services/{module}"
        log = "\n".join(
            [f"[{n:03d}] compiling {self.path()}" for n in range(self.rng.randint(20, 60))]
            + [f"Build {build_id} finished: {target} OK"]
        )
        self.result(self.call("build", {"target": target}), "build", log)
        mention = self.rng.random() < 0.5
        self.messages.append(
            {
                "role": "assistant",
                "content": f"Build {build_id} passed." if mention else "The build passed.",
            }
        )
        self.turn(
            f"While it bakes, look at the {self.rng.choice(MODULES)} tests too.",
            self.rng.randint(3, 12),
            "Those tests are flaky but unrelated; noted for later.",
        )
        self.messages.append({"role": "user", "content": "Ship the build."})
        kwargs = {"build_id": build_id, "ticket": ticket}
        self.gold.append({"name": "deploy", "kwargs": kwargs})
        self.result(self.call("deploy", kwargs), "deploy", f"deployed {build_id} to production")
        self.messages.append({"role": "assistant", "content": "Deployed."})


def generate(seed: int, min_messages: int, model: str) -> Session:
    """A coding-agent session of at least `min_messages` messages, the same for a seed."""
    gen = _Gen(seed)
    while len(gen.messages) < min_messages:
        gen.epic()
    name = f"gen-seed{seed}"
    facts = facts_of(gen.messages, gen.gold, (0, len(gen.messages)), name)
    return Session(name, "generated", model, gen.messages, tuple(facts))


def coding_loop(seed: int, rounds: int, model: str) -> Session:
    """One user turn answered by one tool loop of about `rounds` tool rounds, the same for a
    seed: loop working memory (not the session summary) must carry its facts.

    The user's request states a constraint without quotation marks, as users write. Half the
    work rounds come before the fix is committed and built, half after; the last two calls,
    deploy(build_id, ticket) and close_ticket(ticket, commit, build_id), use the build id and
    the commit that only earlier tool results hold."""
    gen = _Gen(seed)
    module = gen.rng.choice(MODULES)
    ticket = f"OPS-{gen.rng.randint(1000, 9999)}"
    gen.messages.append(
        {
            "role": "user",
            "content": f"Ticket {ticket}: the {module} service drops {gen.word()}s under load. "
            f"Find the cause, fix it with a test, commit, build services/{module} and deploy "
            f"the build, then close the ticket. Don't change the public API of {module}, and "
            "never deploy a build whose tests fail.",
        }
    )
    work = max(rounds - 5, 2)
    for _ in range(work // 2):
        gen.work_round()
    target = f"tests/test_{module}.py"
    gen.result(gen.call("run_tests", {"target": target}), "run_tests", gen.test_log(target, 0))
    commit = f"{gen.rng.getrandbits(28):07x}"
    message = f"{ticket}: accept retries in the {module} {gen.word()} guard"
    cid = gen.call("git_commit", {"message": message})
    gen.result(cid, "git_commit", f"[main {commit}] {message}\n 2 files changed")
    build_id = f"bld-{gen.rng.getrandbits(32):08x}"
    log = "\n".join(
        [f"[{n:03d}] compiling {gen.path()}" for n in range(gen.rng.randint(20, 60))]
        + [f"Build {build_id} finished: services/{module} OK"]
    )
    gen.result(gen.call("build", {"target": f"services/{module}"}), "build", log)
    for _ in range(work - work // 2):
        gen.work_round()
    deploy = {"build_id": build_id, "ticket": ticket}
    gen.result(gen.call("deploy", deploy), "deploy", f"deployed {build_id} to production")
    close = {"ticket": ticket, "commit": commit, "build_id": build_id}
    gen.result(gen.call("close_ticket", close), "close_ticket", f"{ticket} closed")
    gen.messages.append(
        {"role": "assistant", "content": f"Fixed in {commit}, deployed {build_id}; closed."}
    )
    gold = [{"name": "deploy", "kwargs": deploy}, {"name": "close_ticket", "kwargs": close}]
    name = f"loop-seed{seed}"
    facts = facts_of(gen.messages, gold, (0, len(gen.messages)), name)
    return Session(name, "loop", model, gen.messages, tuple(facts))
