"""The conversation page: figures, actions, chart, compaction timeline, summaries, one request.

Pure rendering over what the routes read: `inspection.detail` (the JSON detail
route's answer: the conversation, its summary versions and audit rows) and the
`Timeline` of its events. Every form posts to the routes in `routes.py` with the
session's CSRF token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from proxy.web.chart import tokens_chart
from proxy.web.diff import summary_diff
from proxy.web.layout import conversation_url, page, url
from proxy.web.listing import number, when
from proxy.web.markup import Html, join, render
from proxy.web.messages import message_column
from proxy.web.timeline import ChosenRequest, RequestPoint, Timeline

RECENT_REQUESTS = 20


@dataclass(frozen=True)
class ConversationView:
    """Everything the page shows, read by the route."""

    tenant: str
    key: str
    detail: dict[str, Any]
    timeline: Timeline
    chosen: ChosenRequest | None
    # Why the chosen request cannot be shown (e.g. the archive lacks a message).
    chosen_error: str | None
    diff: tuple[int, int] | None
    notice: str | None


def _cards(v: ConversationView) -> Html:
    d = v.detail
    current = d.get("current_version")
    items = [
        ("messages archived", number(d.get("message_count"))),
        ("requests", number(v.timeline.requests)),
        ("compactions", number(d.get("compactions_made"))),
        ("tokens saved", number(d.get("tokens_saved"))),
        ("summary version", f"v{current}" if current else "none"),
        ("updated", when(d.get("updated_at"))),
    ]
    return render(
        '<div class="cards">{c}</div>',
        c=join(render('<div class="card"><b>{v}</b>{k}</div>', k=k, v=val) for k, val in items),
    )


def _hidden(v: ConversationView, csrf: str) -> Html:
    return render(
        '<input type="hidden" name="tenant" value="{t}"><input type="hidden" name="key"'
        ' value="{k}"><input type="hidden" name="csrf" value="{c}">',
        t=v.tenant,
        k=v.key,
        c=csrf,
    )


def _state(version: dict[str, Any]) -> str:
    """The mark after a version's number: current, rolled back (discarded by a rollback, never
    applied again unless named in another), or none; as the JSON detail's fields say."""
    if version.get("current"):
        return " (current)"
    return " (rolled back)" if version.get("rolled_back") else ""


def _actions(v: ConversationView, csrf: str) -> Html:
    versions = v.detail.get("versions") or []
    options = [
        render(
            '<option value="{n}"{sel}>v{n}{state} · {when} · covers {cov} messages</option>',
            n=x["version"],
            sel=Html(" selected") if x.get("current") else Html(""),
            state=_state(x),
            when=when(x.get("created_at")),
            cov=x.get("covered"),
        )
        for x in versions
    ]
    options.append(Html('<option value="">none (no summary)</option>'))
    compact = render(
        '<form method="post" action="{a}">{h}<button class="primary" type="submit"'
        ' id="compact">Compact now</button></form>',
        a=url("/compact"),
        h=_hidden(v, csrf),
    )
    rollback = render(
        '<form method="post" action="{a}">{h}<label for="version">Roll back to</label>'
        '<select id="version" name="version">{o}</select>'
        '<button class="danger" type="submit" id="rollback">Roll back</button></form>',
        a=url("/rollback"),
        h=_hidden(v, csrf),
        o=join(options),
    )
    return render('<div class="actions">{c}{r}</div>', c=compact, r=rollback)


