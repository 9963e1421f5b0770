"""Which words of a user message the user wrote: what the quality guard may say they said.

Part of the quality guard (`guard.py`), pure. A user message carries more than the
user's own words: what they paste (a CI log, a web page, an email: "here is the log I
copied: ..."), what they quote, code and indented blocks, tool output copied in, the
client's own tagged context (Codex's <environment_context> and <user_instructions>)
and, on Codex, Recap's own summary once a compaction item is expanded. Any of it may
be someone else's text, an attacker's among them, and a summary may travel upstream as
a system message: so only the rest counts as the user's.

`own_text` is the message with all of that cut out. A block (a fenced block, an
indented or `>`-quoted line, a tagged block, a paragraph from a line that looks like
tool output on, everything from a paste's introduction on) becomes a line break, so
the user's sentences around it stay whole; a quote inside a line becomes `POISON`, so
the sentence that holds it is nobody's: the guard restores no sentence that quotes.
A message that holds Recap's frame, or the text Recap frames a summary with, is not
the user's at all. What is cut may still hold references (ids, paths, dates): those
the guard restores as quoted data, attributed to no one.
"""

from __future__ import annotations

import bisect
import re

from proxy.planning.framing import holds_frame

# Stands where a quote was: a sentence holding it is not restored as the user's.
POISON = "\x00"

_FENCE = re.compile(r"^[ \t]*(```|~~~)[^\n]*\n.*?(?:^[ \t]*\1[^\n]*$|\Z)", re.M | re.S)
# A tagged block (<environment_context>...</environment_context>): an opening tag, any
# name, to the first closing tag of that name after it; then a tag left alone.
_OPEN_TAG = re.compile(r"<([A-Za-z][\w:.-]*)(?:\s[^<>]*)?>")
_CLOSE_TAG = re.compile(r"</([A-Za-z][\w:.-]*)\s*>")
_TAG = re.compile(r"</?[A-Za-z][\w:.-]*(?:\s[^<>]*)?/?>")
# Sentence stops end the run an introduction may take, so "I copied the file to /tmp."
# introduces nothing; a colon or the end of its line ends the introduction.
_RUN = r"[^\n:：.!?。！？]"
_PASTE_VERB = r"(?:cop(?:y|ied)|past(?:e|ed)|forward(?:ed)?|got|received|found|saw|grabbed)"
_SOURCE = (
    r"(?:page|site|website|doc|docs|document|readme|wiki|email|e-mail|mail|message|log|"
    r"logs|output|error|ticket|issue|comment|post|article|file|tool|bot|script|terminal|"
    r"console|it|they|he|she)"
)
_SAYS = (
    r"(?:says|said|reads|writes|wrote|shows|showed|printed|prints|returned|returns|"
    r"outputs|replied|states|stated|contains)"
)
_PASTE_INTRO = re.compile(
    # here is the CI log I copied: / this is what I pasted from the console:
    rf"\b(?:here(?:['’]s| is| are)|this is|these are|below is|attached is|that['’]s)\b"
    rf"{_RUN}{{0,80}}?\b{_PASTE_VERB}\b{_RUN}{{0,60}}(?:[:：]|\n)"
    # I copied this from the wiki:
    rf"|\bI(?:['’]ve| have)?\s+(?:just\s+)?{_PASTE_VERB}\b{_RUN}{{0,60}}(?:[:：]|\n)"
    # the page says:
    rf"|\b{_SOURCE}\s+{_SAYS}\s*[:：]"
    # 我复制的日志如下： / 下面是我贴的报错：
    r"|(?:复制|拷贝|粘贴|贴|转发)[^\n。！？]{0,30}(?:[:：]|\n)"
    # 页面上写着：
    r"|(?:页面|网页|网站|文档|邮件|消息|日志|输出|报错|工单|它|他们|他|她)(?:上|里|中)?"
    r"(?:说|写着|写道|显示|提示|返回|输出)\s*[:：]",
    re.IGNORECASE,
)
# The word an introduction turns on (its verb): the introduction is looked for around
# these only, as one pattern with every form tried at every place of a long message was
# the slowest part of the guard. A message with more of them than this is read as
# pasted from there on.
_PASTE_WORD = re.compile(
    rf"\b(?:{_PASTE_VERB}|{_SAYS})\b|复制|拷贝|粘贴|贴|转发|说|写着|写道|显示|提示|返回|输出"
)
_PASTE_WORD_ANY_CASE = re.compile(_PASTE_WORD.pattern, re.IGNORECASE)
_MAX_PASTE_WORDS = 256
# A line that reads as tool output (a log line, a prompt, a stack frame, JSON, a line
# of a transcript): from it to the end of its paragraph is output, not the user's.
_OUTPUT_LINE = re.compile(
    r"^[ \t]*(?:"
    r"\[?\d{4}-\d{2}-\d{2}[T ]\d{1,2}:\d{2}|\[?\d{1,2}:\d{2}:\d{2}"
    r"|\[?(?:ERROR|ERR|WARN|WARNING|INFO|DEBUG|TRACE|FATAL|CRITICAL|NOTICE|PANIC|FAILED|FAIL)\b"
    r"|(?:SYSTEM|ASSISTANT|USER|TOOL|HUMAN|System|Assistant|User|Tool|Human)\s*:"
    r"|Traceback \(most recent call last\)|File \"[^\"\n]+\", line \d"
    r"|[\w.]*(?:Error|Exception)\b:|at [\w$.<>]+ ?\("
    r"|\$ |>>> |PS [A-Z]:\\"
    r"|\{\s*\"|\[\s*[{\[\"]"
    r")[^\n]*(?:\n[ \t]*\S[^\n]*)*",
    re.M,
)
_BLOCK_LINE = re.compile(r"^(?: {4}|\t|[ \t]*>)[^\n]*", re.M)
_QUOTE = re.compile(r"\"[^\"]*\"|“[^”]*”|„[^“”]*[“”]|「[^」]*」|『[^』]*』|«[^»]*»")
_QUOTE_MARK = re.compile(r"[\"“”„「」『』«»]")


