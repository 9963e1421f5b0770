"""Escaped HTML built from Python: the one way the web page turns values into markup.

Off the data path: used by the operator page (`proxy.web`) only. Conversation
content is untrusted (user messages, tool results, summaries), so every value is
escaped with `html.escape` unless it is already `Html`, which only this module's
functions make. Templates are literal strings with `{name}` fields.
"""

from __future__ import annotations

import html
from collections.abc import Iterable


class Html(str):
    """Markup that is safe to emit as is: escaped values inside literal templates."""

    __slots__ = ()


def esc(value: object) -> Html:
    """The value as text in HTML (quotes too, so it is safe inside attributes)."""
    if isinstance(value, Html):
        return value
    return Html(html.escape("" if value is None else str(value), quote=True))


def render(template: str, /, **values: object) -> Html:
    """`template` with each `{name}` replaced by its value, escaped unless it is `Html`."""
    return Html(template.format(**{k: esc(v) for k, v in values.items()}))


def join(parts: Iterable[object], sep: str = "") -> Html:
    return Html(sep.join(esc(p) for p in parts))
