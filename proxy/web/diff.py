"""A line diff between two summary versions (difflib), as escaped HTML.

Pure. Summaries are untrusted model output: each line is escaped before it is
wrapped in its added/removed/hunk span.
"""

from __future__ import annotations

import difflib

from proxy.web.markup import Html, join, render


def summary_diff(old: str, new: str, old_name: str, new_name: str) -> Html:
    lines = list(
        difflib.unified_diff(
            old.splitlines(), new.splitlines(), old_name, new_name, lineterm="", n=3
        )
    )
    if not lines:
        return Html('<p class="muted">The two versions are the same text.</p>')

    def line(text: str) -> Html:
        if text.startswith(("+++", "---", "@@")):
            cls = "hunk"
        elif text.startswith("+"):
            cls = "add"
        elif text.startswith("-"):
            cls = "del"
        else:
            return render("{t}\n", t=text)
        return render('<span class="{c}">{t}</span>', c=cls, t=text)

    return render('<pre class="diff">{body}</pre>', body=join(line(t) for t in lines))
