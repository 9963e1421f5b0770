"""`recap tail`: Recap's JSON log lines, one readable line per request.

At the reading end of the log: the server writes one JSON line per request (`logs.py`, from
the request record of `proxy/record.py`); `recap tail FILE` (or a pipe from any log shipper)
prints each as one short line, with one indented line per compaction under it, and the
server's own text format on a terminal uses the same `render`. Lines give the local time
only; a line of its own gives the date and the zone first and whenever they change
(`Days`). Lines that are not Recap JSON are printed as they are. Everything here is pure
except `tail`, the read loop.

Fields are read defensively: a field that is missing (an older or newer log) is
simply not shown. The field names live in `F` (`tail_fields.py`), so a renamed field
is one edit.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Mapping
from datetime import datetime
from typing import Any, TextIO

from proxy.ops.ansi import Style
from proxy.ops.tail_fields import NOTABLE_SKIPS, WORDS, F, words
from proxy.planning.outcome import Layer

PLAIN = Style()
INDENT = " " * 9 + "\u21b3 "  # under the time column
WHERE_WIDTH = 30
MODEL_WIDTH = 14
TOKENS_WIDTH = 22
LAYERS_WIDTH = 12
# A layer's name where the line is short.
SHORT: dict[str, str] = {Layer.FIT: "fit"}


def local_time(value: Any) -> datetime | None:
    """An ISO-8601 string or epoch seconds as local time; None if neither."""
    try:
        if isinstance(value, str):
            return datetime.fromisoformat(value).astimezone()
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return datetime.fromtimestamp(value).astimezone()
    except (ValueError, OverflowError, OSError):
        pass
    return None


def clock(value: Any) -> str:
    """HH:MM:SS in local time; "--:--:--" for a time that cannot be read."""
    stamp = local_time(value)
    return stamp.strftime("%H:%M:%S") if stamp else "--:--:--"


def day_line(stamp: datetime) -> str:
    """The date and the zone that the lines' times are in: "-- 2026-12-01, times in UTC+01:00
    (CET) --"."""
    offset, name = stamp.strftime("%z"), stamp.tzname()
    zone = f"UTC{offset[:3]}:{offset[3:]}" if offset else "local time"
    if offset == "+0000" and name == "UTC":
        zone = "UTC"
    elif name and name[0] not in "+-":
        zone += f" ({name})"
    return f"-- {stamp:%Y-%m-%d}, times in {zone} --"


class Days:
    """Says the date and the zone before the first line and again when either changes, so
    each line carries the time only (short, aligned) and none is without its date."""

    def __init__(self) -> None:
        self.shown: str | None = None

    def mark(self, record: Mapping[str, Any]) -> str | None:
        stamp = local_time(record.get(F.ts))
        if stamp is None:
            return None
        line = day_line(stamp)
        if line == self.shown:
            return None
        self.shown = line
        return line


def _num(value: Any) -> int | float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return value


def _tokens(n: Any) -> str:
    v = _num(n)
    return "?" if v is None else f"{int(v):,}"


def _ms(value: Any) -> str:
    v = _num(value)
    if v is None:
        return ""
    return f"{v:.1f} ms" if v < 100 else f"{v:,.0f} ms"


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "\u2026"


def _change(before: Any, after: Any) -> str:
    """'9,767 → 3,340 tok −66%', or '3,340 tok' when nothing changed."""
    b, a = _num(before), _num(after)
    if a is None:
        return ""
    if b is None or b == a:
        return f"{_tokens(a)} tok"
    share = f" {round((a - b) * 100 / b):+d}%".replace("-", "\u2212") if b else ""
    return f"{_tokens(b)} \u2192 {_tokens(a)} tok{share}"


def outcomes(f: Mapping[str, Any]) -> list[Mapping[str, Any]] | None:
    """The line's `compactions` list (one object per layer), or None in older logs."""
    found = f.get(F.compactions)
    if not isinstance(found, list):
        return None
    return [c for c in found if isinstance(c, Mapping)]


def layers(f: Mapping[str, Any]) -> list[str]:
    """The layers that changed the history sent on this request: the log's list, the
    `compactions` that compacted or applied a stored summary, or read from older fields."""
    named = f.get(F.layers)
    found = outcomes(f)
    if not isinstance(named, (list, str)) and found is not None:
        out: list[str] = []
        for c in found:
            layer = str(c.get(F.c_layer))
            if c.get(F.c_action) in ("compacted", "applied", "dropped") and layer not in out:
                out.append(layer)
        return out
    if isinstance(named, list):
        return [str(x) for x in named]
    if isinstance(named, str):
        return [x for x in named.split(",") if x]
    out = []
    if f.get(F.session_trigger) and not f.get(F.session_failure) and f.get(F.session_messages):
        out.append(Layer.SESSION)
    if f.get(F.loop_trigger) and not f.get(F.loop_failure):
        out.append(Layer.LOOP)
    if f.get(F.trimmed_results) or f.get(F.shortened_messages):
        out.append(Layer.TRIM)
    if f.get(F.dropped_messages):
        out.append(Layer.FIT)
    return out