def _timeline(v: ConversationView) -> Html:
    rows: list[tuple[float, Html]] = []
    for c in v.detail.get("compactions") or []:
        rows.append(
            (
                float(c.get("created_at") or 0),
                render(
                    '<tr class="{o}"><td>{when}</td><td>{layer}</td><td>{reason}</td>'
                    '<td class="outcome">{o}</td><td>{detail}</td>'
                    '<td class="num">{before} → {after}</td><td class="num">{saved}</td>'
                    '<td class="num">{cb} → {ca}</td>'
                    '<td>{model}</td><td class="num">{ms} ms</td></tr>',
                    o=c.get("outcome"),
                    when=when(c.get("created_at")),
                    layer=c.get("layer"),
                    reason=c.get("reason"),
                    detail=c.get("detail"),
                    before=number(c.get("tokens_before")),
                    after=number(c.get("tokens_after")),
                    saved=number(c.get("tokens_saved")),
                    cb=number(c.get("chars_before")),
                    ca=number(c.get("chars_after")),
                    model=c.get("model"),
                    ms=number(c.get("duration_ms")),
                ),
            )
        )
    for r in v.timeline.rollbacks:
        frm = f"v{r.version_from}" if r.version_from else "none"
        to = f"v{r.version_to}" if r.version_to else "none"
        rows.append(
            (
                r.created_at,
                render(
                    '<tr class="rollback"><td>{when}</td><td>rollback</td><td>operator</td>'
                    '<td class="outcome">ok</td><td colspan="6">summary {f} → {t}</td></tr>',
                    when=when(r.created_at),
                    f=frm,
                    t=to,
                ),
            )
        )
    if not rows:
        return Html('<p class="muted">No compaction yet.</p>')
    rows.sort(key=lambda row: row[0])
    head = Html(
        "<tr><th>Time</th><th>Layer</th><th>Reason</th><th>Outcome</th><th>Detail</th>"
        "<th class=num>Tokens</th><th class=num>Saved</th><th class=num>Characters</th>"
        "<th>Model</th><th class=num>Took</th></tr>"
    )
    return render('<table id="timeline">{h}{r}</table>', h=head, r=join(r for _, r in rows))


def _summaries(v: ConversationView) -> Html:
    versions: list[dict[str, Any]] = v.detail.get("versions") or []
    current = v.detail.get("summary")
    text = (
        render('<div class="summary" id="summary"><pre>{s}</pre></div>', s=current["summary"])
        if current
        else Html('<p class="muted" id="summary">No current summary.</p>')
    )
    if not versions:
        return text
    rows = join(
        render(
            '<tr class="{cls}"><td>v{n}{state}</td><td>{when}</td><td class="num">{cov}</td>'
            '<td class="num">{chars}</td><td class="num">{tin} / {tout}</td><td>{model}</td>'
            "<td>{reason}</td></tr>",
            cls="rolled-back" if x.get("rolled_back") else "",
            n=x["version"],
            state=_state(x),
            when=when(x.get("created_at")),
            cov=number(x.get("covered")),
            chars=number(x.get("summary_chars")),
            tin=number(x.get("input_tokens")),
            tout=number(x.get("output_tokens")),
            model=x.get("model"),
            reason=x.get("reason"),
        )
        for x in versions
    )
    table = render(
        '<table id="versions"><tr><th>Version</th><th>Made</th><th class=num>Covers messages</th>'
        "<th class=num>Characters</th><th class=num>Summarizer tokens in / out</th>"
        "<th>Model</th><th>Reason</th></tr>{rows}</table>",
        rows=rows,
    )
    diff = Html("")
    if len(versions) > 1:
        numbers = [int(x["version"]) for x in versions]
        old, new = v.diff or (numbers[-2], numbers[-1])

        def select(name: str, chosen: int) -> Html:
            return render(
                '<select name="{n}">{o}</select>',
                n=name,
                o=join(
                    render(
                        '<option value="{x}"{s}>v{x}</option>',
                        x=x,
                        s=Html(" selected") if x == chosen else Html(""),
                    )
                    for x in numbers
                ),
            )

        by_number = {int(x["version"]): str(x["summary"]) for x in versions}
        form = render(
            '<form method="get" action="{a}" class="actions"><input type="hidden" name="tenant"'
            ' value="{t}"><input type="hidden" name="key" value="{k}">'
            "Diff {o} → {n} <button type=submit>Show</button></form>",
            a=url("/conversation"),
            t=v.tenant,
            k=v.key,
            o=select("from", old),
            n=select("to", new),
        )
        body = (
            summary_diff(by_number[old], by_number[new], f"v{old}", f"v{new}")
            if old in by_number and new in by_number
            else Html('<p class="error">No such version.</p>')
        )
        diff = render("<h3>Diff between versions</h3>{f}{b}", f=form, b=body)
    return render("{t}<h3>Versions</h3>{table}{diff}", t=text, table=table, diff=diff)


