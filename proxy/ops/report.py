"""`recap report --tenant T [--since 7d]`: the holdout report as text (or its JSON).

Off the data path: it opens the store as the other operator commands do
(`operator_cli.run`) and prints `archive.holdout.holdout_report`, the same report the web
page's report and the `/metrics` holdout series show (docs/holdout.md).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from typing import Any

from proxy.archive.holdout import (
    DEFAULT_SINCE,
    HoldoutReport,
    figure,
    holdout_report,
    parse_since,
    stamp,
    verdict,
)
from proxy.config import StoreSettings
from proxy.ops.operator_cli import pick_tenant, run
from proxy.planning.cohort import Cohort
from proxy.store import Store


def _table(rows: Sequence[Sequence[str]], right: int) -> list[str]:
    """Columns padded; the columns from `right` on aligned right."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return [
        "  ".join(
            cell.rjust(w) if i >= right else cell.ljust(w)
            for i, (cell, w) in enumerate(zip(r, widths, strict=True))
        ).rstrip()
        for r in rows
    ]


def report_text(report: HoldoutReport) -> str:
    c = report.comparison
    out = [
        f"holdout report: tenant {report.tenant}, {stamp(report.since)} to "
        f"{stamp(report.until)}, holdout share now {report.holdout:g}",
        "",
    ]
    sizes = [("cohort", "conversations", "requests")]
    sizes += [
        (cohort.value, str(n.conversations), str(n.requests)) for cohort, n in c.counts.items()
    ]
    out += _table(sizes, 1)
    if c.mixed:
        out.append(f"({c.mixed} conversation(s) in no single cohort left out)")
    out += [
        "",
        "means per cohort; difference = compacted - holdout, with Welch's 95% interval "
        "(noise: it holds 0)",
    ]
    rows = [("measure", "compacted", "holdout", "difference", "95% interval", "")]
    for row in c.rows:
        i = row.interval
        rows.append(
            (
                f"{row.measure.label} {row.measure.unit}",
                figure(row.compacted.mean),
                figure(row.holdout.mean),
                figure(i.difference) if i else "—",
                f"[{figure(i.low)}, {figure(i.high)}]" if i else "—",
                verdict(i.noise if i else None),
            )
        )
    out += _table(rows, 1)
    if not report.priced:
        out.append("(no cost: the tenant sets no prices)")
    for title, attribute in (("finish reasons", "finishes"), ("upstream errors", "errors")):
        out += ["", f"{title} (answers)"]
        for cohort in Cohort:
            counts = getattr(c.counts[cohort], attribute)
            listed = ", ".join(f"{k} {v}" for k, v in sorted(counts.items())) or "none"
            out.append(f"  {cohort.value:<10} {listed}")
    return "\n".join(out)


def cmd_report(settings: StoreSettings, args: argparse.Namespace) -> int:
    async def work(store: Store) -> int:
        tenant = pick_tenant(settings, args.tenant)
        report = await holdout_report(
            store,
            tenant,
            since=parse_since(args.since, time.time()),
            prices=settings.prices.get(tenant),
            holdout=settings.holdouts.get(tenant, 0.0),
        )
        data: Any = report.as_json()
        print(json.dumps(data, ensure_ascii=False, indent=2) if args.json else report_text(report))
        return 0

    return run(settings, work)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """`recap report`'s own arguments (proxy/ops/cli.py makes the command)."""
    p.add_argument("--tenant", help="needed when the config has several tenants")
    p.add_argument(
        "--since",
        default=DEFAULT_SINCE,
        help="start of the period: an age (7d, 24h, 90m) or a UTC date (2026-12-01); "
        f"default {DEFAULT_SINCE}",
    )
    p.add_argument("--json", action="store_true", help="print the report's JSON")
