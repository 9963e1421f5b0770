"""`recap tail`: follow Recap's JSON log lines and print them readably.

Reads a file or stdin line by line; lines that are not Recap JSON are printed as
they are, so it can sit behind any log shipper.
"""

from __future__ import annotations

import json
import time
from typing import Any, TextIO

from proxy.logs import format_fields


def render(record: dict[str, Any]) -> str:
    stamp = time.strftime("%H:%M:%S", time.localtime(float(record.get("ts", 0) or 0)))
    level = str(record.get("level", "info"))
    fields = {k: v for k, v in record.items() if k not in ("ts", "level", "logger")}
    if record.get("logger") == "recap.access":
        fields.pop("msg", None)
        return f"{stamp} {level:5} {format_fields(fields)}"
    msg = fields.pop("msg", "")
    rest = format_fields(fields)
    return f"{stamp} {level:5} {record.get('logger', '')}: {msg}" + (f" {rest}" if rest else "")


def tail(src: TextIO, out: TextIO, conversation: str | None = None, follow: bool = False) -> None:
    while True:
        line = src.readline()
        if not line:
            if not follow:
                return
            time.sleep(0.2)
            continue
        line = line.rstrip("\n")
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        if not isinstance(record, dict):
            if conversation is None:
                print(line, file=out, flush=True)
            continue
        if conversation is not None and record.get("conversation") != conversation:
            continue
        print(render(record), file=out, flush=True)
