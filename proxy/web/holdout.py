"""The report page, `/recap/report?tenant=T&since=7d`: a tenant's holdout cohorts compared.

Pure rendering over `archive.holdout.holdout_report` (what `recap report` prints and the
`/metrics` holdout series show): each cohort's size, then a chart per measure with both
cohorts' means and the difference's Welch interval, then the answers' finish reasons and
upstream errors.
"""

from __future__ import annotations

from proxy.archive.holdout import HoldoutReport, figure, stamp, verdict
from proxy.planning.cohort import Cohort
from proxy.web.chart import cohort_chart
from proxy.web.layout import page, url
from proxy.web.markup import Html, join, render


def _sizes(report: HoldoutReport) -> Html:
    rows = [
        render(
            '<tr><td>{cohort}</td><td class="num">{conversations}</td>'
            '<td class="num">{requests}</td></tr>',
            cohort=cohort.value,
            conversations=n.conversations,
            requests=n.requests,
        )
        for cohort, n in report.comparison.counts.items()
    ]
    return render(
        "<table><tr><th>Cohort</th><th class=num>Conversations</th>"
        "<th class=num>Requests</th></tr>{rows}</table>",
        rows=join(rows),
    )


def _counts(report: HoldoutReport, attribute: str) -> Html:
    rows = []
    for cohort in Cohort:
        counts = getattr(report.comparison.counts[cohort], attribute)
        listed = ", ".join(f"{k} {v}" for k, v in sorted(counts.items())) or "none"
        rows.append(render("<tr><td>{c}</td><td>{listed}</td></tr>", c=cohort.value, listed=listed))
    return render("<table>{rows}</table>", rows=join(rows))


def report_section(report: HoldoutReport) -> Html:
    """The report as a section of the page."""
    c = report.comparison
    charts = []
    for row in c.rows:
        i = row.interval
        caption = (
            f"difference {figure(i.difference)} [{figure(i.low)}, {figure(i.high)}]: "
            f"{verdict(i.noise)}"
            if i
            else "difference: too few conversations for an interval"
        )
        charts.append(
            cohort_chart(
                f"{row.measure.label} {row.measure.unit}",
                [
                    (f"{name} ({s.n})", s.mean, figure(s.mean))
                    for name, s in (("compacted", row.compacted), ("holdout", row.holdout))
                ],
                caption,
            )
        )
    mixed = (
        render('<p class="muted">{n} conversation(s) in no single cohort left out.</p>', n=c.mixed)
        if c.mixed
        else Html("")
    )
    priced = (
        Html("")
        if report.priced
        else Html('<p class="muted">No cost: the tenant sets no prices.</p>')
    )
    return render(
        '<section class="holdout"><h2>Holdout report</h2>'
        '<p class="muted">Tenant {tenant}, {since} to {until}, holdout share now {share}. '
        "Means per conversation in each cohort; the difference is compacted minus holdout, "
        "with Welch's 95% interval: an interval that holds 0 is noise.</p>"
        "{sizes}{mixed}<div class=measures>{charts}</div>{priced}"
        "<h2>Finish reasons (answers)</h2>{finishes}<h2>Upstream errors (answers)</h2>{errors}"
        "</section>",
        tenant=report.tenant,
        since=stamp(report.since),
        until=stamp(report.until),
        share=f"{report.holdout:g}",
        sizes=_sizes(report),
        mixed=mixed,
        charts=join(charts),
        priced=priced,
        finishes=_counts(report, "finishes"),
        errors=_counts(report, "errors"),
    )


def report_page(report: HoldoutReport, since: str, *, who: str, csrf: str) -> Html:
    form = render(
        '<form class="actions" method="get" action="{action}">'
        '<input type="hidden" name="tenant" value="{tenant}">'
        '<label>Since <input name="since" value="{since}" size="12"></label>'
        '<button type="submit">Show</button></form>',
        action=url("/report"),
        tenant=report.tenant,
        since=since,
    )
    body = render(
        "<h1>Holdout: tenant {tenant}</h1>{form}{section}",
        tenant=report.tenant,
        form=form,
        section=report_section(report),
    )
    return page(f"Holdout report {report.tenant}", body, who=who, csrf=csrf)