def own_text(text: str) -> str:
    """`text` (a user message's) with what the user did not write cut out (see the module
    docstring): what is left is verbatim pieces of it, between line breaks."""
    if holds_frame(text):
        return ""
    text = _cut(text, _matches(_FENCE, text))
    text = _cut(text, _tagged_blocks(text))
    text = _cut(text, _matches(_TAG, text))
    paste = _paste_start(text)
    if paste is not None:
        text = text[:paste] + "\n"
    for pattern in (_OUTPUT_LINE, _BLOCK_LINE, _QUOTE):
        text = _cut(text, _matches(pattern, text))
    return _QUOTE_MARK.sub(POISON, text)  # a quote left open poisons its sentence


def _paste_start(text: str) -> int | None:
    """Where the first paste's introduction starts in `text`, if there is one."""
    # Case-blind matching is several times slower: on a lower-case copy where lowering
    # keeps every character's place (it only ever lengthens), else case-blind.
    lowered = text.lower()
    words = (
        _PASTE_WORD.finditer(lowered)
        if len(lowered) == len(text)
        else _PASTE_WORD_ANY_CASE.finditer(text)
    )
    for n, word in enumerate(words):
        if n == _MAX_PASTE_WORDS:
            return word.start()
        lo, hi = max(0, word.start() - 120), min(len(text), word.end() + 80)
        intro = _PASTE_INTRO.search(text, lo, hi)
        if intro is not None and intro.start() <= word.start() < intro.end():
            return intro.start()
    return None


def _matches(pattern: re.Pattern[str], text: str) -> list[tuple[int, int]]:
    return [m.span() for m in pattern.finditer(text)]


def _tagged_blocks(text: str) -> list[tuple[int, int]]:
    """The spans of tagged blocks, outermost first. Each opening tag is paired with the
    first closing tag of its name after it, found by bisection: a page of unclosed tags
    (<br>, <li>) costs a pass, not a scan to its end per tag."""
    closes: dict[str, list[tuple[int, int]]] = {}
    for m in _CLOSE_TAG.finditer(text):
        closes.setdefault(m.group(1), []).append(m.span())
    spans: list[tuple[int, int]] = []
    for m in _OPEN_TAG.finditer(text):
        ends = closes.get(m.group(1))
        if not ends or (spans and m.start() < spans[-1][1]):
            continue
        k = bisect.bisect_left(ends, (m.end(), 0))
        if k < len(ends):
            spans.append((m.start(), ends[k][1]))
    return spans


def _cut(text: str, spans: list[tuple[int, int]]) -> str:
    """`text` with each span cut: a line break where it fills its lines, POISON where it is
    part of a line (its sentence is then no one's)."""
    if not spans:
        return text
    breaks = [m.start() for m in _NEWLINE.finditer(text)]
    pieces: list[str] = []
    pos = 0
    for start, end in spans:
        k = bisect.bisect_left(breaks, start)
        line_start = breaks[k - 1] + 1 if k else 0
        k = bisect.bisect_left(breaks, end)
        line_end = breaks[k] if k < len(breaks) else len(text)
        # Only the few characters beside a span are looked at: a span with more of its line
        # around it than that is part of the line.
        whole = (
            start - line_start <= _BESIDE
            and line_end - end <= _BESIDE
            and not text[line_start:start].strip()
            and not text[end:line_end].strip()
        )
        pieces += [text[pos:start], "\n" if whole else POISON]
        pos = end
    return "".join(pieces) + text[pos:]


_NEWLINE = re.compile("\n")
_BESIDE = 200
