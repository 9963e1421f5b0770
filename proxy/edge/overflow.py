"""Overflow recovery: the upstream said the prompt is too long; compact harder, retry once.

Sits between the upstream's answer and the client (compacting.py). When the upstream answers a
chat request 400 (or 413) with a context-length error and nothing of its answer has
reached the client, the request is planned again from the client's own messages with
`control = "force"` (session and loop summaries fold everything they can) and a tighter
window (the last-resort fit budgets below it), and sent once more; the client gets the
retry's answer, the `x-recap-overflow-retry` response header and the log line say so. A
second overflow is relayed as the upstream sent it.

Recognised errors (the texts the providers document or send):
  OpenAI       code "context_length_exceeded"; "This model's maximum context length is N
               tokens. However, your messages resulted in M tokens" / "you requested M
               tokens (P in the messages, C in the completion)"
  DeepSeek     the same message, code "invalid_request_error"
  vLLM         the same message; newer releases "This model's maximum context length is N
               tokens and your request has M input tokens"
  Qwen         DashScope "<400> InternalError.Algo.InvalidParameter: Range of input length
               should be [1, N]"
  SGLang       "Input length (M tokens) exceeds the maximum allowed length (N tokens)"
  others       "prompt is too long: M tokens > N maximum", "input length and `max_tokens`
               exceed context limit: M + C > N"
The limit N and the prompt's size M, where stated, calibrate the budget (`Calibration`) and
size the retry's window; where not, the retry's window is `FALLBACK_SHRINK` of the last one.

Pure except `retry_exchange`, which only builds a new Exchange; compacting.py does the IO.
"""

from __future__ import annotations

import dataclasses
import json
import re
import zlib
from dataclasses import dataclass
from typing import Any

from proxy.pipeline import Exchange
from proxy.upstream.error_answer import MAX_ERROR_BYTES

RETRY_HEADER = "x-recap-overflow-retry"
# Share of the stated limit the retry budgets for (room for the upstream's own framing).
RETRY_MARGIN = 0.9
FALLBACK_SHRINK = 0.7

_LIMIT_PATTERNS = [
    re.compile(r"maximum context length is (\d+) tokens", re.I),
    re.compile(r"range of input length should be \[\d+,\s*(\d+)\]", re.I),
    re.compile(r"exceeds the maximum allowed length \((\d+) tokens\)", re.I),
    re.compile(r"tokens > (\d+) maximum", re.I),
    re.compile(r"exceed context limit: \d+ \+ \d+ > (\d+)", re.I),
]
_PROMPT_PATTERNS = [
    re.compile(r"(\d+) in the messages", re.I),
    re.compile(r"your messages resulted in (\d+) tokens", re.I),
    re.compile(r"your request has (\d+) input tokens", re.I),
    re.compile(r"input length \((\d+) tokens\)", re.I),
    re.compile(r"prompt is too long: (\d+) tokens", re.I),
    re.compile(r"exceed context limit: (\d+) \+", re.I),
]
_MARKERS = re.compile(
    r"context_length_exceeded|maximum context length|range of input length should be"
    r"|exceeds the maximum allowed length|prompt is too long|exceed context limit"
    r"|context window|too many tokens",
    re.I,
)
# vLLM's "max_tokens is too large" names the context length too, but a shorter history
# only helps when the input is what is too long; compaction still frees room for the output.


@dataclass(frozen=True)
class Overflow:
    """What the upstream said: its limit and its count of the prompt, where it said them."""

    message: str
    limit: int | None = None
    prompt_tokens: int | None = None


def detect(status: int, body: bytes, encoding: str = "") -> Overflow | None:
    """The overflow an upstream error body reports, or None if it is another error."""
    if status not in (400, 413):
        return None
    text = _decoded(body, encoding)
    if text is None:
        return None
    message = text
    code = ""
    try:
        parsed: Any = json.loads(text)
    except ValueError:
        parsed = None
    if isinstance(parsed, dict):
        error = parsed.get("error", parsed)
        if isinstance(error, dict):
            message = str(error.get("message") or "")
            code = str(error.get("code") or "")
        elif isinstance(error, str):
            message = error
    if code != "context_length_exceeded" and not _MARKERS.search(message):
        return None
    return Overflow(
        message[:500], _first(_LIMIT_PATTERNS, message), _first(_PROMPT_PATTERNS, message)
    )


def retry_window(overflow: Overflow, estimate: int, window: int) -> int:
    """The window (in Recap's tokens) the retry budgets with: under what the upstream
    stated, scaled by its count of the prompt against Recap's, or a fixed share less."""
    shrunk = int(window * FALLBACK_SHRINK)
    if overflow.limit is None:
        return max(1, shrunk)
    ratio = 1.0
    if overflow.prompt_tokens and estimate > 0:
        ratio = max(1.0, overflow.prompt_tokens / estimate)
    stated = int(overflow.limit * RETRY_MARGIN / ratio)
    # An upstream that overflowed on a window it says is larger: Recap's estimate is off
    # by more than the stated counts show, so shrink anyway.
    return max(1, stated if stated < window else shrunk)


def retry_exchange(ex: Exchange, window: int) -> Exchange:
    """The same request planned again from the client's messages, forced, on `window`.

    Everything a stage wrote is reset; what is kept is what does not depend on the plan:
    the request, its identity and measure (fingerprints and counts), its record and the
    response headers already decided (the retry's stages overwrite theirs).
    """
    fresh = dataclasses.replace(
        ex,
        messages=list(ex.original),
        control="force",
        context_window=window,
        outcomes=[],
        summary_index=None,
        loop_summary_index=None,
        trimmed=[],
        identify=None,
        unarchived=None,
        archive_now=None,
        archive_failed=False,
    )
    fresh.original = ex.original
    fresh.messages = list(ex.original)
    for key in ("x-recap-compaction", "x-recap-tokens-before", "x-recap-tokens-after"):
        fresh.response_headers.pop(key, None)
    fresh.response_headers[RETRY_HEADER] = "1"
    fresh.record.input_tokens = fresh.record.tokens_before = None
    return fresh


def _first(patterns: list[re.Pattern[str]], text: str) -> int | None:
    for pattern in patterns:
        m = pattern.search(text)
        if m:
            return int(m.group(1))
    return None


def _decoded(body: bytes, encoding: str) -> str | None:
    encoding = encoding.strip().lower()
    try:
        if encoding in ("gzip", "deflate"):
            # wbits 47: gzip or zlib header, detected; bounded, error bodies are small.
            body = zlib.decompressobj(wbits=47).decompress(body, MAX_ERROR_BYTES)
        elif encoding not in ("", "identity"):
            return None
        return body.decode("utf-8", "replace")
    except zlib.error:
        return None
