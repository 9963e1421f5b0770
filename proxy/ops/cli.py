"""The `recap` command: serve and tail here; the operator's commands (conversations, show,
export, compact, prune, migrate-store) live in `operator_cli.py` and are registered below."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence

from proxy.config import Config, ConfigError, load_config
from proxy.stages.scenes import SceneError


def _config_path(arg: str | None) -> str:
    return arg or os.environ.get("RECAP_CONFIG") or "config.yaml"


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from proxy.app import create_app, load_scenes
    from proxy.edge.serving import protocol_for
    from proxy.ops.lifecycle import LoggedServer
    from proxy.ops.logs import configure_logging

    config = load_config(_config_path(args.config))
    load_scenes(config)  # a missing or invalid scene stops here with its name
    configure_logging(args.log_format, args.log_level.upper())
    host = args.host or config.listen.host
    port = args.port if args.port is not None else config.listen.port
    server = LoggedServer(
        config,
        uvicorn.Config(
            create_app(config),
            host=host,
            port=port,
            # h11 with a headers deadline and a bound on open connections (proxy/edge/serving.py).
            http=protocol_for(config.listen),
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
    )
    server.run()
    return 0 if server.started else 1


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
    def command(args: argparse.Namespace) -> int:
        return func(load_config(_config_path(args.config)), args)

    return command


def build_parser() -> argparse.ArgumentParser:
    from proxy.ops.operator_cli import add_commands

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
    add_commands(sub, with_config)
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
