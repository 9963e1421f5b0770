"""The replay's fake upstream: recorded answers, an extractive summarizer, a log of requests.

Outside the data path: `benchmarks.replay` runs this app in its own process and points Recap
(or a peer proxy) at it. It is the tests' fake (`tests.fakes.FakeUpstream`, recording
nothing) with the replay's control routes and a `reply_to` that finds the recorded answer.
Before a session the harness posts the session's recorded answers
(`POST /_replay/session`); then every chat call is answered with the recorded assistant
message of its step, found by the `x-replay-step` header the harness sends (proxies forward
it), or else by the last message of the request. So the conversation unfolds exactly as it
was recorded, whatever the proxy sent. A `/v1/responses` call (`replay --api responses`) is
answered the same way, as a Responses answer; what it received is checked as OpenAI would
check it (`tests.fake_responses.input_problems`) and logged in chat form
(`benchmarks.responses_shape.to_chat`), so its figures are computed as for chat; a `/v1/messages`
call likewise (`replay --api messages`). A cache-riding summarizer call made in those APIs
(Recap sends it in the request's own API) is answered in its shape, its messages read in chat
form, and its cached share found among the chat-form requests the same way.

Summarizer calls (`x-recap-purpose: summarize`, or any call that matches no step: a peer's
own model calls) get a deterministic extractive summary (`extractive_summary`), or are relayed
to a real model endpoint when the app is given one. A cache-riding summarizer call (the
forwarded request, then one instruction naming "messages 1 to K") is summarised over those K
messages, the summary they show merged (`riding_summary`). Every summarizer call is logged
with the share of its input a provider's prefix cache would hold: its longest run of leading
messages, the same JSON, found in one of the conversation's last chat requests
(`RECENT_REQUESTS`). Every call is logged with what it received, and the harness collects
(and clears) the log after each session
(`GET /_replay/log`). The fake's own time per call goes back in `x-replay-fake-ms`, so the
harness can subtract it from the time through the proxy. `replay_session` is the harness's
side of this protocol: one session, step by step, through a proxy in front of this app.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import httpx
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from benchmarks import messages_shape, responses_shape
from benchmarks.harness import BenchError
from benchmarks.metrics import Run, Step
from benchmarks.sessions import Session
from proxy.history.tokens import TokenCounter
from proxy.planning.framing import FRAME_CLOSE, FRAME_OPEN
from proxy.planning.transcript import content_text, render_transcript
from tests.fake_messages import request_problems
from tests.fake_responses import input_problems
from tests.fakes import FakeUpstream, Recorded, Reply, ReplyOrAwaitable

STEP_HEADER = "x-replay-step"
FAKE_MS_HEADER = "x-replay-fake-ms"
SUMMARIZER_KEY_ENV = "REPLAY_SUMMARIZER_API_KEY"
DEFAULT_MAX_CHARS = 6000
# Identifiers: a letter and a digit in 4+ word characters (ids, flight numbers, build ids).
_IDENT = re.compile(r"\b(?=[\w-]*\d)(?=[\w-]*[A-Za-z])[A-Za-z0-9][\w-]{3,63}\b")
_ITEM = re.compile(r"^(User|Assistant|System|Tool result \[[^\]]*\]|Assistant called tool )", re.M)
SECTIONS = (
    "User Goal",
    "Confirmed Facts",
    "Decisions Made",
    "Open Issues",
    "Pending Actions",
    "Important References",
)
ITEM_CHARS = 240
# How many of the last chat requests a prefix cache is taken to hold (OpenAI and Anthropic
# keep a prefix for minutes; a background summary comes within a step or two).
RECENT_REQUESTS = 3
# A riding instruction names its part as "messages 1 to K" (scenes/session_compact.yaml).
_RIDING_PART = re.compile(r"messages 1 to (\d+)")


def message_key(message: Any) -> str:
    """A stable key for a message (the harness and the fake compute it alike)."""
    return hashlib.sha256(json.dumps(message, sort_keys=True).encode()).hexdigest()


def _between(text: str, tag: str) -> str:
    m = re.search(rf"<{tag}>\n?(.*?)\n?</{tag}>", text, re.S)
    return m.group(1).strip() if m else ""


def _one_line(text: str, limit: int = ITEM_CHARS) -> str:
    line = " ".join(text.split())
    return line if len(line) <= limit else line[: limit - 1] + "…"


def _sections(summary: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {s: [] for s in SECTIONS}
    current: str | None = None
    for line in summary.splitlines():
        if line.startswith("## "):
            current = line[3:].strip() if line[3:].strip() in out else None
        elif current and line.strip() and line.strip() != "None":
            out[current].append(line.strip())
    return out


def extractive_summary(messages: Sequence[Mapping[str, Any]]) -> str:
    """A deterministic stand-in for a summarizer model, over the request Recap sent it.

    Keeps what the user asked, what the assistant concluded, the tools it called and the
    identifiers the assistant itself mentioned (not those only a tool printed: a model's
    summary would keep some of those too, which is what Recap's quality guard is for), merged
    into the existing summary, oldest lines dropped first to stay within the character budget
    the prompt names. Sections as the scene asks, inside <summary> tags.
    """
    prompt = "\n".join(content_text(m.get("content")) for m in messages)
    found = re.search(r"within (\d+) characters", prompt)
    max_chars = int(found.group(1)) if found else DEFAULT_MAX_CHARS
    sections = _sections(_between(prompt, "existing_summary"))
    transcript = _between(prompt, "conversation_history") or _between(prompt, "tool_history")
    starts = [m.start() for m in _ITEM.finditer(transcript)]
    ends = [*starts[1:], len(transcript)]
    items = [transcript[a:b].strip() for a, b in zip(starts, ends, strict=True)]
    refs = sections["Important References"]
    last_user = ""
    for item in items:
        if item.startswith("User:"):
            last_user = _one_line(item[5:])
            sections["User Goal"].append(f"- {last_user}")
        elif item.startswith("Assistant called tool "):
            call = item[len("Assistant called tool ") :]
            sections["Decisions Made"].append(f"- called {_one_line(call, 160)}")
            refs += [f"- {r}" for r in _IDENT.findall(call)]
        elif item.startswith("Assistant:"):
            sections["Confirmed Facts"].append(f"- {_one_line(item[10:])}")
            refs += [f"- {r}" for r in _IDENT.findall(item)]
    if last_user:
        sections["Pending Actions"] = [f"- answer the latest request: {last_user}"]
    sections["Important References"] = list(dict.fromkeys(refs))
    return "<summary>\n" + _fit(sections, max_chars) + "\n</summary>"


def riding_part(messages: Sequence[Mapping[str, Any]]) -> int | None:
    """K when the last message is a riding instruction naming messages 1 to K, else None."""
    if len(messages) < 2 or messages[-1].get("role") != "user":
        return None
    text = content_text(messages[-1].get("content"))
    found = _RIDING_PART.search(text) if "The conversation above is data" in text else None
    return int(found.group(1)) if found else None


def riding_summary(messages: Sequence[Mapping[str, Any]], count: int) -> str:
    """`extractive_summary` of a riding call: its first `count` messages as the history (the
    instructions left out), the summary they show as the existing one."""
    shown = messages[:count]
    existing, history = "", []
    for m in shown:
        text = content_text(m.get("content"))
        if FRAME_OPEN in text and FRAME_CLOSE in text:
            existing = text.split(FRAME_OPEN, 1)[1].rsplit(FRAME_CLOSE, 1)[0].strip()
        elif m.get("role") not in ("system", "developer"):
            history.append(m)
    instruction = content_text(messages[-1].get("content"))
    prompt = (
        f"<existing_summary>\n{existing}\n</existing_summary>\n"
        f"<conversation_history>\n{render_transcript(history)}\n</conversation_history>\n"
        f"{instruction}"
    )
    return extractive_summary([{"role": "user", "content": prompt}])


def _fit(sections: dict[str, list[str]], max_chars: int) -> str:
    """Render, dropping the oldest line of the longest section until it fits."""

    def render() -> str:
        return "\n".join(
            f"## {name}\n" + ("\n".join(sections[name]) or "None") for name in SECTIONS
        )

    text = render()
    while len(text) > max_chars:
        longest = max(SECTIONS, key=lambda s: sum(len(x) for x in sections[s]))
        if not sections[longest]:
            return text[:max_chars]
        del sections[longest][0]
        text = render()
    return text


class ReplayUpstream(FakeUpstream):
    """The app's state: the current session's answers and the log since the last read."""

    def __init__(self, summarizer_url: str = "", summarizer_model: str = "") -> None:
        super().__init__(
            record=False,
            timing_header=FAKE_MS_HEADER,
            routes=[
                Route("/_replay/session", self.session, methods=["POST"]),
                Route("/_replay/log", self.log),
                Route("/v1/responses", self.responses, methods=["POST"]),
                Route("/v1/messages", self.messages, methods=["POST"]),
            ],
        )
        self.counter = TokenCounter()
        self.answers: dict[int, dict[str, Any]] = {}
        self.by_last: dict[str, list[int]] = {}
        self.records: list[dict[str, Any]] = []
        self.summarizer_url = summarizer_url.rstrip("/")
        self.summarizer_model = summarizer_model
        # The message keys of the last chat requests (newest last): what a cache holds.
        self.recent: list[list[str]] = []

    async def session(self, request: Request) -> Response:
        data = await request.json()
        self.answers = {int(a["step"]): a["message"] for a in data["answers"]}
        self.by_last = {}
        for a in data["answers"]:
            self.by_last.setdefault(a["last"], []).append(int(a["step"]))
        self.records = []
        self.recent = []
        return JSONResponse({"steps": len(self.answers)})

    async def log(self, request: Request) -> Response:
        records, self.records = self.records, []
        return JSONResponse({"records": records})

    def _step(self, headers: Mapping[str, str], messages: list[Any]) -> int | None:
        header = headers.get(STEP_HEADER)
        if header is not None and header.isdigit() and int(header) in self.answers:
            return int(header)
        # A proxy that drops our header: the first unanswered step ending with this message.
        if not messages:
            return None
        candidates = self.by_last.get(message_key(messages[-1]), [])
        return candidates.pop(0) if candidates else None

    async def responses(self, request: Request) -> Response:
        """A Responses call: the recorded answer of its step, the input logged in chat form."""
        start = time.perf_counter()
        rec = await self._record(request)
        body = rec.json
        messages = responses_shape.to_chat(body.get("instructions"), body.get("input"))
        if rec.purpose == "summarize":  # a cache-riding call, in the Responses API
            chat = {
                "model": body.get("model"),
                "messages": messages,
                "max_tokens": body.get("max_output_tokens"),
            }
            text = await self._summary_text(chat, messages)
            answer = {"role": "assistant", "content": text}
            return JSONResponse(responses_shape.response(str(body.get("model")), answer))
        step = self._step(rec.headers, messages)
        if step is None:
            error = {"message": "no recorded step matches", "type": "invalid_request_error"}
            return JSONResponse({"error": error}, status_code=400)
        self.records.append(
            {"kind": "chat", "step": step, "messages": messages, "problems": input_problems(body)}
        )
        self._remember(messages)
        answer = responses_shape.response(str(body.get("model")), self.answers[step])
        fake_ms = f"{(time.perf_counter() - start) * 1000:.3f}"
        return JSONResponse(answer, headers={FAKE_MS_HEADER: fake_ms})

    async def messages(self, request: Request) -> Response:
        """A Messages call: the recorded answer of its step, the request logged in chat form
        (block by block, `messages_shape.to_chat`); a summarizer call's answer in its shape."""
        start = time.perf_counter()
        rec = await self._record(request)
        body = rec.json
        if rec.purpose == "summarize":
            # In chat form (block by block), as the chat requests are remembered: a riding
            # call's leading messages are then compared with the request it rides on.
            prompt = messages_shape.to_chat(body.get("system"), body["messages"])
            # As a chat call: what a relay to a real (chat) model sends.
            chat = {
                "model": body.get("model"),
                "messages": prompt,
                "max_tokens": body.get("max_tokens"),
            }
            answer = {"role": "assistant", "content": await self._summary_text(chat, prompt)}
            return JSONResponse(messages_shape.response(str(body.get("model")), answer))
        messages = messages_shape.to_chat(body.get("system"), body.get("messages"))
        step = self._step(rec.headers, messages)
        if step is None:
            error = {"type": "invalid_request_error", "message": "no recorded step matches"}
            return JSONResponse({"type": "error", "error": error}, status_code=400)
        problems = request_problems(body, strict=False)
        self.records.append(
            {"kind": "chat", "step": step, "messages": messages, "problems": problems}
        )
        self._remember(messages)
        answer = messages_shape.response(str(body.get("model")), self.answers[step])
        fake_ms = f"{(time.perf_counter() - start) * 1000:.3f}"
        return JSONResponse(answer, headers={FAKE_MS_HEADER: fake_ms})

    def reply_to(self, request: Recorded, body: dict[str, Any]) -> ReplyOrAwaitable:
        messages = body.get("messages") or []
        step = None if request.purpose == "summarize" else self._step(request.headers, messages)
        if step is None:
            return self._summarize(body, messages)
        self.records.append({"kind": "chat", "step": step, "messages": messages})
        self._remember(messages)
        message = self.answers[step]
        return Reply(
            content=message.get("content"),
            tool_calls=message.get("tool_calls"),
            finish_reason=_finish(message),
            usage={"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0},
        )

    def _remember(self, messages: list[Any]) -> None:
        """Keep a chat request's message keys (in chat form): what a prefix cache holds."""
        self.recent = [*self.recent[-(RECENT_REQUESTS - 1) :], [message_key(m) for m in messages]]

    async def _summary_text(self, chat: dict[str, Any], prompt: list[Any]) -> str:
        """The summary text of a summarizer call made in another API than chat (`chat`: it
        as a chat call, `prompt` its messages in chat form)."""
        reply = await self._summarize(chat, prompt)
        if reply.raw is not None:  # relayed to a real (chat) model
            return str(json.loads(reply.raw)["choices"][0]["message"]["content"] or "")
        return reply.content or ""

    def _cached(self, messages: list[Any], model: Any) -> int:
        """The tokens of the longest run of `messages`' leading messages that one of the
        recent chat requests began with: what a provider's prefix cache would serve."""
        keys = [message_key(m) for m in messages]
        best = 0
        for earlier in self.recent:
            n = 0
            while n < min(len(keys), len(earlier)) and keys[n] == earlier[n]:
                n += 1
            best = max(best, n)
        if not best:
            return 0
        # The reply's priming is counted once, in the whole; not part of the prefix.
        whole = self.counter.count_messages(messages, model)
        rest = self.counter.count_messages(messages[best:], model) if best < len(messages) else 0
        return whole - rest if best < len(messages) else whole

    async def _summarize(self, body: dict[str, Any], messages: list[Any]) -> Reply:
        model = body.get("model")
        count = riding_part(messages)
        cached = self._cached(messages, model)
        if self.summarizer_url:
            return await self._relay(body, model, riding=count is not None, cached=cached)
        text = riding_summary(messages, count) if count else extractive_summary(messages)
        usage = {
            "prompt_tokens": self.counter.count_messages(messages, model),
            "completion_tokens": self.counter.count_text(text, model),
        }
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        self.records.append(
            {
                "kind": "summarize",
                "status": 200,
                "input": usage["prompt_tokens"],
                "output": usage["completion_tokens"],
                "cached": cached,
                "riding": count is not None,
            }
        )
        return Reply(content=text, usage=usage)

    async def _relay(
        self, body: dict[str, Any], model: str | None, *, riding: bool = False, cached: int = 0
    ) -> Reply:
        """A summarizer call relayed to the real model, its answer returned as it came."""
        relayed = dict(body, model=self.summarizer_model or model)
        key = os.environ.get(SUMMARIZER_KEY_ENV, "")
        headers = {"authorization": f"Bearer {key}"} if key else {}
        async with httpx.AsyncClient(timeout=300, trust_env=False) as client:
            response = await client.post(
                self.summarizer_url + "/chat/completions", json=relayed, headers=headers
            )
        try:
            usage = response.json().get("usage") or {}
        except ValueError:
            usage = {}
        self.records.append(
            {
                "kind": "summarize",
                "status": response.status_code,
                "input": int(usage.get("prompt_tokens") or 0),
                "output": int(usage.get("completion_tokens") or 0),
                "cached": cached,
                "riding": riding,
            }
        )
        content_type = response.headers.get("content-type", "application/json")
        return Reply(
            raw=response.content,
            status=response.status_code,
            headers={"content-type": content_type},
        )


def _finish(message: Mapping[str, Any]) -> str:
    return "tool_calls" if message.get("tool_calls") else "stop"


# -- the harness's side ------------------------------------------------------------------------


def request(api: str, session: Session, i: int) -> tuple[dict[str, Any], Callable[[Any], Any]]:
    """The body of step `i` in `api`'s shape, and how to read the assistant message from its
    answer's JSON."""
    history = session.messages[:i]
    if api == "responses":
        body = responses_shape.request_body(session.model, history, stream=False, store=False)
        return body, responses_shape.answer_message
    if api == "messages":
        return messages_shape.request_body(session.model, history), messages_shape.answer_message
    body = {"model": session.model, "messages": history, "stream": False}
    return body, lambda answer: answer["choices"][0]["message"]


def replay_session(
    client: httpx.Client,
    url: str,
    fake: str,
    session: Session,
    conversation: str,
    api: str = "chat",
) -> Run:
    """Every step of `session` through the proxy at `url` (a chat completions URL, or with
    `api` "responses" a /v1/responses URL)."""
    messages = session.messages
    answers = [
        {"step": i, "last": message_key(messages[i - 1]), "message": messages[i]}
        for i in session.steps
    ]
    client.post(fake + "/_replay/session", json={"answers": answers}).raise_for_status()
    timing: dict[int, tuple[float, float | None, int]] = {}
    for i in session.steps:
        body, read = request(api, session, i)
        headers = {"x-conversation-id": conversation, STEP_HEADER: str(i)}
        start = time.perf_counter()
        response = client.post(url, content=json.dumps(body, ensure_ascii=False), headers=headers)
        wall = (time.perf_counter() - start) * 1000
        if response.status_code != 200:
            raise BenchError(f"{session.id} step {i}: status {response.status_code}")
        answer = read(response.json())
        recorded = messages[i].get("tool_calls")
        same = (
            messages_shape.same_calls(answer.get("tool_calls"), recorded)
            if api == "messages"
            else answer.get("tool_calls") == recorded
        )
        if not same:
            raise BenchError(f"{session.id} step {i}: the answer is not the recorded one")
        fake_ms = float(response.headers.get(FAKE_MS_HEADER, "0"))
        overhead = response.headers.get("x-recap-overhead-ms")
        dropped = int(response.headers.get("x-recap-dropped-messages", "0"))
        timing[i] = (wall - fake_ms, float(overhead) if overhead else None, dropped)
    records = client.get(fake + "/_replay/log").json()["records"]
    # Summarizer calls come before the chat call of the step that made them.
    steps: list[Step] = []
    pending: list[dict[str, Any]] = []
    for rec in records:
        if rec["kind"] == "summarize":
            pending.append(rec)
            continue
        added, overhead, dropped = timing[rec["step"]]
        steps.append(
            Step(
                rec["step"],
                rec["messages"],
                added_ms=added,
                overhead_ms=overhead,
                summarizer_calls=len(pending),
                summarizer_in=sum(r["input"] for r in pending),
                summarizer_out=sum(r["output"] for r in pending),
                summarizer_cached=sum(r.get("cached", 0) for r in pending),
                riding_calls=sum(1 for r in pending if r.get("riding")),
                dropped=dropped,
                problems=rec.get("problems", ()),
            )
        )
        pending = []
    if pending and steps:  # a peer that summarises after answering: charge the last step
        steps[-1].summarizer_calls += len(pending)
        steps[-1].summarizer_in += sum(r["input"] for r in pending)
        steps[-1].summarizer_out += sum(r["output"] for r in pending)
        steps[-1].summarizer_cached += sum(r.get("cached", 0) for r in pending)
        steps[-1].riding_calls += sum(1 for r in pending if r.get("riding"))
    if [s.index for s in steps] != session.steps:
        raise BenchError(f"{session.id}: the fake saw steps out of order or missing")
    return Run(session, steps)
