"""The operator's `recap` commands: conversations, show, export, rollback, compact, prune,
migrate-store.

Off the data path: each command opens the store the config names, exactly as the server does
(`open_store(settings.store, settings.base_dir)`), so it reads what a running proxy writes
(SQLite in WAL mode lets both in at once). The queries and actions are the ones the
`/v1/recap/` routes answer with (`proxy/archive/inspection.py`, `proxy/archive/export.py`);
this module only chooses the tenant and prints. Every command but `compact` takes only the
config's `StoreSettings`, so it runs without the server's upstream and admin keys; `compact`
calls the summarizer and needs the whole config. What a killed server left in its archive
journal (proxy/archive/journal.py) is stored first, as the server's next start would. Exit
status: 0 done, 1 the operation failed (unknown conversation or version, store down, failed
compaction), 2 bad config or arguments.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any, TextIO

from proxy.archive.archiver import Archiver
from proxy.archive.journal import journal_dir
from proxy.config import Config, StoreSettings
from proxy.errors import RecapError
from proxy.store import Store, StoreError, open_store
from proxy.store.base import ConversationRef


class OperatorError(Exception):
    """A command cannot run as asked; the message says why."""


def pick_tenant(settings: StoreSettings, name: str | None) -> str:
    """The tenant a command is about: the one named, or the config's only one."""
    if name is not None:
        if name not in settings.tenants:
            raise OperatorError(f"no tenant {name!r} in the config")
        return name
    if len(settings.tenants) == 1:
        return settings.tenants[0]
    raise OperatorError(
        f"the config has {len(settings.tenants)} tenants: name one with --tenant "
        f"({', '.join(settings.tenants)})"
    )


def run(
    settings: StoreSettings, work: Callable[[Store], Awaitable[int]], err: TextIO | None = None
) -> int:
    """Open the store, run one command, close it; errors become a message and exit 1."""
    err = err or sys.stderr

    async def main() -> int:
        store = open_store(settings.store, settings.base_dir, pool=settings.store_pool)
        async with store:
            journals = journal_dir(settings.store, settings.archive.journal_dir, settings.base_dir)
            if journals is not None:
                # A server that was killed left records in its journal: store them first,
                # as its next start would (a running server's journal is locked, not read).
                await Archiver(store).replay(journals)
            return await work(store)

    try:
        return asyncio.run(main())
    except (OperatorError, RecapError, StoreError) as exc:
        kind = "store error: " if isinstance(exc, StoreError) else ""
        print(f"recap: {kind}{exc}", file=err)
        return 1


def stamp(t: float | None) -> str:
    return "-" if not t else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


# -- conversations -------------------------------------------------------------------------


