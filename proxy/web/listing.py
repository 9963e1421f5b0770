"""The front page, `/recap/`: conversations per tenant, newest first, a page at a time.

Pure rendering over `inspection.list_page`'s result (the JSON route's listing):
each row shows the messages archived, compactions, the current summary version,
and the tokens compaction saved.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from itertools import groupby
from typing import Any

from proxy.web.layout import conversation_url, page, url
from proxy.web.markup import Html, join, render


def when(epoch: float | None) -> str:
    if not epoch:
        return "—"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(epoch)) + " UTC"


def number(value: Any) -> str:
    return f"{value:,}" if isinstance(value, int) and not isinstance(value, bool) else "—"


def _row(c: dict[str, Any]) -> Html:
    version = c.get("current_version")
    return render(
        '<tr><td class="key"><a href="{href}">{key}</a></td><td class="num">{messages}</td>'
        '<td class="num">{compactions}</td><td class="num">{version}</td>'
        '<td class="num">{saved}</td><td>{updated}</td></tr>',
        href=conversation_url(c["tenant"], c["key"]),
        key=c["key"],
        messages=number(c.get("message_count")),
        compactions=number(c.get("compactions_made")),
        version=f"v{version}" if version else "none",
        saved=number(c.get("tokens_saved")),
        updated=when(c.get("updated_at")),
    )


def _table(rows: Sequence[dict[str, Any]]) -> Html:
    head = (
        "<tr><th>Conversation</th><th class=num>Messages</th><th class=num>Compactions</th>"
        "<th class=num>Summary version</th><th class=num>Tokens saved</th><th>Updated</th></tr>"
    )
    return render("<table>{head}{rows}</table>", head=Html(head), rows=join(_row(c) for c in rows))


def _report_link(tenant: str) -> Html:
    link = ' <a class="muted" href="{h}">holdout report</a>'
    return render(link, h=url("/report", tenant=tenant))


def list_page(
    listing: dict[str, Any],
    *,
    tenants: Sequence[str],
    shown: str | None,
    who: str,
    csrf: str,
    holdouts: Sequence[str] = (),
) -> Html:
    """`tenants` are those the operator may see; `shown` the one chosen (None: all);
    `holdouts` those that run a holdout (their section links to its report)."""
    nav = Html("")
    if len(tenants) > 1:
        links = [
            render(
                '<a href="{h}" class="{cls}">{n}</a>',
                h=url("/", tenant=t),
                n=t,
                cls="on" if t == shown else "",
            )
            for t in tenants
        ]
        everyone = render(
            '<a href="{h}" class="{cls}">all tenants</a>',
            h=url("/"),
            cls="on" if shown is None else "",
        )
        nav = render(
            '<nav class="tenants">Tenant: {a} {links}</nav>', a=everyone, links=join(links, " ")
        )
    data: list[dict[str, Any]] = listing["data"]
    if not data:
        sections = Html('<p class="muted">No conversations yet.</p>')
    else:
        # The listing is newest first across tenants; group keeps that order per tenant.
        ordered = sorted(data, key=lambda c: str(c["tenant"]))
        sections = join(
            render(
                "<h2>Tenant {t}{report}</h2>{table}",
                t=t,
                report=_report_link(t) if t in holdouts else Html(""),
                table=_table(list(rows)),
            )
            for t, rows in groupby(ordered, key=lambda c: str(c["tenant"]))
        )
    more = Html("")
    if listing.get("has_more") and listing.get("next_before") is not None:
        more = render(
            '<p><a href="{h}">Older conversations →</a></p>',
            h=url("/", tenant=shown, before=listing["next_before"]),
        )
    body = render(
        "<h1>Conversations</h1>{nav}{sections}{more}", nav=nav, sections=sections, more=more
    )
    return page("Conversations", body, who=who, csrf=csrf)
