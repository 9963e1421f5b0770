"""Claude Code's compaction requests, synthesized with the structure of its own (2.1.332).

Only the fixed strings Recap recognises come from Claude Code's summarization prompt (its
first line, its task sentence, the start of its closing REMINDER paragraph, and the
"Additional Instructions:" a `/compact focus` adds); the text between them is a short
stand-in, not Claude Code's prompt. `auto` sends the prompt as a message of its own after
the last answer; `manual` (and the reactive compaction after a "prompt is too long")
appends it as a text block to the last user message, after its tool results.
"""

from __future__ import annotations

import copy
from typing import Any

from proxy.planning.claude_code import CLOSING, OPENING, TASK
from tests.messages_history import EPHEMERAL

SUMMARY_PROMPT = (
    f"{OPENING}\n\n- Plain text only.\n\n{TASK}, paying close attention to the user's requests."
    "\n\n(The sections the summary should have.)\n\n"
    f"{CLOSING} Respond with plain text only — an <analysis> block followed by a <summary> block."
)
FOCUSED_PROMPT = SUMMARY_PROMPT.replace(
    f"\n\n{CLOSING}", f"\n\nAdditional Instructions:\nfocus on the file name\n\n{CLOSING}"
)
PARTIAL_PROMPT = SUMMARY_PROMPT.replace(
    TASK, "Your task is to create a detailed summary of the RECENT portion of the conversation"
)


def _unmarked(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = copy.deepcopy(messages)
    for m in out:
        for block in m["content"] if isinstance(m["content"], list) else []:
            block.pop("cache_control", None)
    return out


def auto(history: list[dict[str, Any]], prompt: str = SUMMARY_PROMPT) -> list[dict[str, Any]]:
    """The history (ending with an answer), its last block marked, then the prompt."""
    out = _unmarked(history)
    last = out[-1]["content"]
    if isinstance(last, list):
        last[-1]["cache_control"] = EPHEMERAL
    return [*out, {"role": "user", "content": prompt}]


def manual(history: list[dict[str, Any]], prompt: str = SUMMARY_PROMPT) -> list[dict[str, Any]]:
    """The history (ending with tool results), the prompt a text block after them."""
    out = _unmarked(history)
    out[-1]["content"] = [*out[-1]["content"], {"type": "text", "text": prompt}]
    if len(out) > 1 and isinstance(out[-2]["content"], list):
        out[-2]["content"][-1]["cache_control"] = EPHEMERAL
    return out
