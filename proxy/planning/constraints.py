"""What reads as a constraint or a decision, and whether a summary kept one.

Part of the quality guard (`guard.py`), pure. A constraint is a sentence that reads as
one however it is written (别, 不要, 先别, 不能, 必须, don't, do not, never, must, make
sure, ...; words that hold a marker without being one, 要不要, 别的, 特别, are masked
first; questions are not constraints); a decision the user states (批准, 否决, 推迟,
approved, rejected, postponed, ...) counts as one. Whose sentence it is, is not decided
here (`authorship.py`, `guard.user_constraints`).
"""

from __future__ import annotations

import re

from proxy.planning.authorship import POISON

# A sentence of a user message that states a constraint, however it is written. Words
# that hold a marker without being one (要不要, 别的, 特别, ...) are masked out first.
_ZH_MARKER = re.compile(
    r"先别|别|不要|不能|不可以|不许|不准|不得|禁止|请勿|切勿|千万|务必|必须|一定要|只能|暂时不|先不"
    # A decision the user states binds like a constraint, and its status is in its words.
    r"|批准|否决|驳回|推迟|延后|暂缓|暂不|就这么定|定下来|同意|采纳|以后再|下个迭代"
)
_ZH_NOT_MARKER = re.compile(
    r"要不要|能不能|可不可以|是不是|会不会|别的|别人|别处|区别|特别|分别|类别|级别|识别|告别|"
    r"差别|个别|性别|派别|辨别|鉴别|别名|不要紧|不得不|不能不"
)
_EN_MARKER = re.compile(
    r"(?:^|[,;:(]\s*|\b(?:please|and|but|also|just|so|then|again)\s+)"
    r"(?:don['’]t|do not|never|avoid)\b"
    r"|\b(?:you|we|it|they|this|that) (?:must|mustn['’]t|should not|shouldn['’]t|may not)\b"
    r"|\bmust not\b|\b(?:make|be) sure\b|\bunder no circumstances\b"
    r"|\bI (?:don['’]t|do not) want\b|\b(?:no|not) (?:more|later|earlier) than\b"
    r"|\b(?:approved?|rejected|declined?|postponed?|deferred|I agree|let['’]s go with)\b",
    re.IGNORECASE,
)
# Sentence ends: CJK and ASCII stops, semicolons and line breaks (a period only before
# a space, so "v2.7.3" and "a.py" stay whole).
_SENTENCE = re.compile(r"[^。！？!?；;\n]+(?:[。！？!?；;]|$)", re.MULTILINE)
_EN_STOP = re.compile(r"(?<=[.])\s+")
_CLAUSE = re.compile(r"[^，,：:]+[，,：:]?")
MAX_CONSTRAINT_CHARS = 160
# A number with a short unit (11AM, 2048MB, 10min) is a quantity the model may respell.
_SHORT_CLAUSE = 10  # a marker clause this short keeps the clause before it (its object)
# Words that lead into a clause without being part of the constraint.
_LEAD = re.compile(
    r"^(?:(?:不过|但是|但|另外|还有|注意|而且|并且|所以|那|麻烦)\s*"
    r"|(?:and|but|also|so|please|ok|okay|no)\b[\s,]*)+",
    re.IGNORECASE,
)


def is_constraint(text: str) -> bool:
    if _ZH_MARKER.search(_ZH_NOT_MARKER.sub(" ", text)):
        return True
    return bool(_EN_MARKER.search(text))


def constraint_sentences(text: str) -> list[str]:
    """The sentences (or, for a long one, the clauses) of `text` that state a constraint,
    verbatim, in order; questions are left out."""
    out: list[str] = []
    for m in _SENTENCE.finditer(text):
        for sentence in _EN_STOP.split(m.group(0)):
            sentence = sentence.strip()
            if POISON in sentence:  # it quotes (authorship.own_text): not all the user's
                continue
            if sentence.endswith(("?", "？")) or not is_constraint(sentence):
                continue
            if len(sentence) > MAX_CONSTRAINT_CHARS:
                clauses = [c.group(0) for c in _CLAUSE.finditer(sentence)]
                for k, clause in enumerate(clauses):
                    if not is_constraint(clause):
                        continue
                    start = k - 1 if k and len(clause.strip()) < _SHORT_CLAUSE else k
                    sentence = "".join(clauses[start : k + 1]).strip()
                    break
            sentence = sentence.strip().rstrip("，,：:")
            if 4 <= len(sentence) <= MAX_CONSTRAINT_CHARS and sentence not in out:
                out.append(sentence)
    return out


def folded(text: str) -> str:
    return " ".join(text.split())


def marked_clauses(constraint: str) -> list[str]:
    """The clauses of a constraint that state it, without a leading 不过, 注意, but, ..."""
    clauses = [_LEAD.sub("", c.group(0).strip(" ，,：:。.")) for c in _CLAUSE.finditer(constraint)]
    return [c for c in clauses if is_constraint(c)]


def shorter_form(constraint: str) -> list[str]:
    """The shorter form of a constraint: its marked clauses joined, when that is shorter."""
    core = "，".join(marked_clauses(constraint))
    return [core] if core and len(core) < len(constraint) else []


def constraint_kept(constraint: str, summary: str) -> bool:
    """Verbatim (whitespace folded), or every clause of it that states the constraint is
    (without a leading 不过, 注意, but, please, ...)."""
    text = folded(summary)
    if folded(constraint) in text:
        return True
    marked = marked_clauses(constraint)
    return bool(marked) and all(folded(c) in text for c in marked)
