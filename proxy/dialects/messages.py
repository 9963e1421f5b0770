"""The Anthropic Messages API (`POST /v1/messages`): its content blocks <-> neutral messages.

parse maps each message of `messages` onto the neutral view the planners read, keeping
the blocks each neutral message stands for under `recap_blocks` (so its fingerprint is
that of the blocks, and the archive keeps them whole):

    system (text or blocks)             -> a pinned system message, rendered where it is
    user message, text                  -> a user message
    user message, blocks                -> per run: each `tool_result` a `tool` result
                                           naming its `tool_use_id`; the other blocks
                                           (text, image, document, ...) one user message
    assistant message                   -> one assistant message: its text, its `tool_use`
                                           blocks as `tool_calls`; thinking, redacted
                                           thinking and server tool blocks ride along

so a thinking block never leaves its turn's assistant message (it is dropped only with
it, as the API allows for earlier turns), a call never leaves its result (the planners'
rounds), and the turn rules hold: a user message with text starts a turn, one holding
only tool results continues the loop.

render writes the neutral messages back as messages of the API. Pieces of one message
left unchanged come back as the very message the client sent; a rewritten piece (a
trimmed result, an attachment placeholder, a shortened old answer) keeps its blocks'
other fields, `cache_control` included; pieces of the same role that a rewrite made
adjacent are merged into one message (the roles alternate), and messages the client
itself sent adjacent stay as they were. A summary Recap made goes where
docs/compaction.md says: a new system message (`summary_role: system`) before the
history becomes a text block after the client's `system` blocks; any other (a user
summary, a loop working summary) is a text block merged into the user message it
borders. No `cache_control` marker is ever added or moved: those on the client's
tools, system and the messages Recap keeps are forwarded where they were.

Pure: no IO here (tests/test_layers.py).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from proxy.dialects.base import Parsed, PassReason, SummaryCall, Unparsed
from proxy.dialects.chat import parse_json, write_json
from proxy.dialects.messages_answer import (
    ANTHROPIC_ERRORS,
    BLOCKS,
    MESSAGES_SUMMARY,
    MessagesRecorder,
    error_event,
)
from proxy.errors import ErrorShape
from proxy.history.messages import PINNED_ROLES, Message

_ROLES = frozenset({"user", "assistant"})
# Anthropic's own cap on cache breakpoints in one request.
MAX_BREAKPOINTS = 4


def text_block(text: str) -> dict[str, Any]:
    return {"type": "text", "text": text}


def neutral_part(block: Any, sources: dict[int, list[Any]]) -> Any:
    """A content block as chat writes a part (text, image_url, file), for counting and
    trimming; the block itself is remembered, so an unchanged part renders as it came."""
    if not isinstance(block, Mapping):
        return block
    kind, source = block.get("type"), block.get("source")
    out: dict[str, Any]
    if kind == "text" and isinstance(block.get("text"), str):
        out = {"type": "text", "text": block["text"]}
    elif kind in ("image", "document") and isinstance(source, Mapping):
        url = ""
        if source.get("type") == "base64" and isinstance(source.get("data"), str):
            url = f"data:{source.get('media_type')};base64,{source['data']}"
        elif source.get("type") == "url" and isinstance(source.get("url"), str):
            url = source["url"]
        elif kind == "document" and source.get("type") == "text":
            return block  # plain text: weighed as written, never an attachment
        if kind == "image":
            out = {"type": "image_url", "image_url": {"url": url}}
        else:
            out = {"type": "file", "file": {"file_data": url} if url else {"file_id": "?"}}
    else:
        return block
    sources[id(out)] = [block]
    return out


def _parts(content: Any, sources: dict[int, list[Any]]) -> Any:
    if isinstance(content, list):
        return [neutral_part(b, sources) for b in content]
    return "" if content is None else content


def _arguments(value: Any) -> str:
    return json.dumps(value if value is not None else {}, ensure_ascii=False)


def _assistant(blocks: list[Any], sources: dict[int, list[Any]]) -> dict[str, Any]:
    # One pass over the blocks (parse has checked each is an object).
    texts = []
    calls = []
    for b in blocks:
        kind = b.get("type")
        if kind == "text":
            text = b.get("text")
            if isinstance(text, str):
                texts.append(text)
        elif kind == "tool_use":
            name, call_id = b.get("name"), b.get("id")
            call = {
                "id": call_id if isinstance(call_id, str) else "",
                "type": "function",
                "function": {
                    "name": name if isinstance(name, str) else "",
                    "arguments": _arguments(b.get("input")),
                },
            }
            sources[id(call)] = [b]
            calls.append(call)
    m: dict[str, Any] = {"role": "assistant", "content": "\n\n".join(texts) if texts else None}
    if calls:
        m["tool_calls"] = calls
    elif not texts:
        m["content"] = ""  # thinking or server tools only: an answer all the same
    m[BLOCKS] = blocks
    return m


def split(i: int, message: Mapping[str, Any], sources: dict[int, list[Any]]) -> list[Message]:
    """The neutral messages of the client's message `i`, each remembering where it came from
    (`sources`: by the neutral message, and by its block list, which a rewritten copy keeps)."""
    role, content = message["role"], message["content"]
    if isinstance(content, str):
        plain = {"role": role, "content": content}
        sources[id(plain)] = [i, 0, None]
        return [plain]
    if role == "assistant":
        answer = _assistant(content, sources)
        sources[id(answer)] = sources[id(answer[BLOCKS])] = [i, 0, len(content)]
        return [answer]
    out: list[Message] = []
    at = 0
    for is_result, blocks in _runs(content):
        if is_result:
            for n, b in enumerate(blocks):
                call_id = b.get("tool_use_id")
                own = [b]
                made = {
                    "role": "tool",
                    "tool_call_id": call_id if isinstance(call_id, str) else "",
                    "content": _parts(b.get("content"), sources),
                    BLOCKS: own,
                }
                sources[id(made)] = sources[id(own)] = [i, at + n, at + n + 1]
                out.append(made)
        else:
            made = {"role": "user", "content": _parts(blocks, sources), BLOCKS: blocks}
            sources[id(made)] = sources[id(blocks)] = [i, at, at + len(blocks)]
            out.append(made)
        at += len(blocks)
    return out


def _runs(content: list[Any]) -> Iterator[tuple[bool, list[Any]]]:
    """The blocks of a user message in runs: (whether they are `tool_result`s, the run)."""
    run: list[Any] = []
    results = False
    for b in content:
        is_result = b.get("type") == "tool_result"
        if run and is_result != results:
            yield results, run
            run = []
        results = is_result
        run.append(b)
    if run:
        yield results, run


def _kind(block: Any) -> Any:
    return block.get("type") if isinstance(block, Mapping) else None


def _problem(body: Mapping[str, Any]) -> Unparsed | None:
    messages = body.get("messages")
    if not isinstance(messages, list):
        return Unparsed(PassReason.NO_HISTORY, "messages missing or not a list")
    for n, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in _ROLES:
            return Unparsed(PassReason.BAD_ITEM, f"message {n} is not a user or assistant message")
        content = m.get("content")
        if isinstance(content, list):
            blocks_ok = all(isinstance(b, dict) for b in content)
        else:
            blocks_ok = isinstance(content, str)
        if not blocks_ok:
            return Unparsed(PassReason.BAD_ITEM, f"message {n} content is neither text nor blocks")
    system = body.get("system")
    if system is not None and not (
        isinstance(system, str)
        or (isinstance(system, list) and all(isinstance(b, dict) for b in system))
    ):
        return Unparsed(PassReason.BAD_ITEM, "system is neither text nor a list of blocks")
    return None


def key_fields(body: Mapping[str, Any]) -> list[tuple[str, Any]]:
    """`metadata.user_id`; when it is a JSON object naming a `session_id` (Claude Code's),
    that session first: the user id alone is shared by all of a user's sessions."""
    metadata = body.get("metadata")
    user_id = metadata.get("user_id") if isinstance(metadata, Mapping) else None
    out: list[tuple[str, Any]] = []
    if isinstance(user_id, str) and user_id.startswith("{"):
        try:
            inner = json.loads(user_id)
        except ValueError:
            inner = None
        if isinstance(inner, dict) and isinstance(inner.get("session_id"), str):
            out.append(("metadata.user_id.session_id", inner["session_id"]))
    out.append(("metadata.user_id", user_id))
    return out


def cache_breakpoints(body: Mapping[str, Any]) -> int:
    """The `cache_control` markers of a request: on tools, system and message blocks."""

    def count(value: Any) -> int:
        if isinstance(value, Mapping):
            own = 1 if isinstance(value.get("cache_control"), Mapping) else 0
            return own + sum(count(v) for k, v in value.items() if k != "cache_control")
        if isinstance(value, list):
            return sum(count(v) for v in value)
        return 0

    return sum(count(body.get(key)) for key in ("tools", "system", "messages"))


class MessagesDialect:
    name = "messages"
    history_key = "messages"
    output_limit_keys: tuple[str, ...] = ("max_tokens",)
    errors: ErrorShape = ANTHROPIC_ERRORS
    summary_call: SummaryCall = MESSAGES_SUMMARY
    # Claude Code and the SDKs send an API key as `x-api-key`; a token as a Bearer.
    credential_headers: tuple[str, ...] = ("x-api-key", "authorization")
    stream_end = b"event: message_stop"

    def parse(self, raw: bytes) -> Parsed | Unparsed:
        loaded = parse_json(raw)
        if isinstance(loaded, Unparsed):
            return loaded
        body, kept = loaded
        problem = _problem(body)
        if problem is not None:
            return problem
        sources: dict[int, list[Any]] = {}
        view: list[Message] = []
        system = body.get("system")
        if system:
            pinned = {"role": "system", "content": _parts(system, sources)}
            sources[id(pinned)] = []  # rendered where it is: in `system`
            view.append(pinned)
        for i, m in enumerate(body["messages"]):
            view += split(i, m, sources)
        return Parsed(body, view, kept, sources)

    def render(self, parsed: Parsed, messages: Sequence[Message]) -> bytes:
        out = dict(parsed.body)
        system, history = rendered(parsed, messages)
        if system:
            was = out.get("system")
            blocks = [text_block(was)] if isinstance(was, str) and was else list(was or [])
            out["system"] = blocks + system
        out["messages"] = history
        return write_json(out, parsed.kept_numbers)

    def key_fields(self, body: Mapping[str, Any]) -> list[tuple[str, Any]]:
        return key_fields(body)

    def recorder(self, streamed: bool, encoding: str) -> MessagesRecorder:
        return MessagesRecorder(streamed=streamed, encoding=encoding)

    def error_event(self, body: bytes, status: int) -> bytes:
        return error_event(body, status)


# One stretch of a message to be: its role, its blocks (None: the client's own, unchanged),
# and where in the client's messages it came from (None: a message Recap made).
_Piece = tuple[str, list[Any] | None, list[Any] | None]


def rendered(parsed: Parsed, messages: Sequence[Message]) -> tuple[list[Any], list[Any]]:
    """The new system blocks, and the `messages` of the body for this neutral view."""
    sources, original = parsed.sources, parsed.body["messages"]
    system: list[Any] = []
    pieces: list[_Piece] = []
    for m in messages:
        role = m.get("role")
        at = sources.get(id(m))
        if at == []:
            continue  # the client's system, where it is
        if at is not None:
            pieces.append((_api_role(role), None, at))
        elif role in PINNED_ROLES and not pieces:
            system.append(text_block(_text(m.get("content"))))
        else:
            origin = sources.get(id(m.get(BLOCKS)))
            pieces.append((_api_role(role), _blocks(m, sources), origin))
    out: list[Any] = []
    for group in _groups(pieces):
        whole = _whole(group, original)
        if whole is not None:
            out.append(whole)
            continue
        blocks: list[Any] = []
        for _, made, at in group:
            blocks += made if made is not None else _original_blocks(original, at)
        out.append({"role": group[0][0], "content": blocks})
    return system, out


def _groups(pieces: list[_Piece]) -> Iterator[list[_Piece]]:
    """Pieces per message: a new message at a change of role, and between two messages the
    client itself sent one after the other (merged only where a rewrite made them adjacent)."""
    group: list[_Piece] = []
    for piece in pieces:
        if group and (piece[0] != group[-1][0] or _apart(group[-1][2], piece[2])):
            yield group
            group = []
        group.append(piece)
    if group:
        yield group


def _apart(before: list[Any] | None, after: list[Any] | None) -> bool:
    return before is not None and after is not None and after[0] == before[0] + 1


def _whole(group: list[_Piece], original: list[Any]) -> Any:
    """The client's very message when `group` is all of it, unchanged; else None."""
    spans = [at for _, made, at in group if made is None and at is not None]
    if len(spans) != len(group) or len({at[0] for at in spans}) != 1:
        return None
    message = original[spans[0][0]]
    content = message["content"]
    covered = [(at[1], at[2]) for at in spans]
    if isinstance(content, str):
        return message if covered == [(0, None)] else None
    bounds = [0, *(b for _, b in covered)]
    starts = [0, *(a for a, _ in covered)]
    whole = bounds[:-1] == starts[1:] and bounds[-1] == len(content)
    return message if whole else None


def _original_blocks(original: list[Any], at: list[Any] | None) -> list[Any]:
    assert at is not None
    content = original[at[0]]["content"]
    if isinstance(content, str):
        return [text_block(content)]
    return list(content[at[1] : at[2]])


def _api_role(role: Any) -> str:
    return "assistant" if role == "assistant" else "user"


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(
            p["text"] for p in content if isinstance(p, Mapping) and isinstance(p.get("text"), str)
        )
    return ""


def _blocks(m: Message, sources: Mapping[int, list[Any]]) -> list[Any]:
    """The blocks of a neutral message a stage made or rewrote."""
    role, templates = m.get("role"), m.get(BLOCKS)
    if not isinstance(templates, list):
        # A message Recap made (a summary), or a rewritten one the client sent as text.
        return _content_blocks(m.get("content"), [], sources)
    if role == "tool":
        (result,) = templates
        return [{**result, "content": _tool_content(m.get("content"), result, sources)}]
    if role == "assistant":
        return _assistant_blocks(m, templates, sources)
    return _content_blocks(m.get("content"), templates, sources)


def _content_blocks(
    content: Any, templates: list[Any], sources: Mapping[int, list[Any]]
) -> list[Any]:
    """Parts back to blocks: an unchanged part is its block; a new text part takes the
    place (and the `cache_control`) of the block it replaced."""
    if isinstance(content, str):
        return [text_block(content)]
    out: list[Any] = []
    for n, part in enumerate(content if isinstance(content, list) else []):
        original = sources.get(id(part))
        if original is not None:
            out.append(original[0])
        elif isinstance(part, Mapping) and part.get("type") == "text":
            block = text_block(str(part.get("text", "")))
            template = templates[n] if n < len(templates) else None
            if isinstance(template, Mapping) and "cache_control" in template:
                block["cache_control"] = template["cache_control"]
            out.append(block)
        else:
            out.append(part)
    return out


def _tool_content(content: Any, result: Mapping[str, Any], sources: Mapping[int, list[Any]]) -> Any:
    if isinstance(content, str):
        return content
    was = result.get("content")
    return _content_blocks(content, was if isinstance(was, list) else [], sources)


def _assistant_blocks(
    m: Message, templates: list[Any], sources: Mapping[int, list[Any]]
) -> list[Any]:
    """An answer's blocks with the stage's changes: its text (all of it into the first text
    block) and shortened call arguments; thinking and every other block verbatim."""
    texts = [b["text"] for b in templates if _kind(b) == "text" and isinstance(b.get("text"), str)]
    content = m.get("content")
    changed = isinstance(content, str) and content != "\n\n".join(texts)
    calls = iter(m.get("tool_calls") or [])
    out: list[Any] = []
    wrote = False
    for block in templates:
        kind = _kind(block)
        if kind == "text" and changed:
            if not wrote:
                out.append({**block, "text": content})
                wrote = True
        elif kind == "tool_use":
            call = next(calls, None)
            if call is None or id(call) in sources:
                out.append(block)
            else:
                out.append({**block, "input": _input(call)})
        else:
            out.append(block)
    return out


def _input(call: Any) -> Any:
    function = call.get("function") if isinstance(call, Mapping) else None
    args = function.get("arguments") if isinstance(function, Mapping) else None
    try:
        value = json.loads(args) if isinstance(args, str) else None
    except ValueError:
        value = None
    return value if isinstance(value, dict) else {"recap_shortened": args}