def conversations_text(page: dict[str, Any]) -> str:
    rows = [("UPDATED", "TENANT", "KEY", "MESSAGES", "COMPACTIONS", "TOKENS SAVED", "SUMMARY")]
    for c in page["data"]:
        version = c["current_version"]
        rows.append(
            (
                stamp(c["updated_at"]),
                c["tenant"],
                c["key"],
                str(c["message_count"]),
                str(c.get("compactions_made", c["compact_count"])),
                str(c["tokens_saved"]),
                f"v{version}" if version else "-",
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [
        "  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip() for r in rows
    ]
    if page["has_more"]:
        lines.append(f"(more: --cursor {page['next_cursor']})")
    return "\n".join(lines)


# -- show ----------------------------------------------------------------------------------


def show_text(d: dict[str, Any]) -> str:
    out = [
        f"conversation  {d['tenant']} / {d['key']}",
        f"created       {stamp(d['created_at'])}",
        f"updated       {stamp(d['updated_at'])}",
        f"messages      {d['message_count']} archived",
        f"compactions   {d.get('compactions_made', 0)} (every layer), "
        f"{d['compact_count']} summary version(s) made, {d['tokens_saved']} tokens saved",
    ]
    current = d["summary"]
    if current is None:
        out.append("summary       none" + (" (rolled back)" if d["versions"] else ""))
    else:
        out.append(
            f"summary       v{current['version']}: covers {current['covered']} messages, "
            f"{current['summary_chars']} chars, {current['reason']}, model {current['model']}"
        )
        out += ["", *("  " + line for line in current["summary"].splitlines())]
    if d["versions"]:
        out += ["", "versions (* current)"]
        for v in d["versions"]:
            out.append(
                f"{'*' if v['current'] else ' '} v{v['version']:<3} {stamp(v['created_at'])}  "
                f"covers {v['covered']:<4} {v['reason']:<15} "
                f"summarizer {v['input_tokens']} in / {v['output_tokens']} out  {v['model']}"
                + ("  rolled back" if v.get("rolled_back") else "")
            )
    if d["compactions"]:
        out += ["", "history"]
        for c in d["compactions"]:
            detail = f"  ({c['detail']})" if c["detail"] else ""
            out.append(
                f"  {stamp(c['created_at'])}  {c['layer']:<7} {c['outcome']:<7} {c['reason']:<15} "
                f"{c['tokens_before']} -> {c['tokens_after']} tokens  {c['duration_ms']} ms"
                f"{detail}"
            )
    return "\n".join(out)


# -- commands ------------------------------------------------------------------------------


def cmd_conversations(settings: StoreSettings, args: argparse.Namespace) -> int:
    from proxy.archive.inspection import list_page

    async def work(store: Store) -> int:
        tenant = pick_tenant(settings, args.tenant) if args.tenant else None
        page = await list_page(store, tenant, args.limit, args.before, args.cursor)
        print(json.dumps(page, ensure_ascii=False) if args.json else conversations_text(page))
        return 0

    return run(settings, work)


def cmd_show(settings: StoreSettings, args: argparse.Namespace) -> int:
    from proxy.archive.inspection import detail

    async def work(store: Store) -> int:
        conv = ConversationRef(pick_tenant(settings, args.tenant), args.key)
        d = await detail(store, conv)
        print(json.dumps(d, ensure_ascii=False, indent=2) if args.json else show_text(d))
        return 0

    return run(settings, work)


def cmd_export(settings: StoreSettings, args: argparse.Namespace) -> int:
    from proxy.archive.export import export_lines

    async def work(store: Store) -> int:
        conv = ConversationRef(pick_tenant(settings, args.tenant), args.conversation)
        lines = export_lines(store, conv)
        first = await anext(lines)  # a missing conversation fails before the file is made
        out: TextIO = sys.stdout
        if args.output not in (None, "-"):
            out = open(args.output, "w", encoding="utf-8")  # noqa: SIM115 (closed below)
        complete = False
        try:
            out.write(first)
            async for line in lines:
                out.write(line)
                complete = line.startswith('{"type":"end"')
        finally:
            if out is not sys.stdout:
                out.close()
            else:
                out.flush()
        if not complete:
            raise OperatorError("the export is incomplete (see its last line)")
        return 0

    return run(settings, work)


def rollback_target(text: str) -> int | None:
    """VERSION of `recap rollback`: a version number (`3` or `v3`), or `none`."""
    if text.lower() == "none":
        return None
    try:
        version = int(text.removeprefix("v"))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a version number (3 or v3) or none, got {text!r}"
        ) from None
    if version < 1:
        raise argparse.ArgumentTypeError(f"versions start at 1, got {text!r}")
    return version


def cmd_rollback(settings: StoreSettings, args: argparse.Namespace) -> int:
    """What POST /v1/recap/conversations/{key}/rollback does, with the same checks."""
    from proxy.archive.inspection import parse_version, rollback

    async def work(store: Store) -> int:
        conv = ConversationRef(pick_tenant(settings, args.tenant), args.key)
        version = parse_version({"version": args.version})
        # The rollback event names the call that made it, as the route's names its request.
        result = await rollback(store, conv, version, f"cli-{secrets.token_hex(6)}")

        def named(v: int | None) -> str:
            return f"v{v}" if v is not None else "none"

        print(
            f"rolled back {conv.tenant} / {conv.key}: summary {named(result['from'])} \u2192 "
            f"{named(result['to'])}"
        )
        print(
            "later versions stay stored, marked rolled back, and are never used again; "
            "a server on this store uses the new current version from its next request "
            "(on SQLite within 2 s)"
        )
        return 0

    return run(settings, work)


def cmd_compact(config: Config, args: argparse.Namespace) -> int:
    from proxy.app import load_scenes, upstream_pool
    from proxy.history.tokens import TokenCounter
    from proxy.stages.manual import compact_now
    from proxy.stages.session import SessionStage
    from proxy.stages.summarize import Summarizer

    scenes = load_scenes(config)

    async def work(store: Store) -> int:
        tenant = config.tenants[pick_tenant(config.store_settings(), args.tenant)]
        upstreams = upstream_pool(config)
        try:
            stage = SessionStage(
                store, Summarizer(upstreams, config.tenants), scenes, TokenCounter(), config.tenants
            )
            conv = ConversationRef(tenant.name, args.key)
            # No client here: the summarizer uses the upstream's own api_key, if any.
            result = await compact_now(store, stage, config, tenant, conv, None)
        finally:
            await upstreams.aclose()
        print(
            f"compacted {conv.tenant} / {conv.key}: summary v{result.version} covers "
            f"{result.covered} messages; {result.tokens_before} -> {result.tokens_after} tokens"
        )
        print(result.summary)
        return 0

    return run(config.store_settings(), work)


def idle_days(text: str) -> float:
    """--older-than-days: a number of days, more than 0. Zero is refused, not read as "keep
    forever" (the config's meaning) nor as "everything": it would also delete the
    conversations in use, whose archived messages a running server believes are on disk."""
    try:
        days = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of days, got {text!r}") from None
    if not days > 0 or days == float("inf"):
        raise argparse.ArgumentTypeError(
            f"must be more than 0 days, got {text!r} (0 would delete every conversation, "
            "even those in use; 0.04 days is about an hour)"
        )
    return days


def cmd_prune(settings: StoreSettings, args: argparse.Namespace) -> int:
    from proxy.archive.retention import prune

    days = settings.archive.retention_days if args.older_than_days is None else args.older_than_days
    if days <= 0:
        print(
            "recap: archive.retention_days is 0 (keep forever): nothing pruned; "
            "--older-than-days N prunes conversations idle for N days"
        )
        return 0

    async def work(store: Store) -> int:
        pruned = await prune(store, days)
        print(f"pruned {pruned} conversation(s) idle for over {days:g} day(s)")
        return 0

    return run(settings, work)


def cmd_migrate_store(args: argparse.Namespace) -> int:
    """Copy one store into another, empty one (`proxy/store/transfer.py`); no config needed."""
    from proxy.store.pg_boundary import redact
    from proxy.store.transfer import copy_store, require_existing

    async def main() -> dict[str, int]:
        # Relative sqlite paths are relative to where the command runs.
        source = open_store(args.source, os.getcwd())
        target = open_store(args.target, os.getcwd())
        require_existing(source)
        async with source, target:
            return await copy_store(source, target)

    try:
        counts = asyncio.run(main())
    except StoreError as exc:
        print(f"recap: store error: {exc}", file=sys.stderr)
        return 1
    copied = ", ".join(f"{n} {table}" for table, n in counts.items())
    print(f"copied {redact(args.source)} -> {redact(args.target)}: {copied}")
    return 0


Loader = Callable[[Callable[[Any, argparse.Namespace], int]], Callable[[argparse.Namespace], int]]


def add_commands(sub: Any, with_config: Loader, with_store: Loader) -> None:
    """Register the operator commands on the `recap` parser's subcommands. `with_store`
    gives a command the config's `StoreSettings`, `with_config` the whole config."""

    def command(
        name: str,
        help: str,
        func: Callable[[Any, argparse.Namespace], int],
        load: Loader = with_store,
    ) -> Any:
        p = sub.add_parser(name, help=help)
        p.add_argument("--config", help="config file (default: $RECAP_CONFIG or ./config.yaml)")
        p.set_defaults(func=load(func))
        return p

    p = command("conversations", "list conversations, newest first", cmd_conversations)
    p.add_argument("--tenant", help="only this tenant (default: all)")
    p.add_argument("--limit", type=int, default=50)
    p.add_argument("--cursor", help="continue a listing (the next_cursor it printed)")
    p.add_argument("--before", type=float, help="only conversations updated before this time")
    p.add_argument("--json", action="store_true", help="print the API's JSON")

    p = command("show", "a conversation's summary, versions and compactions", cmd_show)
    p.add_argument("key")
    p.add_argument("--tenant", help="needed when the config has several tenants")
    p.add_argument("--json", action="store_true", help="print the API's JSON")

    p = command("export", "write a conversation's archive as JSON Lines", cmd_export)
    p.add_argument("--conversation", required=True, metavar="KEY")
    p.add_argument("--tenant", help="needed when the config has several tenants")
    p.add_argument("-o", "--output", help="file to write (default: stdout)")

    p = command(
        "rollback",
        "make an earlier summary version current (or none); later ones are marked rolled back",
        cmd_rollback,
    )
    p.add_argument("key")
    p.add_argument(
        "version", type=rollback_target, metavar="VERSION", help="a version number, or none"
    )
    p.add_argument("--tenant", help="needed when the config has several tenants")

    # The one command that calls an upstream (the summarizer): the whole config.
    p = command(
        "compact",
        "compact a conversation now (session rules, reason manual)",
        cmd_compact,
        with_config,
    )
    p.add_argument("key")
    p.add_argument("--tenant", help="needed when the config has several tenants")

    p = command("prune", "delete conversations idle past archive.retention_days", cmd_prune)
    p.add_argument(
        "--older-than-days",
        type=idle_days,
        metavar="N",
        help="prune conversations idle for over N days (more than 0; fractions allowed), "
        "instead of archive.retention_days",
    )

    p = sub.add_parser(
        "migrate-store",
        help="copy everything from one store into another, empty one (e.g. SQLite -> PostgreSQL)",
    )
    p.add_argument("source", metavar="FROM", help="store URL to copy from (sqlite:///... )")
    p.add_argument("target", metavar="TO", help="store URL to copy into (postgresql://...)")
    p.set_defaults(func=cmd_migrate_store)