def _shaped_by(f: Mapping[str, Any], ran: list[str]) -> str:
    """What shaped the history sent: new work ("session v2", "loop") and what was reused
    ("summary v1", "loop memory"), shortly."""
    parts: list[str] = []
    version = f.get(F.summary_version)
    failed = bool(f.get(F.session_failure) or f.get(F.loop_failure))
    memory = bool(f.get(F.loop_rounds_in_memory))
    found = outcomes(f)
    if found is not None:
        session = [c.get(F.c_version) for c in found if c.get(F.c_layer) == Layer.SESSION]
        version = next((v for v in session if v is not None), version)
        failed = any(c.get(F.c_action) == "failed" for c in found)
        # A stored summary applied, none made: shown as reused, not as new work.
        made = {str(c.get(F.c_layer)) for c in found if c.get(F.c_action) == "compacted"}
        memory = Layer.LOOP in ran and Layer.LOOP not in made
        ran = [x for x in ran if x in made or x not in (Layer.SESSION, Layer.LOOP)]
    if Layer.SESSION in ran:
        parts.append(f"session v{version}" if version is not None else "session")
    elif version is not None:
        parts.append(f"summary v{version}")
    if Layer.LOOP in ran:
        parts.append("loop")
    elif memory:
        parts.append("loop memory")
    parts += [SHORT.get(x, x) for x in ran if x not in (Layer.SESSION, Layer.LOOP)]
    if failed:
        parts.append("FAILED")
    return "+".join(parts)


def _problem(f: Mapping[str, Any], status: int | None) -> str:
    if f.get(F.manual):
        return ""  # its own line says what happened
    if f.get(F.client_disconnected):
        return "client went away"
    if f.get(F.error):
        return words(f[F.error])
    upstream = _num(f.get(F.upstream_status))
    if upstream is not None and upstream >= 400:
        return f"upstream answered {int(upstream)}"
    if status is not None and status >= 400:
        return "error"
    return ""


def request_line(f: Mapping[str, Any], style: Style = PLAIN) -> str:
    """One line for one request: time, status, tenant/conversation, model or path, tokens
    before → after, layers, overhead."""
    status = _num(f.get(F.status))
    code = str(int(status)) if status is not None else "---"
    if status is None or status >= 500:
        code = style.bad(code)
    elif status >= 400:
        code = style.warn(code)
    else:
        code = style.good(code)
    tenant = str(f.get(F.tenant) or "-")
    conversation = f.get(F.conversation)
    where = tenant if conversation is None else f"{tenant}/{conversation}"
    cells = [style.dim(clock(f.get(F.ts))), code, f"{_clip(where, WHERE_WIDTH):<{WHERE_WIDTH}}"]
    path = str(f.get(F.path) or "")
    if f.get(F.model) is not None or F.classification in f or F.passthrough in f:
        # A compacting route's request (it named a model, or was classified or passed on)
        cells.append(f"{_clip(str(f.get(F.model) or '-'), MODEL_WIDTH):<{MODEL_WIDTH}}")
    else:
        cells.append(_clip(f"{f.get(F.method) or ''} {path}".strip(), 48))
    change = _change(f.get(F.tokens_before), f.get(F.tokens_after))
    if change:
        cells.append(f"{change:>{TOKENS_WIDTH}}")
    shaped = _shaped_by(f, layers(f)) or ("-" if change else "")
    if shaped:
        cell = f"{shaped:<{LAYERS_WIDTH}}"
        cells.append(style.note(cell) if "FAILED" not in shaped else style.bad(cell))
    timing = [
        f"overhead {_ms(f.get(F.overhead_ms))}" if _ms(f.get(F.overhead_ms)) else "",
        f"total {_ms(f.get(F.total_ms))}" if _ms(f.get(F.total_ms)) else "",
    ]
    if any(timing):
        cells.append(style.dim(", ".join(t for t in timing if t)))
    if f.get(F.cohort) == "holdout":  # -- holdout: never compacted, by the tenant's share --
        cells.append(style.note("holdout"))
    cached = _cached(f)  # -- cache --
    if cached:
        cells.append(style.dim(cached))
    problem = _problem(f, int(status) if status is not None else None)
    if problem:
        cells.append(style.bad(f"\u2014 {problem}"))
    return " ".join(c for c in cells if c).rstrip()


