"""The operator's tools around a running app: the `recap` command and its log output.

    cli           the `recap` command: serve, tail, and the operator's commands
    operator_cli  conversations, show, export, compact, prune, migrate-store
    report        `recap report`: the holdout cohorts compared
    lifecycle     the server's start and stop lines
    logs          the log formatters: one JSON or text line per request
    tail          `recap tail`: the JSON log read back as one line per request
    tail_fields   the log line's vocabulary in words
    ansi          colours for a terminal, or none

The top floor: it may import anything, `proxy.app` included (tests/test_layers.py).
"""
