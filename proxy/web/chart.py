"""The page's charts: tokens the client sent vs tokens forwarded, per request (the
conversation page); each holdout measure's mean in both cohorts (the report page).

Pure: request points in, inline SVG out (no script, no remote asset). Each point
links to that request's "what the model saw" view. The gap between the two lines
is what compaction saved on that request.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from proxy.web.markup import Html, join, render
from proxy.web.timeline import RequestPoint

WIDTH, HEIGHT = 860, 260
LEFT, RIGHT, TOP, BOTTOM = 64, 16, 16, 36
CLIENT, SENT = "#9a6700", "#0969da"


def _ticks(top: int, n: int = 4) -> list[int]:
    """Round tick values from 0 to at least `top`."""
    raw = max(1, top) / n
    magnitude = 10 ** (len(str(int(raw))) - 1)
    step = next(m * magnitude for m in (1, 2, 2.5, 5, 10) if m * magnitude >= raw)
    return [int(step * i) for i in range(n + 1)]


def _label(tokens: int) -> str:
    return f"{tokens / 1000:g}k" if tokens >= 1000 else str(tokens)


def tokens_chart(points: Sequence[RequestPoint], link: Callable[[RequestPoint], str]) -> Html:
    measured = [p for p in points if p.tokens_client is not None or p.tokens_sent is not None]
    if not measured:
        return Html('<p class="muted">No measured requests yet.</p>')
    ticks = _ticks(max(max(p.tokens_client or 0, p.tokens_sent or 0) for p in measured))
    y_top = ticks[-1] or 1
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
    count = len(measured)

    def x(i: int) -> float:
        return LEFT + (plot_w * (i + 0.5) / count)

    def y(tokens: int) -> float:
        return TOP + plot_h * (1 - tokens / y_top)

    parts: list[Html] = []
    for t in ticks:
        parts.append(
            render(
                '<line x1="{x1}" x2="{x2}" y1="{y}" y2="{y}" class="grid"/>'
                '<text x="{tx}" y="{ty}" class="axis" text-anchor="end">{label}</text>',
                x1=LEFT,
                x2=WIDTH - RIGHT,
                y=f"{y(t):.1f}",
                tx=LEFT - 6,
                ty=f"{y(t) + 4:.1f}",
                label=_label(t),
            )
        )
    for series, colour, dash in (("tokens_client", CLIENT, "4 3"), ("tokens_sent", SENT, "")):
        coords = [
            f"{x(i):.1f},{y(v):.1f}"
            for i, p in enumerate(measured)
            if (v := getattr(p, series)) is not None
        ]
        parts.append(
            render(
                '<polyline points="{points}" fill="none" stroke="{colour}" stroke-width="2"'
                ' stroke-dasharray="{dash}"/>',
                points=" ".join(coords),
                colour=colour,
                dash=dash or "none",
            )
        )
    for i, p in enumerate(measured):
        title = (
            f"request {p.request_id or p.event_id}: client {p.tokens_client} tokens, "
            f"sent {p.tokens_sent} tokens" + (f" ({', '.join(p.layers)})" if p.layers else "")
        )
        dots = [
            render(
                '<circle cx="{cx}" cy="{cy}" r="3.5" fill="{c}"/>',
                cx=f"{x(i):.1f}",
                cy=f"{y(v):.1f}",
                c=c,
            )
            for v, c in ((p.tokens_client, CLIENT), (p.tokens_sent, SENT))
            if v is not None
        ]
        # The whole column is the link, not just the two small dots.
        column = render(
            '<rect x="{x}" y="{y}" width="{w}" height="{h}" class="hit"/>',
            x=f"{x(i) - plot_w / count / 2:.1f}",
            y=TOP,
            w=f"{plot_w / count:.1f}",
            h=plot_h,
        )
        parts.append(
            render(
                '<a href="{href}"><title>{title}</title>{column}{dots}</a>',
                href=link(p),
                title=title,
                column=column,
                dots=join(dots),
            )
        )
    parts.append(
        render(
            '<text x="{x}" y="{y}" class="axis" text-anchor="middle">'
            "requests (oldest left, {n} shown)</text>",
            x=LEFT + plot_w / 2,
            y=HEIGHT - 8,
            n=count,
        )
    )
    legend = render(
        '<p class="legend"><span style="color:{c}">&#9679; client sent (tokens)</span>'
        ' <span style="color:{s}">&#9679; forwarded upstream (tokens)</span></p>',
        c=CLIENT,
        s=SENT,
    )
    svg = render(
        '<svg class="chart" viewBox="0 0 {w} {h}" width="{w}" height="{h}" role="img"'
        ' aria-label="tokens per request">{body}</svg>',
        w=WIDTH,
        h=HEIGHT,
        body=join(parts),
    )
    return Html(legend + svg)


# -- the holdout report: one small chart per measure ---------------------------------------

COHORT_WIDTH, COHORT_BAR_H = 420, 18
COMPACTED, HOLDOUT = SENT, CLIENT


def cohort_chart(label: str, bars: Sequence[tuple[str, float | None, str]], caption: str) -> Html:
    """Both cohorts' means of one measure as two bars from 0, each with its figure
    (`bars`: name, mean, the mean as printed); `caption`, the difference and its interval,
    under them."""
    known = [abs(v) for _, v, _ in bars if v is not None]
    top = max(known, default=0.0) or 1.0
    name_w, bar_w = 90, COHORT_WIDTH - 90 - 80
    parts: list[Html] = []
    for i, (name, value, text) in enumerate(bars):
        y = 6 + i * (COHORT_BAR_H + 6)
        width = bar_w * abs(value) / top if value is not None else 0
        colour = COMPACTED if i == 0 else HOLDOUT
        parts.append(
            render(
                '<text x="0" y="{ty}" class="axis">{name}</text>'
                '<rect x="{x}" y="{y}" width="{w}" height="{h}" fill="{c}"/>'
                '<text x="{tx}" y="{ty}" class="axis">{text}</text>',
                name=name,
                x=name_w,
                y=y,
                w=f"{width:.1f}",
                h=COHORT_BAR_H,
                c=colour,
                tx=f"{name_w + width + 6:.1f}",
                ty=y + COHORT_BAR_H - 5,
                text=text,
            )
        )
    height = 6 + len(bars) * (COHORT_BAR_H + 6)
    svg = render(
        '<svg class="chart cohorts" viewBox="0 0 {w} {h}" width="{w}" height="{h}" role="img"'
        ' aria-label="{label}">{body}</svg>',
        w=COHORT_WIDTH,
        h=height,
        label=label,
        body=join(parts),
    )
    return render(
        '<figure class="measure"><figcaption><b>{label}</b></figcaption>{svg}'
        '<p class="muted">{caption}</p></figure>',
        label=label,
        svg=svg,
        caption=caption,
    )