def _requests(v: ConversationView) -> Html:
    chosen = v.chosen.point.event_id if v.chosen else None
    recent = list(reversed(v.timeline.points[-RECENT_REQUESTS:]))
    if not recent:
        return Html('<p class="muted">No archived request.</p>')
    rows = join(
        render(
            '<tr class="{cls}"><td><a href="{h}">{id}</a></td><td>{when}</td><td>{cl}</td>'
            '<td>{model}</td><td>{layers}</td><td class="num">{a}</td><td class="num">{b}</td>'
            "</tr>",
            cls="chosen" if p.event_id == chosen else "",
            h=_request_link(v, p),
            id=p.request_id or p.event_id,
            when=when(p.created_at),
            cl=p.classification,
            model=p.model,
            layers=p.shaped_by or "—",
            a=number(p.tokens_client),
            b=number(p.tokens_sent),
        )
        for p in recent
    )
    return render(
        '<table id="requests"><tr><th>Request</th><th>Time</th><th>Kind</th><th>Model</th>'
        "<th>Layers</th><th class=num>Client tokens</th><th class=num>Sent tokens</th></tr>"
        "{rows}</table>",
        rows=rows,
    )


def _request_link(v: ConversationView, p: RequestPoint) -> str:
    return conversation_url(v.tenant, v.key, request=p.event_id) + "#saw"


def _window(p: RequestPoint) -> Html:
    """The window the planners decided with beside the configured one: calibration from the
    upstream's usage (and the tool definitions) can make it smaller."""
    if p.window is None:
        return Html("")
    return render(
        ' · <span id="window">window {w} tokens (configured {c})</span>',
        w=number(p.window),
        c=number(p.configured_window),
    )


def _saw(v: ConversationView) -> Html:
    if v.chosen_error:
        return render('<p class="error">{e}</p>', e=v.chosen_error)
    if v.chosen is None:
        return Html('<p class="muted">No archived request.</p>')
    c = v.chosen
    client_fps = {fp for fp, _ in c.client}
    sent_fps = {fp for fp, _ in c.sent}
    meta = render(
        "<p>Request <b>{id}</b> · {when} · {cl} · layers: {layers} · {a} → {b} tokens{w}</p>",
        id=c.point.request_id or c.point.event_id,
        when=when(c.point.created_at),
        cl=c.point.classification,
        layers=c.point.shaped_by or "none",
        a=number(c.point.tokens_client),
        b=number(c.point.tokens_sent),
        w=_window(c.point),
    )
    return render(
        '{meta}<div class="sides"><div id="model-saw"><h3>What the model saw ({n} messages)</h3>'
        '{saw}</div><div id="client-sent"><h3>What the client sent ({m} messages)</h3>{sent}'
        "</div></div>",
        meta=meta,
        n=len(c.sent),
        m=len(c.client),
        saw=message_column(c.sent, client_fps, "synthetic"),
        sent=message_column(c.client, sent_fps, "folded", c.dropped),
    )


def conversation_page(v: ConversationView, *, who: str, csrf: str) -> Html:
    notice = render('<p class="notice" id="notice">{n}</p>', n=v.notice) if v.notice else Html("")
    body = render(
        '<p><a href="{home}">← Conversations</a> · tenant {tenant}</p><h1>{key}</h1>{notice}'
        "{cards}{actions}<h2>Tokens per request</h2>{chart}"
        "<h2>Compaction timeline</h2>{timeline}<h2>Summary</h2>{summaries}"
        '<h2 id="saw">What the model saw</h2>{requests}{saw}',
        home=url("/", tenant=v.tenant),
        tenant=v.tenant,
        key=v.key,
        notice=notice,
        cards=_cards(v),
        actions=_actions(v, csrf),
        chart=tokens_chart(v.timeline.points, lambda p: _request_link(v, p)),
        timeline=_timeline(v),
        summaries=_summaries(v),
        requests=_requests(v),
        saw=_saw(v),
    )
    return page(v.key, body, who=who, csrf=csrf)
