"""Requests as Codex CLI sends them, for the remote compaction tests (docs/codex.md).

The shapes are those `@openai/codex` 0.171 sent to a recording upstream: the keys of
the body and their values (`stream`, `store`, `include`, `tool_choice`, `reasoning`,
`prompt_cache_key`, `client_metadata`), no `instructions` (the prompt is the first
`developer` message), message items with ids and `internal_chat_message_metadata_passthrough`,
the `compaction_trigger` last, the `session-id`/`thread-id` and `x-codex-*` headers.
Long texts (the ~17k-character prompt, the tool schemas) are shortened; the v1 body of
`/v1/responses/compact` follows `CompactionInput` in codex-rs/codex-api/src/common.rs.
"""

from __future__ import annotations

import json
from typing import Any

SESSION = "01a231c1-2bbb-7f53-9237-0ef3b245fc0d"
MODEL = "gpt-5.1-codex"
PROMPT = "You are a coding agent running in the Codex CLI, a terminal-based coding assistant."

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "name": "exec_command",
        "description": "Runs a command in a PTY, returning output or a session ID.",
        "strict": False,
        "parameters": {
            "type": "object",
            "properties": {"cmd": {"type": "string", "description": "Shell command to execute."}},
            "required": ["cmd"],
            "additionalProperties": False,
        },
    },
    {"type": "web_search", "external_web_access": False},
]


def message(role: str, text: str, n: int, turn: str = "turn-1") -> dict[str, Any]:
    part = "output_text" if role == "assistant" else "input_text"
    item: dict[str, Any] = {
        "type": "message",
        "id": f"msg_{n:04d}",
        "role": role,
        "content": [{"type": part, "text": text}],
    }
    if role == "user":
        item["internal_chat_message_metadata_passthrough"] = {
            "turn_id": turn,
            "create_time": 1796131073.057024,
            "content_item_kinds": ["user.text"],
        }
    return item


# Codex 0.171's environment block, as it sent it (the quoted values are its own).
ENVIRONMENT = (
    "<environment_context>\n  <cwd>/work/project</cwd>\n  <shell>bash</shell>\n"
    "  <current_date>2026-12-02</current_date>\n  <timezone>Etc/UTC</timezone>\n"
    "  <filesystem><workspace_roots><root>/work/project</root></workspace_roots>"
    '<permission_profile type="managed"><file_system type="restricted"><entry '
    'access="read"><special>:root</special></entry></file_system></permission_profile>'
    "</filesystem>\n</environment_context>"
)


def initial_context() -> list[dict[str, Any]]:
    """What Codex puts first in every request: its prompt, skills, the environment."""
    return [
        message("developer", PROMPT, 1),
        message("developer", "<skills_instructions>\n## Skills\n</skills_instructions>", 2),
        message("user", ENVIRONMENT, 3),
    ]


def tool_round(n: int, command: str, output: str) -> list[dict[str, Any]]:
    call = f"call_{n:04d}"
    return [
        {
            "type": "reasoning",
            "id": f"rs_{n:04d}",
            "summary": [],
            "encrypted_content": "gAAAAB" + "r" * 40,
        },
        {
            "type": "function_call",
            "id": f"fc_{n:04d}",
            "name": "exec_command",
            "arguments": json.dumps({"cmd": command}),
            "call_id": call,
        },
        {"type": "function_call_output", "call_id": call, "output": output},
    ]


def history() -> list[dict[str, Any]]:
    """A first turn with tool rounds and an answer (what Codex compacts)."""
    items = [*initial_context(), message("user", "Fix the failing test in src/parser.py", 10)]
    items += tool_round(11, "pytest -q tests/test_parser.py", "FAILED test_parser.py::test_dates")
    items += tool_round(12, "sed -n 1,80p src/parser.py", "def parse_date(text):\n  ...")
    items.append(message("assistant", "The date parser ignored time zones; fixed it.", 13))
    return items


def metadata(kind: str) -> dict[str, Any]:
    turn = {"session_id": SESSION, "request_kind": kind, "model": MODEL}
    if kind == "compaction":
        turn["compaction"] = {
            "trigger": "auto",
            "reason": "context_limit",
            "implementation": "responses_compaction_v2",
            "phase": "pre_turn",
        }
    return turn


def body(items: list[dict[str, Any]], kind: str = "turn") -> dict[str, Any]:
    """A `/v1/responses` body as Codex 0.171 writes it (key order too)."""
    return {
        "model": MODEL,
        "stream": True,
        "input": items,
        "tools": TOOLS,
        "tool_choice": "auto",
        "parallel_tool_calls": True,
        "reasoning": {"summary": "auto"},
        "store": False,
        "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": SESSION,
        "client_metadata": {
            "session_id": SESSION,
            "thread_id": SESSION,
            "x-codex-turn-metadata": json.dumps(metadata(kind)),
        },
    }


def trigger_body(items: list[dict[str, Any]]) -> dict[str, Any]:
    """Compaction v2: the whole history, then the trigger (compact_remote_v2.rs)."""
    return body([*items, {"type": "compaction_trigger"}], "compaction")


def compact_body(items: list[dict[str, Any]]) -> dict[str, Any]:
    """Compaction v1, `POST /v1/responses/compact` (CompactionInput)."""
    return {
        "model": MODEL,
        "input": items,
        "instructions": PROMPT,
        "tools": TOOLS,
        "parallel_tool_calls": True,
        "reasoning": {"summary": "auto"},
        "prompt_cache_key": SESSION,
    }


def after_compaction(compaction: dict[str, Any], new_text: str) -> list[dict[str, Any]]:
    """The next turn's input: context again, the user messages kept, the compaction item,
    the new message (build_v2_compacted_history + process_compacted_history)."""
    kept = message("user", "Fix the failing test in src/parser.py", 10)
    return [*initial_context(), kept, compaction, message("user", new_text, 20, "turn-2")]


def headers(kind: str = "turn", key: str = "sk-test") -> dict[str, str]:
    return {
        "authorization": f"Bearer {key}",
        "session-id": SESSION,
        "thread-id": SESSION,
        "x-client-request-id": SESSION,
        "x-codex-beta-features": "remote_compaction_v2",
        "x-codex-window-id": f"{SESSION}:0",
        "x-codex-turn-metadata": json.dumps(metadata(kind)),
        "originator": "codex_exec",
        "user-agent": "codex_exec/0.171.0 (Debian 12.0.0; x86_64) xterm (codex_exec; 0.171.0)",
        "accept": "text/event-stream",
    }
