"""``ckptfs history``: the checkpoints made durable, from every node's
history in the store (fs/store/history.py), asked of the mount's daemon,
which shows a job user their own files and root everything."""

from __future__ import annotations

import argparse
import json
import re
from datetime import UTC, datetime, timedelta
from typing import Any

from ckptfs.tools.statfmt import human, shown

_AGO = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhd])\s*$")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


class WhenError(ValueError):
    pass


def parse_when(text: str, now: datetime | None = None) -> float:
    """Seconds since the epoch of ``2h`` (ago), ``30m``, ``1.5d``, or an ISO
    time (``2026-12-04``, ``2026-12-04T15:00``; UTC unless it names its zone)."""
    m = _AGO.match(text)
    if m:
        ago = timedelta(seconds=float(m.group(1)) * _UNITS[m.group(2)])
        return ((now or datetime.now(UTC)) - ago).timestamp()
    try:
        when = datetime.fromisoformat(text.strip())
    except ValueError:
        raise WhenError(
            f"{text!r} is neither an age (30m, 2h, 1d) nor an ISO time (2026-12-04T15:00)"
        ) from None
    return (when if when.tzinfo else when.replace(tzinfo=UTC)).timestamp()


def table(lines: list[dict[str, Any]]) -> str:
    if not lines:
        return "no checkpoint made durable matches"
    rows = [("time (UTC)", "node", "size", "close", "mirrored", "durable", "path")]
    for line in lines:
        rows.append((
            line["time"][:19].replace("T", " "),
            shown(line["node"]),
            human(line["size"]),
            _seconds(line["close_s"]),
            _seconds(line["mirrored_s"]),
            _seconds(line["durable_s"]),
            shown(line["path"]),
        ))  # fmt: skip
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    out = []
    for row in rows:
        cells = [
            cell.rjust(width) if 2 <= i <= 5 else cell.ljust(width)
            for i, (cell, width) in enumerate(zip(row, widths, strict=False))
        ]
        out.append("  ".join([*cells, row[-1]]))
    return "\n".join(out)


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}s"


def request_of(args: argparse.Namespace, rel: str) -> dict[str, Any]:
    return {
        "op": "history",
        "path": rel,
        "since": parse_when(args.since) if args.since else None,
        "until": parse_when(args.until) if args.until else None,
        "limit": args.limit,
    }


def show(reply: dict[str, Any], as_json: bool) -> str:
    lines = reply["lines"]
    return json.dumps(lines, indent=2) if as_json else table(lines)


def add_parser(sub: Any, config_help: str) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "history",
        help="checkpoints made durable, on every node (yours; root sees all)",
        description="Files made durable under PATH (default: the mount of the current "
        "directory) on every node sharing the backing store, oldest first. Times are UTC.",
    )
    p.add_argument("path", nargs="?")
    p.add_argument("--since", help="an age (30m, 2h, 1d) or an ISO time (UTC unless zoned)")
    p.add_argument("--until", help="as --since")
    p.add_argument("--limit", type=int, default=1000, help="the newest N lines (default 1000)")
    p.add_argument("--json", action="store_true", help="the lines as JSON")
    p.add_argument("--config", help=config_help)
    return p
