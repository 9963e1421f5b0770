"""A request's path in its one canonical spelling, before anything routes on it.

The outermost step of routing (`app.RecapApp`). `/v1/./chat/completions`,
`/v1/chat/../chat/completions`, `/v1//chat/completions` and `/v1/chat/completions/` are
the chat route to the upstream: its server resolves dot segments (RFC 3986 §5.2.4),
merges repeated slashes (nginx does by default) or redirects the trailing slash away.
Routed as written they would be forwarded as pass-through, and a compacting route's
requests would reach the upstream neither archived nor compacted. So the path is
routed, and forwarded, as the upstream would read it: dot segments resolved (`%2e`
too: uvicorn has decoded it), empty segments dropped, no trailing slash.

Paths under the operator and web prefixes are left as written: there a conversation key
is one path segment, and `..` or an empty key is a key like any other (those routes
forward nothing upstream).
"""

from __future__ import annotations

from urllib.parse import quote

from proxy.edge.relay import Scope

# Where a path segment may be a conversation key: never rewritten.
KEYED_PREFIXES = ("/v1/recap", "/recap")


def canonical(path: str) -> str:
    """The path as routed and forwarded (see the module docstring)."""
    if any(path == p or path.startswith(p + "/") for p in KEYED_PREFIXES):
        return path
    segments: list[str] = []
    for segment in path.split("/"):
        if segment in ("", "."):
            continue
        if segment == "..":
            if segments:
                segments.pop()
            continue
        segments.append(segment)
    return "/" + "/".join(segments)


def canonicalise(scope: Scope) -> None:
    """Rewrite an HTTP scope's path to its canonical spelling (nothing when it is one)."""
    path = scope["path"]
    fixed = canonical(path)
    if fixed != path:
        scope["path"] = fixed
        scope["raw_path"] = quote(fixed).encode("ascii")