def _cached(f: Mapping[str, Any]) -> str:
    """The share of the input the upstream's prompt cache served, when its usage said."""
    total, cached = _num(f.get(F.upstream_input_tokens)), _num(f.get(F.cached_input_tokens))
    if not total or cached is None:
        return ""
    return f"cached {int(cached):,} of {int(total):,} ({cached / total:.0%})"


def _layer_tokens(f: Mapping[str, Any], layer: str, before: str, after: str) -> str:
    """This layer's tokens before → after: its own fields, or the request's when it is the
    only layer that changed the history."""
    if f.get(before) is not None:
        return _change(f.get(before), f.get(after))
    # A stored session summary also changes the history a loop compaction works on.
    alone = layers(f) == [layer] and (layer == Layer.SESSION or f.get(F.summary_version) is None)
    return _change(f.get(F.tokens_before), f.get(F.tokens_after)) if alone else ""


def compaction_lines(f: Mapping[str, Any], style: Style = PLAIN) -> list[str]:
    """One indented line per compaction (or failed or notable skipped one) of a request."""
    out: list[str] = []

    def add(layer: str, *parts: str, bad: bool = False) -> None:
        text = f"{layer:<8} " + ", ".join(p for p in parts if p)
        out.append(style.dim(INDENT) + (style.bad(text) if bad else text))

    found = outcomes(f)
    if found is not None:
        for c in found:
            line = outcome_line(c, f)
            if line is not None:
                add(line[0], *line[1], bad=line[2])
        _manual_line(f, add)
        return out

    trigger = f.get(F.session_trigger)
    if f.get(F.session_failure):
        add(
            "session",
            f"FAILED ({words(trigger)})" if trigger else "FAILED",
            words(f[F.session_failure]),
            _ms(f.get(F.session_ms)),
            "sent as it came",
            bad=True,
        )
    elif trigger and f.get(F.session_messages):
        batches = _num(f.get(F.session_batches))
        version = f.get(F.summary_version)
        add(
            "session",
            f"{words(trigger)}: {_tokens(f[F.session_messages])} messages"
            + (f" in {int(batches)} batches" if batches and batches > 1 else "")
            + (f" \u2192 summary v{version}" if version is not None else ""),
            _layer_tokens(f, "session", F.session_tokens_before, F.session_tokens_after),
            _ms(f.get(F.session_ms)),
        )
    elif f.get(F.session_reused):
        add("session", "reused the summary another request had just written")
    elif f.get(F.session_skip) in NOTABLE_SKIPS:
        add("session", f"skipped: {words(f[F.session_skip])}", bad=True)

    loop_trigger = f.get(F.loop_trigger)
    if f.get(F.loop_failure):
        add(
            "loop",
            "FAILED",
            words(f[F.loop_failure]),
            _ms(f.get(F.loop_ms)),
            "sent as it came",
            bad=True,
        )
    elif loop_trigger:
        rounds = _num(f.get(F.loop_rounds))
        memory = _num(f.get(F.loop_rounds_in_memory))
        add(
            "loop",
            f"{words(loop_trigger)}: "
            + (f"{int(rounds)} tool rounds folded" if rounds is not None else "")
            + (f" ({int(memory)} in working memory)" if memory is not None else ""),
            _layer_tokens(f, "loop", F.loop_tokens_before, F.loop_tokens_after),
            _ms(f.get(F.loop_ms)),
        )
    elif f.get(F.loop_skip) in NOTABLE_SKIPS:
        add("loop", f"skipped: {words(f[F.loop_skip])}", bad=True)

    trimmed, shortened = _num(f.get(F.trimmed_results)), _num(f.get(F.shortened_messages))
    if trimmed or shortened:
        chars = _num(f.get(F.trimmed_chars))
        add(
            "trim",
            f"{int(trimmed)} tool results trimmed" if trimmed else "",
            f"{int(shortened)} old messages shortened" if shortened else "",
            f"{int(chars):,} chars saved" if chars else "",
        )
    dropped = _num(f.get(F.dropped_messages))
    if dropped:
        add("fit", f"dropped the {int(dropped)} oldest messages to fit the window")

    _manual_line(f, add)
    return out


