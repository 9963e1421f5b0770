"""Colours for terminal output (`recap tail`, the server's text log): ANSI, or none.

Beside the log path, not on it: renderers take a `Style` and call it on each cell; the
plain style returns text unchanged, so a renderer never checks whether colours are on.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Style:
    """ANSI colours, or none (the default, and whenever the output is not a terminal)."""

    colour: bool = False

    def _sgr(self, code: str, text: str) -> str:
        return f"\033[{code}m{text}\033[0m" if self.colour and text else text

    def dim(self, text: str) -> str:
        return self._sgr("2", text)

    def bold(self, text: str) -> str:
        return self._sgr("1", text)

    def good(self, text: str) -> str:
        return self._sgr("32", text)

    def warn(self, text: str) -> str:
        return self._sgr("33", text)

    def bad(self, text: str) -> str:
        return self._sgr("31", text)

    def note(self, text: str) -> str:
        return self._sgr("36", text)
