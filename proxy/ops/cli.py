"""The `recap` command: serve, init and tail here; the operator's commands (conversations,
show, export, rollback, compact, prune, migrate-store) live in `operator_cli.py`, the holdout
report in `report.py`, and are registered below."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable, Sequence
from importlib.resources import files
from pathlib import Path

from proxy.config import Config, ConfigError, StoreSettings, load_config, load_store_settings
from proxy.stages.scenes import SceneError


def _config_path(arg: str | None) -> str:
    path = arg or os.environ.get("RECAP_CONFIG") or "config.yaml"
    if not Path(path).exists():
        raise ConfigError(
            f"cannot read config {path}: no such file (`recap init` writes a commented one; "
            "or name yours with --config PATH or $RECAP_CONFIG)"
        )
    return path


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from proxy.app import create_app, load_scenes
    from proxy.edge.serving import protocol_for
    from proxy.ops.admin_key import provide_admin_key
    from proxy.ops.lifecycle import LoggedServer
    from proxy.ops.logs import configure_logging

    config = load_config(_config_path(args.config))
    load_scenes(config)  # a missing or invalid scene stops here with its name
    configure_logging(args.log_format, args.log_level.upper())
    # With no admin_keys, the key file's key (made on a first start) opens the page: it
    # joins the config this app is built from, and only that app holds it.
    config, key = provide_admin_key(config)
    for problem in (key.warning, key.problem):
        if problem:
            logging.getLogger("recap.server").warning("admin key: %s", problem)
    host = args.host or config.listen.host
    port = args.port if args.port is not None else config.listen.port
    server = LoggedServer(
        config,
        uvicorn.Config(
            create_app(config),
            host=host,
            port=port,
            # httptools (or h11) with deadlines and a bound on open connections
            # (proxy/edge/guards.py), on asyncio's loop even where uvloop is installed: on
            # uvloop a crowd of unread streams pushed real clients out (docs/benchmarks.md).
            http=protocol_for(config.listen),
            loop="asyncio",
            log_config=None,  # our own logging; uvicorn's access log would duplicate ours
            access_log=False,
            timeout_graceful_shutdown=10,
            # Longer than clients keep idle connections (httpx and the openai SDK: 5 s), so a
            # client never sends a request on a connection the proxy is closing (uvicorn's
            # default is also 5 s: a reset on a good request, now and then).
            timeout_keep_alive=75,
            # A proxy passes the upstream's Date and Server; uvicorn's would duplicate them.
            server_header=False,
            date_header=False,
        ),
        key,
    )
    server.run()
    return 0 if server.started else 1


# What a new operator edits in the config `recap init` writes, and why.
TO_EDIT = (
    ("tenants.default.upstream.base_url", "the API to forward to; or set OPENAI_BASE_URL"),
    (
        "tenants.default.upstream.api_key",
        "its key; or set OPENAI_API_KEY (empty: each client's own key is forwarded)",
    ),
    ("models", "your models' context windows (others get default_context_window, 96000)"),
    ("admin_keys", "keys for the web page; with none, the first start makes one"),
)


def cmd_init(args: argparse.Namespace) -> int:
    """Write the commented default config into DIR; never over an existing file."""
    target = Path(args.dir) / "config.yaml"
    text = (files("proxy") / "config_default.yaml").read_text(encoding="utf-8")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with target.open("x", encoding="utf-8") as out:
            out.write(text)
    except FileExistsError:
        print(f"recap: {target} exists: not overwritten (move it away first)", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"recap: cannot write {target}: {exc.strerror}", file=sys.stderr)
        return 1
    width = max(len(key) for key, _ in TO_EDIT)
    print(f"wrote {target}; edit it (every key: docs/configuration.md):")
    for key, why in TO_EDIT:
        print(f"  {key:<{width}}  {why}")
    serve = "recap serve" if args.dir == "." else f"recap serve --config {target}"
    print(f"then start it: {serve}")
    return 0


def cmd_tail(args: argparse.Namespace) -> int:
    from proxy.ops.ansi import Style
    from proxy.ops.logs import wants_colour
    from proxy.ops.tail import tail

    colour = {"always": True, "never": False}.get(args.color, wants_colour(sys.stdout))
    stream = sys.stdin if args.file in (None, "-") else open(args.file, encoding="utf-8")  # noqa: SIM115
    try:
        tail(
            stream,
            sys.stdout,
            conversation=args.conversation,
            follow=args.follow,
            tenant=args.tenant,
            raw=args.json,
            style=Style(colour),
        )
    except KeyboardInterrupt:
        pass
    finally:
        if stream is not sys.stdin:
            stream.close()
    return 0


def with_config(
    func: Callable[[Config, argparse.Namespace], int],
) -> Callable[[argparse.Namespace], int]:
    """The whole config, every `${VAR}` resolved: for commands that call an upstream."""

    def command(args: argparse.Namespace) -> int:
        return func(load_config(_config_path(args.config)), args)

    return command


def with_store(
    func: Callable[[StoreSettings, argparse.Namespace], int],
) -> Callable[[argparse.Namespace], int]:
    """Only the store keys (and the tenants' names): no upstream or admin key is needed."""

    def command(args: argparse.Namespace) -> int:
        return func(load_store_settings(_config_path(args.config)), args)

    return command


def build_parser() -> argparse.ArgumentParser:
    from proxy.ops.operator_cli import add_commands
    from proxy.ops.report import add_arguments as report_arguments
    from proxy.ops.report import cmd_report

    parser = argparse.ArgumentParser(prog="recap", description="Recap: a context-compaction proxy.")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the proxy")
    serve.add_argument("--config", help="config file (default: $RECAP_CONFIG or ./config.yaml)")
    serve.add_argument("--host")
    serve.add_argument("--port", type=int)
    serve.add_argument(
        "--log-format",
        choices=["json", "text"],
        default=None,
        help="default: text on a terminal, json otherwise",
    )
    serve.add_argument("--log-level", default="info")
    serve.set_defaults(func=cmd_serve)

    init = sub.add_parser("init", help="write a commented config.yaml to start from")
    init.add_argument("dir", nargs="?", default=".", help="where to write it (default: .)")
    init.set_defaults(func=cmd_init)

    tail_p = sub.add_parser("tail", help="print a Recap log (file or stdin) readably")
    tail_p.add_argument("file", nargs="?", help="log file (default: stdin)")
    tail_p.add_argument("--conversation", help="only this conversation key")
    tail_p.add_argument("--tenant", help="only this tenant")
    tail_p.add_argument(
        "-f", "--follow", action="store_true", help="keep reading as the file grows"
    )
    tail_p.add_argument("--json", action="store_true", help="print the raw JSON lines")
    tail_p.add_argument(
        "--color",
        choices=["auto", "always", "never"],
        default="auto",
        help="auto: only on a terminal, and not with NO_COLOR set",
    )
    tail_p.set_defaults(func=cmd_tail)
    add_commands(sub, with_config, with_store)

    report = sub.add_parser("report", help="compare a tenant's holdout cohorts on its archive")
    report.add_argument("--config", help="config file (default: $RECAP_CONFIG or ./config.yaml)")
    report.set_defaults(func=with_store(cmd_report))
    report_arguments(report)
    return parser


# The exit status of a process killed by SIGPIPE, as `yes | head -1` reports it.
BROKEN_PIPE = 128 + 13


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        code: int = args.func(args)
        sys.stdout.flush()  # inside the try: a reader that left shows here, not at exit
    except (ConfigError, SceneError) as exc:
        print(f"recap: config error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # `recap conversations | head -1`: the reader has what it wanted. Quiet, and no
        # second error when Python flushes stdout at exit (the Python docs' recipe).
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return BROKEN_PIPE
    return code


if __name__ == "__main__":
    sys.exit(main())
