"""Pure scoring of the summaries a real model wrote: language, constraints, decision status.

The only part of `benchmarks.realmodel` that tests import
(tests/benchmarks/test_realmodel_scoring.py): no IO, no model. Definitions:

- language: `language_of` counts CJK ideographs and Latin letters in the text, leaving out
  Markdown headings (the scene keeps them in English), `<summary>` tags and tokens that
  hold a digit, `_`, `/` or `.` (identifiers, paths, versions); "zh" when ideographs are at
  least `ZH_SHARE` of the two, "en" when there are Latin letters, "unknown" otherwise.
- constraint retention: `constraint_kept` is verbatim containment after folding whitespace;
  quotation marks around it, or none, do not matter.
- decision status: `decision_status` reads the summary's lines that mention a decision (any
  of its `keys`) and the status words on them: one status is that status, none is "none",
  several are "conflicting", no line is "missing". Negated forms ("未批准", "not approved")
  are matched before the plain word they contain.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

ZH_SHARE = 0.3
STATUSES = ("approved", "rejected", "deferred")

_HEADING = re.compile(r"^\s*#+.*$", re.M)
_TAG = re.compile(r"</?summary>")
_IDENT = re.compile(r"\S*[\d_/.]\S*")
_CJK = re.compile(r"[\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff]")
_LATIN = re.compile(r"[A-Za-z]")

# (pattern, status), tried in order; a match masks its span so "未批准" is not also "批准".
_STATUS_WORDS: tuple[tuple[str, str], ...] = (
    (r"未批准|不批准|没有批准|未通过|没通过|不同意|not approved|unapproved", "rejected"),
    (r"暂不|先不|暂缓|推迟|延后|延期|待定|以后再|之后再|再决定|再说|下个迭代", "deferred"),
    (r"\b(?:deferred|postponed|on hold|later|pending decision|not yet decided)\b", "deferred"),
    (r"驳回|拒绝|否决|不采纳|不予|不改|不采用|被拒", "rejected"),
    (r"\b(?:rejected|declined|denied|refused|vetoed)\b", "rejected"),
    (r"批准|通过|同意|采纳|定了|确认采用|已审批", "approved"),
    (r"\b(?:approved|accepted|agreed|granted)\b", "approved"),
)


def language_of(text: str) -> str:
    """The language of `text`: zh, en or unknown (see the module docstring)."""
    body = _IDENT.sub(" ", _TAG.sub(" ", _HEADING.sub(" ", text)))
    cjk = len(_CJK.findall(body))
    latin = len(_LATIN.findall(body))
    if cjk + latin == 0:
        return "unknown"
    return "zh" if cjk >= ZH_SHARE * (cjk + latin) else "en"


def _fold(text: str) -> str:
    return " ".join(text.split())


def constraint_kept(constraint: str, text: str) -> bool:
    """Whether `constraint` occurs verbatim in `text` (whitespace folded)."""
    return _fold(constraint) in _fold(text)


def statuses_in(line: str) -> set[str]:
    """The decision statuses a line states (see `_STATUS_WORDS`)."""
    found: set[str] = set()
    rest = line
    for pattern, status in _STATUS_WORDS:
        regex = re.compile(pattern, re.I)
        if regex.search(rest):
            found.add(status)
            rest = regex.sub(" ", rest)
    return found


@dataclass(frozen=True)
class Decision:
    id: str
    keys: tuple[str, ...]
    status: str


def decision_status(decision: Decision, summary: str) -> str:
    """The status the summary gives `decision`: a status, "none", "conflicting" or "missing"."""
    lines = [line for line in summary.splitlines() if any(k in line for k in decision.keys)]
    if not lines:
        return "missing"
    found: set[str] = set()
    for line in lines:
        found |= statuses_in(line)
    if not found:
        return "none"
    return found.pop() if len(found) == 1 else "conflicting"


@dataclass(frozen=True)
class DecisionScore:
    decision: Decision
    found: str

    @property
    def correct(self) -> bool:
        return self.found == self.decision.status


def score_decisions(decisions: Sequence[Decision], summary: str) -> list[DecisionScore]:
    return [DecisionScore(d, decision_status(d, summary)) for d in decisions]


def accuracy(scores: Iterable[DecisionScore]) -> float | None:
    listed = list(scores)
    return sum(s.correct for s in listed) / len(listed) if listed else None