def outcome_line(c: Mapping[str, Any], f: Mapping[str, Any]) -> tuple[str, list[str], bool] | None:
    """(layer, parts, bad) for one `compactions` object, or None when it is not worth a
    line: a stored summary applied shows on the request line, an ordinary skip is the
    normal state between compactions (a forced one that skipped says why)."""
    layer, action = str(c.get(F.c_layer)), c.get(F.c_action)
    code = c.get(F.c_trigger)
    trigger = WORDS.get(str(code), words(code)) if code else None  # single-word codes too
    tokens = _change(c.get(F.c_before), c.get(F.c_after)) if c.get(F.c_before) is not None else ""
    ms = _ms(c.get(F.c_ms))
    name = SHORT.get(layer, layer)
    if action == "failed":
        head = f"FAILED ({trigger})" if trigger else "FAILED"
        return name, [head, words(c.get(F.c_failure) or ""), ms, "sent as it came"], True
    if action == "skipped":
        if c.get(F.c_reused):
            return name, ["reused the summary another request had just written"], False
        skip = c.get(F.c_skip)
        if skip in NOTABLE_SKIPS or (code == "forced" and skip):
            return name, [f"skipped: {words(skip)}"], skip in NOTABLE_SKIPS
        return None
    if action not in ("compacted", "dropped"):
        return None
    count, covers = _num(c.get(F.c_count)), _num(c.get(F.c_covers))
    if layer == Layer.SESSION:
        batches = _num(f.get(F.session_batches))
        version = c.get(F.c_version)
        what = (
            f"{trigger}: {_tokens(count)} messages"
            + (f" in {int(batches)} batches" if batches and batches > 1 else "")
            + (f" \u2192 summary v{version}" if version is not None else "")
        )
        return name, [what, tokens, ms], False
    if layer == Layer.LOOP:
        what = (
            f"{trigger}: "
            + (f"{int(count)} tool rounds folded" if count is not None else "")
            + (f" ({int(covers)} in working memory)" if covers is not None else "")
        )
        return name, [what, tokens, ms], False
    if layer == Layer.TRIM:
        shortened, saved = _num(c.get(F.c_shortened)), _num(c.get(F.c_saved))
        return (
            name,
            [
                f"{int(count)} tool results trimmed" if count else "",
                f"{int(shortened)} old messages shortened" if shortened else "",
                f"{int(saved):,} chars saved" if saved else "",
            ],
            False,
        )
    if layer == Layer.FIT:
        reason = c.get(F.c_reason)
        what = f"DROPPED the {_tokens(count)} oldest messages to fit the window"
        return (
            name,
            [what + (f" ({words(reason)})" if reason else "")],
            True,
        )
    return name, [words(action), tokens, ms], False


def _manual_line(f: Mapping[str, Any], add: Callable[..., None]) -> None:
    manual = f.get(F.manual)
    if manual:
        outcome = {"ok": "compacted", "skipped": "skipped", "failed": "FAILED"}.get(
            str(manual), str(manual)
        )
        reason = f.get(F.manual_reason)
        if reason:
            # The API's message ("Nothing was compacted: below_threshold.") without its opening.
            text = re.sub(r"^(Nothing was compacted|Compaction failed):\s*", "", str(reason))
            outcome += f": {words(text).rstrip('.')}"
        add("manual", outcome, _ms(f.get(F.manual_ms)), bad=manual == "failed")


def render(record: Mapping[str, Any], style: Style = PLAIN) -> str:
    """A log record (a parsed JSON line) as text: a request line with its compactions, a
    lifecycle line, or `time level logger: msg key=value...` for anything else."""
    if record.get(F.logger) == "recap.access":
        return "\n".join([request_line(record, style), *compaction_lines(record, style)])
    stamp = style.dim(clock(record.get(F.ts)))
    level = str(record.get(F.level, "info"))
    shown = {"warning": style.warn("warn "), "error": style.bad("error")}.get(level, f"{level:5}")
    msg = str(record.get(F.msg, ""))
    if record.get(F.event):
        return f"{stamp} {shown} {style.bold(msg)}"
    rest = " ".join(
        f"{k}={_value(v)}"
        for k, v in record.items()
        if k not in (F.ts, F.level, F.logger, F.msg) and v is not None
    )
    return f"{stamp} {shown} {record.get(F.logger, '')}: {msg}" + (f" {rest}" if rest else "")


def _value(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return ",".join(map(str, value))
    s = str(value)
    return json.dumps(s, ensure_ascii=False) if (" " in s or s == "") else s


def tail(
    src: TextIO,
    out: TextIO,
    conversation: str | None = None,
    follow: bool = False,
    *,
    tenant: str | None = None,
    raw: bool = False,
    style: Style = PLAIN,
) -> None:
    """Print each line of `src` readably (or, with `raw`, as it is) until its end; with
    `follow`, keep waiting for more. The filters keep only the lines naming them."""
    filtered = conversation is not None or tenant is not None
    days = Days()
    while True:
        line = src.readline()
        if not line:
            if not follow:
                return
            time.sleep(0.2)
            continue
        line = line.rstrip("\n")
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        if not isinstance(record, dict):
            if not filtered:
                print(line, file=out, flush=True)
            continue
        if conversation is not None and record.get(F.conversation) != conversation:
            continue
        if tenant is not None and record.get(F.tenant) != tenant:
            continue
        if raw:
            print(line, file=out, flush=True)
            continue
        day = days.mark(record)
        if day is not None:
            print(style.dim(day), file=out)
        print(render(record, style), file=out, flush=True)
