"""Prompt scenes: the summarizer's prompts and sampling settings, kept out of code.

Sits beside the summarizer in the data path: at start-up the app builds a
`SceneSet` (every scene loaded and validated, so a typo fails the start, not the
first compaction); at compaction time the summarizer calls `render` with the
transcript and friends and sends the resulting (system, user) pair upstream.

The default scenes ship inside the package (`scenes/<kind>.yaml`, as `proxy.scenes_default`,
package data), so a wheel installed anywhere starts with a config in any directory;
a config's `scenes_dir` replaces them, a tenant's `scenes` replaces one kind.

A scene file is YAML with the keys in `_KEYS`. `length_retry` (optional, a template
like the others, `DEFAULT_LENGTH_RETRY` when absent) is appended to the user prompt when
a summary was cut by `max_tokens` and is asked for once more, shorter. Templates use `{{variable}}`
placeholders plus two section forms, `{{#v}}...{{/v}}` (kept when v is
non-blank) and `{{^v}}...{{/v}}` (kept when v is blank). A section tag alone on
its line takes the line with it, so optional blocks leave no blank lines behind.
Values are inserted verbatim in a single pass: a value that itself contains
`{{x}}` is never expanded, which matters because transcripts are user text. One
value is spelled out: `language`, a language's English name, is written with its
own name beside it ("Chinese (中文)", `language_label`), which small models follow
more reliably than the English name alone.

`input` (optional, `transcript` by default; planning/riding.py) says what a session
summarizer call is given: `transcript`, the folded messages rendered into `user`; or
`cache_riding`, the conversation's last forwarded request byte for byte and then one
instruction message, the `riding` template (its variables in `RIDING`), so that the
provider's prompt cache covers most of the call. Any other value fails the load, and so
does `cache_riding` without a `riding` template or on another kind of scene.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from importlib.resources import files
from importlib.resources.abc import Traversable
from pathlib import Path
from types import MappingProxyType
from typing import Any, TypeAlias

import yaml

from proxy.planning.riding import SummaryInput


class SceneError(ValueError):
    """A scene file is invalid or a render call is wrong; the message names file and key."""


@dataclass(frozen=True)
class SceneKind:
    """The variables a kind of scene must use and may use."""

    required: frozenset[str]
    optional: frozenset[str]

    @property
    def variables(self) -> frozenset[str]:
        return self.required | self.optional


KINDS: Mapping[str, SceneKind] = MappingProxyType(
    {
        "session_compact": SceneKind(
            required=frozenset({"transcript"}),
            optional=frozenset(
                {"existing_summary", "current_message", "max_summary_chars", "language"}
            ),
        ),
        "loop_compact": SceneKind(
            required=frozenset({"transcript"}),
            optional=frozenset({"existing_summary", "goal", "max_summary_chars", "language"}),
        ),
    }
)


# The riding instruction's variables (session_compact scenes): which part of the view
# above it to summarise (`count` messages from the first; the last of them a `role`
# message beginning with `anchor`), whether that part begins with a summary to merge
# (`summary_shown`, "yes" or blank), the character target and the language.
RIDING = SceneKind(
    required=frozenset({"count", "role", "anchor"}),
    optional=frozenset({"summary_shown", "max_summary_chars", "language"}),
)
# The kinds whose scenes may ride (`input: cache_riding`).
RIDING_KINDS = frozenset({"session_compact"})


# The names detect_language gives (proxy.planning.transcript), in their own script.
NATIVE_NAMES: Mapping[str, str] = MappingProxyType(
    {"Chinese": "中文", "Japanese": "日本語", "Korean": "한국어"}
)


def language_label(language: str) -> str:
    """ "Chinese" -> "Chinese (中文)"; a name without a native spelling listed stays as is."""
    native = NATIVE_NAMES.get(language.strip())
    return f"{language.strip()} ({native})" if native else language


@dataclass(frozen=True)
class Scene:
    name: str
    model: str | None
    temperature: float | None
    top_p: float | None
    max_tokens: int | None
    system: str
    user: str
    description: str = ""
    # The kind the scene was validated as; lets `render` check the caller's values.
    kind: str = ""
    length_retry: str = ""
    input: SummaryInput = SummaryInput.TRANSCRIPT
    # The riding instruction template ("" when the scene has none).
    riding: str = ""


# Appended to the user prompt of the second try after a summary was cut by its token
# limit or came back over max_summary_chars; {{max_summary_chars}} is then half the first
# try's target.
DEFAULT_LENGTH_RETRY = """\
Your previous answer was too long. Write the summary again, much
shorter{{#max_summary_chars}} (at most {{max_summary_chars}} characters){{/max_summary_chars}}:
do not copy tool output, logs, code or long quotes; keep the user's constraints,
identifiers, values, decisions and pending work, one short line each. Keep every section
and end with </summary>.
"""


_REQUIRED_KEYS = ("name", "system", "user")
_KEYS = frozenset(
    {
        *_REQUIRED_KEYS,
        "description",
        "model",
        "temperature",
        "top_p",
        "max_tokens",
        "length_retry",
        "input",
        "riding",
    }
)

_NAME = r"[A-Za-z_][A-Za-z0-9_]*"
# A section tag alone on its line (standalone) swallows its line; otherwise tags are inline.
_TAG = re.compile(
    rf"^[ \t]*\{{\{{[ \t]*(?P<ssigil>[#^/])[ \t]*(?P<sname>{_NAME})[ \t]*\}}\}}[ \t]*(?:\r?\n|\Z)"
    rf"|\{{\{{\s*(?P<sigil>[#^/]?)\s*(?P<name>{_NAME})\s*\}}\}}",
    re.MULTILINE,
)


@dataclass(frozen=True)
class _Section:
    name: str
    inverted: bool
    body: tuple[_Node, ...]


@dataclass(frozen=True)
class _Var:
    name: str


_Node: TypeAlias = str | _Var | _Section


def _parse(template: str) -> tuple[_Node, ...]:
    """Parse a template into nodes; raises ValueError with a short reason."""
    # Stack of (section name, inverted, nodes so far); the bottom entry is the top level.
    stack: list[tuple[str, bool, list[_Node]]] = [("", False, [])]
    pos = 0
    for m in _TAG.finditer(template):
        _add_text(stack[-1][2], template[pos : m.start()])
        pos = m.end()
        sigil = m.group("ssigil") or m.group("sigil")
        name = m.group("sname") or m.group("name")
        if sigil in ("#", "^"):
            stack.append((name, sigil == "^", []))
        elif sigil == "/":
            if len(stack) == 1 or stack[-1][0] != name:
                raise ValueError(f"{{{{/{name}}}}} closes no open section")
            opened, inverted, body = stack.pop()
            stack[-1][2].append(_Section(opened, inverted, tuple(body)))
        else:
            stack[-1][2].append(_Var(name))
    _add_text(stack[-1][2], template[pos:])
    if len(stack) > 1:
        raise ValueError(f"section {{{{#{stack[-1][0]}}}}} is never closed")
    return tuple(stack[0][2])


def _add_text(nodes: list[_Node], text: str) -> None:
    if "{{" in text:
        at = text.index("{{")
        raise ValueError(f"malformed placeholder near {text[at : at + 30]!r}")
    if text:
        nodes.append(text)


def _names(nodes: tuple[_Node, ...]) -> set[str]:
    out: set[str] = set()
    for n in nodes:
        if isinstance(n, _Var):
            out.add(n.name)
        elif isinstance(n, _Section):
            out.add(n.name)
            out |= _names(n.body)
    return out


def _emit(nodes: tuple[_Node, ...], values: Mapping[str, str], out: list[str]) -> None:
    for n in nodes:
        if isinstance(n, str):
            out.append(n)
        elif isinstance(n, _Var):
            out.append(values.get(n.name, ""))
        elif bool(values.get(n.name, "").strip()) != n.inverted:
            _emit(n.body, values, out)


def _check_number(
    data: Mapping[str, Any], key: str, where: str, lo: float, hi: float, integer: bool = False
) -> Any:
    raw = data.get(key)
    if raw is None:
        return None
    ok_type = int if integer else (int, float)
    if isinstance(raw, bool) or not isinstance(raw, ok_type):
        kind = "an integer" if integer else "a number"
        raise SceneError(f"{where}: {key}: expected {kind}, got {raw!r}")
    if not lo <= raw <= hi:
        raise SceneError(f"{where}: {key}: must be between {lo:g} and {hi:g}, got {raw!r}")
    return raw if integer else float(raw)


def _check_string(data: Mapping[str, Any], key: str, where: str, *, empty_ok: bool) -> str:
    raw = data.get(key, "")
    if not isinstance(raw, str):
        raise SceneError(f"{where}: {key}: expected a string, got {type(raw).__name__}")
    if not empty_ok and not raw.strip():
        raise SceneError(f"{where}: {key}: must not be empty")
    return raw


def packaged_scenes() -> Traversable:
    """The directory of default scenes inside the installed package."""
    return files("proxy.scenes_default")


def load_scene(path: str | Path | Traversable, kind: str) -> Scene:
    """Read and validate one scene file as `kind`; every problem names the file and key."""
    where = str(path)
    if kind not in KINDS:
        raise SceneError(f"{where}: unknown scene kind {kind!r} (known: {', '.join(KINDS)})")
    try:
        source = Path(path) if isinstance(path, str) else path
        data = yaml.safe_load(source.read_text(encoding="utf-8"))
    except OSError as e:
        raise SceneError(f"cannot read scene {where}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise SceneError(f"{where}: invalid YAML: {e}") from None
    if not isinstance(data, Mapping):
        raise SceneError(f"{where}: expected a mapping at the top level")
    unknown = sorted(str(k) for k in data if k not in _KEYS)
    if unknown:
        raise SceneError(f"{where}: unknown scene key: {', '.join(unknown)}")
    missing = [k for k in _REQUIRED_KEYS if k not in data]
    if missing:
        raise SceneError(f"{where}: missing scene key: {', '.join(missing)}")

    model = data.get("model")
    if model is not None and (not isinstance(model, str) or not model.strip()):
        raise SceneError(f"{where}: model: expected a model name or null, got {model!r}")
    allowed = KINDS[kind].variables
    used: set[str] = set()
    templates: dict[str, str] = {}
    for key in ("system", "user", "length_retry"):
        if key == "length_retry" and key not in data:
            templates[key] = DEFAULT_LENGTH_RETRY
            continue
        text = _check_string(data, key, where, empty_ok=False)
        try:
            names = _names(_parse(text))
        except ValueError as e:
            raise SceneError(f"{where}: {key}: {e}") from None
        bad = sorted(names - allowed)
        if bad:
            raise SceneError(
                f"{where}: {key}: unknown variable {', '.join(bad)} for a {kind} scene "
                f"(allowed: {', '.join(sorted(allowed))})"
            )
        if key != "length_retry":
            used |= names
        templates[key] = text
    unused = sorted(KINDS[kind].required - used)
    if unused:
        raise SceneError(f"{where}: system/user: required variable {', '.join(unused)} not used")
    chosen = _check_input(data.get("input"), kind, where)
    riding = _check_riding(data, kind, where, chosen)

    return Scene(
        name=_check_string(data, "name", where, empty_ok=False),
        model=model,
        temperature=_check_number(data, "temperature", where, 0.0, 2.0),
        top_p=_check_number(data, "top_p", where, 0.0, 1.0),
        max_tokens=_check_number(data, "max_tokens", where, 1, 10**7, integer=True),
        system=templates["system"],
        user=templates["user"],
        description=_check_string(data, "description", where, empty_ok=True),
        kind=kind,
        length_retry=templates["length_retry"],
        input=chosen,
        riding=riding,
    )


def _check_input(raw: Any, kind: str, where: str) -> SummaryInput:
    if raw is None:
        return SummaryInput.TRANSCRIPT
    known = ", ".join(SummaryInput)
    if not isinstance(raw, str) or raw not in {m.value for m in SummaryInput}:
        raise SceneError(f"{where}: input: expected one of {known}, got {raw!r}")
    chosen = SummaryInput(raw)
    if chosen is SummaryInput.CACHE_RIDING and kind not in RIDING_KINDS:
        raise SceneError(
            f"{where}: input: cache_riding is built for {', '.join(sorted(RIDING_KINDS))} "
            f"scenes only, not {kind}"
        )
    return chosen


def _check_riding(data: Mapping[str, Any], kind: str, where: str, chosen: SummaryInput) -> str:
    if "riding" not in data:
        if chosen is SummaryInput.CACHE_RIDING:
            raise SceneError(f"{where}: input: cache_riding needs a riding template")
        return ""
    if kind not in RIDING_KINDS:
        raise SceneError(f"{where}: riding: only {', '.join(sorted(RIDING_KINDS))} scenes ride")
    text = _check_string(data, "riding", where, empty_ok=False)
    try:
        names = _names(_parse(text))
    except ValueError as e:
        raise SceneError(f"{where}: riding: {e}") from None
    bad = sorted(names - RIDING.variables)
    if bad:
        raise SceneError(
            f"{where}: riding: unknown variable {', '.join(bad)} "
            f"(allowed: {', '.join(sorted(RIDING.variables))})"
        )
    missing = sorted(RIDING.required - names)
    if missing:
        raise SceneError(f"{where}: riding: required variable {', '.join(missing)} not used")
    return text


def render(scene: Scene, **values: str | int) -> tuple[str, str]:
    """Fill the scene's templates; returns (system, user), each stripped.

    Optional variables left out render as empty (and their sections drop out).
    For a scene with a known kind, a missing required value or a value the kind
    does not define is a programming error and raises SceneError.
    """
    return render_values(scene, values)


def render_values(
    scene: Scene, values: Mapping[str, str | int], *, length_retry: bool = False
) -> tuple[str, str]:
    """`render` with the values as a mapping; `length_retry`: the scene's `length_retry`
    text follows the user prompt (the second, shorter try after a cut by max_tokens)."""
    spec = KINDS.get(scene.kind)
    if spec is not None:
        unknown = sorted(set(values) - spec.variables)
        if unknown:
            raise SceneError(f"scene {scene.name}: unknown variable {', '.join(unknown)}")
        missing = sorted(k for k in spec.required if k not in values)
        if missing:
            raise SceneError(f"scene {scene.name}: no value for {', '.join(missing)}")
    text = _as_text(values)
    rendered: list[str] = []
    retry = (scene.length_retry or DEFAULT_LENGTH_RETRY) if length_retry else ""
    for template in (scene.system, scene.user, retry):
        out: list[str] = []
        # Templates were validated at load; parsing again is cheap next to a model call.
        _emit(_parse(template), text, out)
        rendered.append("".join(out).strip())
    user = f"{rendered[1]}\n\n{rendered[2]}" if rendered[2] else rendered[1]
    return rendered[0], user


def _as_text(values: Mapping[str, str | int]) -> dict[str, str]:
    """A scene's values as the texts its templates hold, the language by its name."""
    text = {k: v if isinstance(v, str) else str(v) for k, v in values.items()}
    if "language" in text:
        text["language"] = language_label(text["language"])
    return text


def render_riding(
    scene: Scene, values: Mapping[str, str | int], *, length_retry: bool = False
) -> str:
    """The riding instruction of `scene` filled with `values` (their names in `RIDING`),
    stripped; `length_retry`: the scene's `length_retry` text follows it."""
    if not scene.riding:
        raise SceneError(f"scene {scene.name}: no riding template")
    unknown = sorted(set(values) - RIDING.variables)
    if unknown:
        raise SceneError(f"scene {scene.name}: unknown riding variable {', '.join(unknown)}")
    text = _as_text(values)
    out: list[str] = []
    _emit(_parse(scene.riding), text, out)
    instruction = "".join(out).strip()
    if length_retry:
        retry: list[str] = []
        _emit(_parse(scene.length_retry or DEFAULT_LENGTH_RETRY), text, retry)
        instruction = f"{instruction}\n\n{''.join(retry).strip()}"
    return instruction


class SceneSet:
    """Every scene kind, loaded and validated once at start-up.

    `directory/<kind>.yaml` supplies each kind unless `overrides` maps the kind to
    another file (a tenant's own prompt); an override is validated as that kind.
    Without a directory, the packaged defaults supply every kind not overridden.
    """

    def __init__(
        self, directory: str | Path | None = None, overrides: Mapping[str, str] | None = None
    ) -> None:
        overrides = overrides or {}
        unknown = sorted(set(overrides) - set(KINDS))
        if unknown:
            raise SceneError(
                f"scene override for unknown scene {', '.join(unknown)} (known: {', '.join(KINDS)})"
            )
        folder = packaged_scenes() if directory is None else Path(directory)
        self._scenes: dict[str, Scene] = {}
        for kind in KINDS:
            path = Path(overrides[kind]) if kind in overrides else folder / f"{kind}.yaml"
            self._scenes[kind] = load_scene(path, kind)

    def get(self, name: str) -> Scene:
        try:
            return self._scenes[name]
        except KeyError:
            raise SceneError(f"unknown scene {name!r} (known: {', '.join(KINDS)})") from None

    def __contains__(self, name: object) -> bool:
        return name in self._scenes
