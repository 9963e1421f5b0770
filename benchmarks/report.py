"""The replay's output: Markdown tables, target verdicts, JSON, and the two PNG plots.

Outside the data path: `benchmarks.replay` hands over the figures of every strategy on every
input set, and the per-step series of one long session; this module only formats them.
matplotlib (the optional `bench` extra) is imported only for the plots; without it the plots
are skipped with a message.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from benchmarks.harness import percentile
from benchmarks.metrics import Figures

# Targets of issue 6, checked on the chained sessions (reported, never asserted).
NET_RATIO_MAX = 0.35
CACHE_BETWEEN_MIN = 0.8
SUMMARIZER_PER100_MAX = 5.0


COLUMNS = (
    "Columns: tokens are Recap's own estimate (o200k_base); *net* adds the summarizer's input "
    "and output tokens to what went upstream; *overflows* are requests whose input alone is "
    "over the window; *compactions* are steps with a summarizer call; a *prefix rewrite* is a "
    "request that does not start with the whole previous request; *added ms* is the time "
    "through the proxy minus the fake upstream's own time (for the in-process baselines, in "
    "parentheses, the function's own time); *cache hit* is the token share of each request "
    "equal to the previous request's leading messages (what a provider's prefix cache reuses), "
    "*between compactions* without the steps that called the summarizer and the first request "
    "of each conversation; *invalid* counts histories `proxy.history.conversation.check_history` "
    "rejects; *facts retained*: arguments of the gold write actions whose first mention was "
    "compacted away and that still appear in what was sent at the step that makes the call."
)


@dataclass
class Series:
    """One strategy on the plotted session: tokens sent and summarizer tokens per step."""

    strategy: str
    sent: list[int]
    summarizer: list[int]


def _k(n: float) -> str:
    if n >= 1e6:
        return f"{n / 1e6:.2f}M"
    return f"{n / 1e3:.1f}K" if n >= 1e4 else f"{n:.0f}"


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.1%}" if b else "—"


def _ms(f: Figures) -> str:
    if f.added_ms:
        return f"{percentile(f.added_ms, 50):.1f} / {percentile(f.added_ms, 99):.1f}"
    if f.compute_ms:
        return f"({percentile(f.compute_ms, 50):.2f} / {percentile(f.compute_ms, 99):.2f})"
    return "—"


def _retained(f: Figures) -> str:
    if not f.facts_checked:
        return "—"
    if not f.facts_at_risk:
        return f"none at risk (of {f.facts_checked})"
    return f"{f.facts_retained}/{f.facts_at_risk} = {f.facts_retained / f.facts_at_risk:.0%}"


def table(figures: Sequence[Figures]) -> str:
    base = next((f for f in figures if f.strategy == "none"), None)
    none = base.upstream_tokens if base else 0
    lines = [
        "| strategy | upstream tokens | vs none | summarizer in / out | net vs none "
        "| largest request / window | overflows | compactions /100 steps "
        "| summarizer calls /100 | prefix rewrites /100 | added ms p50 / p99 "
        "| cache hit | cache hit between compactions | invalid | facts retained (at risk) |",
        "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for f in figures:
        lines.append(
            f"| {f.strategy} | {_k(f.upstream_tokens)} | {_ratio(f.upstream_tokens, none)} "
            f"| {_k(f.summarizer_in)} / {_k(f.summarizer_out)} | {_ratio(f.net_tokens, none)} "
            f"| {_k(f.max_request)} / {_k(f.window)} = {f.max_request / f.window:.2f} "
            f"| {f.overflows} | {f.per100(f.compaction_steps):.1f} "
            f"| {f.per100(f.summarizer_calls):.1f} | {f.per100(f.rewrites):.1f} | {_ms(f)} "
            f"| {f.cache_hit:.2f} | {f.cache_hit_between:.2f} | {f.invalid} | {_retained(f)} |"
        )
    return "\n".join(lines)


def billed(figures: Sequence[Figures]) -> str:
    """Net tokens when cached input is billed at a discount (50%: OpenAI's automatic prefix
    caching; 90%: Anthropic's cache reads), relative to no compaction without a cache."""
    base = next((f for f in figures if f.strategy == "none"), None)
    none = base.upstream_tokens if base else 0
    lines = [
        "| strategy | net tokens | cached input billed at 50% | at 10% |",
        "|---|--:|--:|--:|",
    ]
    for f in figures:
        paid = [f.net_tokens - discount * f.cached_tokens for discount in (0.0, 0.5, 0.9)]
        cells = [f"{_k(p)} ({_ratio(p, none)})" for p in paid]
        lines.append(f"| {f.strategy} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def verdicts(figures: Sequence[Figures]) -> list[tuple[bool, str]]:
    """The issue's targets for each Recap run on one input set: (met, description)."""
    base = next((f for f in figures if f.strategy == "none"), None)
    out: list[tuple[bool, str]] = []
    if base is None:
        return out
    for f in figures:
        if not f.strategy.startswith("recap"):
            continue
        net = f.net_tokens / base.upstream_tokens
        calls = f.per100(f.summarizer_calls)
        checks = [
            (net <= NET_RATIO_MAX, f"net tokens {net:.1%} of none (target <= 35%)"),
            (f.overflows == 0, f"{f.overflows} overflows (target 0)"),
            (f.invalid == 0, f"{f.invalid} invalid histories (target 0)"),
            (
                f.cache_hit_between >= CACHE_BETWEEN_MIN,
                f"cache hit between compactions {f.cache_hit_between:.2f} (target >= 0.8)",
            ),
            (
                calls <= SUMMARIZER_PER100_MAX,
                f"{calls:.1f} summarizer calls per 100 steps (target <= 5)",
            ),
        ]
        if f.retention is not None:
            wanted = "guard off: reported" if "noguard" in f.strategy else "target 100%"
            checks.append(
                (
                    f.retention == 1.0 or "noguard" in f.strategy,
                    f"fact retention {f.retention:.1%} ({wanted})",
                )
            )
        out += [(ok, f"{f.strategy}: {text}") for ok, text in checks]
    return out


def markdown(
    head: Sequence[str],
    sets: Mapping[str, tuple[str, Sequence[Figures]]],
    notes: Sequence[str],
    targets_set: str,
) -> str:
    parts = [*head, ""]
    for name, (title, figures) in sets.items():
        parts += [f"### {title}", "", table(figures), ""]
        if name == targets_set:
            parts += [
                "What the same requests would bill with a provider's prompt cache (cached "
                "input tokens at a discount; percentages of no compaction without a cache):",
                "",
                billed(figures),
                "",
            ]
            parts += ["Targets set for this evaluation, on this input set:", ""]
            parts += [f"- {'met' if ok else '**missed**'}: {t}" for ok, t in verdicts(figures)]
            parts.append("")
    parts += notes
    return "\n".join(parts).rstrip() + "\n"


def details(figures: Mapping[str, Mapping[str, Figures]]) -> list[str]:
    """Notes under the tables: lost facts, invalid histories, last-resort drops."""
    notes = ["### Details", ""]
    for set_name, by_strategy in figures.items():
        for f in by_strategy.values():
            if f.drop_steps:
                notes.append(
                    f"- {set_name}, {f.strategy}: the last-resort fit dropped raw messages at "
                    f"{f.drop_steps} of {f.steps} steps"
                )
            if f.facts_lost:
                lost = ", ".join(f.facts_lost[:6])
                extra = f.facts_at_risk - f.facts_retained - min(len(f.facts_lost), 6)
                more = f" and {extra} more" if extra > 0 else ""
                notes.append(f"- {set_name}, {f.strategy}: facts lost: {lost}{more}")
            notes += [f"- {set_name}, {f.strategy}: invalid: {e}" for e in f.invalid_examples[:2]]
    return notes if len(notes) > 2 else [*notes, "- nothing lost, nothing invalid, no drops."]


def have_matplotlib() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


def plots(
    series: Sequence[Series], window: int, title: str, out_dir: Path, stem: str = "replay"
) -> tuple[Path, Path] | None:
    """tokens per step (the saw-tooth) and cumulative tokens, as STEM-tokens.png and
    STEM-cumulative.png; None without matplotlib."""
    if not have_matplotlib():
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    styles = {
        "none": ("#7f7f7f", "-"),
        "window": ("#bcbd22", "-"),
        "middle-out": ("#17becf", "-"),
        "recap": ("#d62728", "-"),
        "recap-noguard": ("#ff9896", ":"),
        "recap-cache": ("#1f77b4", "-"),
    }
    tokens_png, cumulative_png = out_dir / f"{stem}-tokens.png", out_dir / f"{stem}-cumulative.png"

    fig, ax = plt.subplots(figsize=(10, 5.2), dpi=110)
    for s in series:
        if s.strategy == "recap-noguard":
            continue  # the same curve as recap, give or take a few characters of summary
        color, line = styles.get(s.strategy, ("#9467bd", "--"))
        ax.plot(range(1, len(s.sent) + 1), s.sent, line, color=color, lw=1.2, label=s.strategy)
    ax.axhline(window, color="black", lw=0.8, ls="--")
    ax.text(1, window * 1.02, f"context window {window}", fontsize=8, va="bottom")
    top = max([window * 1.25] + [max(s.sent) * 1.05 for s in series if s.strategy != "none"])
    ax.set_ylim(0, top)
    ax.set_xlabel("step (model call) in the session")
    ax.set_ylabel("input tokens sent upstream")
    ax.set_title(f"Tokens per request: {title}\n(no compaction runs off the top of the chart)")
    ax.legend(loc="upper right", fontsize=8, ncols=3)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(tokens_png)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(10, 5.2), dpi=110)
    for s in series:
        color, line = styles.get(s.strategy, ("#9467bd", "--"))
        total, running = [], 0
        for sent, summ in zip(s.sent, s.summarizer, strict=True):
            running += sent + summ
            total.append(running / 1e6)
        label = s.strategy + (" (incl. summarizer)" if any(s.summarizer) else "")
        ax.plot(range(1, len(total) + 1), total, line, color=color, lw=1.4, label=label)
    ax.set_xlabel("step (model call) in the session")
    ax.set_ylabel("cumulative tokens (millions)")
    ax.set_title(f"Cumulative tokens, upstream + summarizer: {title}")
    ax.legend(loc="upper left", fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(cumulative_png)
    plt.close(fig)
    return tokens_png, cumulative_png
