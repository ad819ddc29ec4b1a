"""The per-node history of durable files (a CSV in the backing store).

Lines are appended by a background task, all those queued in one
backing-store call, so a directory of small files does not pay a thread
round trip per file; ``stat`` shows the most recent ones from memory, and
``ckptfs history`` every node's, read back by :func:`read_all`.

Times are UTC ISO-8601 (``2026-12-04T15:46:57+00:00``). Each line names the
uid of its file's owner, so that the daemon shows a job user their own
lines alone. A file with another header (an older release's, whose times
were local and which had no uid) is renamed ``old-<UTC stamp>-<node>.csv``
at the first append, and read with its own header: its lines are shown to
root only.
"""

from __future__ import annotations

import csv
import heapq
import io
import logging
import math
import os
import re
import stat
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import trio
from ckptfs.fs.store.blocking import BackingIO
from ckptfs.fs.store.storedirs import HISTORY, StoreDirs

log = logging.getLogger(__name__)

FIELDS = [
    "time", "path", "size", "close_s", "mirrored_s", "durable_s", "throughput_MBps", "uid",
]  # fmt: skip
SHUTDOWN_WRITE_TIMEOUT = 5.0
# A history file is read whole: one larger than this (hundreds of thousands
# of checkpoint files) is skipped with a warning rather than read into RAM.
MAX_READ = 64 << 20


@dataclass(frozen=True)
class Recent:
    """A history record kept in memory for ``stat``, with the owner of its
    file (not written to the CSV): stat names it to that user and root only."""

    uid: int
    record: dict[str, Any]


class History:
    """``path``: the CSV, as the operator configured it; with ``dirs``, a
    name in the store's ``.ckptfs/history`` (used through its fd)."""

    def __init__(self, path: Path, io: BackingIO, dirs: StoreDirs | None = None) -> None:
        self.path = dirs.path(HISTORY) / path if dirs is not None else path
        self.dirs = dirs
        self.io = io
        self.recent: deque[Recent] = deque(maxlen=20)
        self._send, self._recv = trio.open_memory_channel[dict[str, Any]](math.inf)

    def add(self, record: dict[str, Any], uid: int) -> None:
        """Append ``record`` (FIELDS) for a file owned by ``uid``."""
        self.recent.append(Recent(uid, record))
        self._send.send_nowait(record)

    async def run(self) -> None:
        """Background task; at cancellation (unmount) it writes what is queued."""
        try:
            async for record in self._recv:
                await self._write([record, *self._queued()])
        finally:
            rest = self._queued()
            if rest:
                with trio.CancelScope(shield=True), trio.move_on_after(SHUTDOWN_WRITE_TIMEOUT):
                    await self._write(rest)

    def _queued(self) -> list[dict[str, Any]]:
        records = []
        while True:
            try:
                records.append(self._recv.receive_nowait())
            except (trio.WouldBlock, trio.ClosedResourceError, trio.EndOfChannel):
                return records

    async def _write(self, records: list[dict[str, Any]]) -> None:
        try:
            await self.io.run(self._append, records, what=f"history {self.path}")
        except OSError as exc:
            log.warning(
                "could not append %d line(s) to history %s: %s", len(records), self.path, exc
            )

    def _open(self) -> int:
        # Read too: the header says whether the file has this release's format.
        flags = os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
        if self.dirs is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            return os.open(self.path, flags, 0o644)
        return os.open(self.path.name, flags, 0o644, dir_fd=self.dirs.private(HISTORY))

    def _append(self, records: list[dict[str, Any]]) -> None:
        fd = self._open()
        if os.fstat(fd).st_size and _header(fd) != FIELDS:
            os.close(fd)
            self._set_aside()
            fd = self._open()
        new = os.fstat(fd).st_size == 0
        with open(fd, "a", newline="") as out:
            writer = csv.DictWriter(out, fieldnames=FIELDS)
            if new:
                writer.writeheader()
            writer.writerows(records)

    def _set_aside(self) -> None:
        """Rename a file of another format (see the module's docstring)."""
        stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%S")
        old = f"old-{stamp}-{self.path.name}"
        if self.dirs is None:
            os.rename(self.path, self.path.with_name(old))
        else:
            dfd = self.dirs.private(HISTORY)
            os.rename(self.path.name, old, src_dir_fd=dfd, dst_dir_fd=dfd)
        log.warning("history %s had another format: kept as %s", self.path, old)


def utc_time(seconds: float) -> str:
    """A history line's time: UTC ISO-8601, to the second."""
    return datetime.fromtimestamp(seconds, UTC).isoformat(timespec="seconds")


def _header(fd: int) -> list[str]:
    first = os.pread(fd, 4096, 0).split(b"\n", 1)[0].decode("utf-8", "replace").strip()
    return first.split(",")


@dataclass(frozen=True)
class Query:
    """Which history lines a caller gets: ``uid`` None for root (all),
    under ``prefix`` ("" everything), within [since, until] (seconds since
    the epoch), the newest ``limit``."""

    uid: int | None
    prefix: str = ""
    since: float | None = None
    until: float | None = None
    limit: int = 1000

    def wants(self, line: dict[str, Any]) -> bool:
        path, stamp = line["path"], line["time"].timestamp()
        return (
            (self.uid is None or line["uid"] == self.uid)
            and (not self.prefix or path == self.prefix or path.startswith(self.prefix + "/"))
            and (self.since is None or stamp >= self.since)
            and (self.until is None or stamp <= self.until)
        )


_OLD = re.compile(r"^old-\d{8}T\d{6}-(.+)\.csv$")


def read_all(
    dirs: StoreDirs, query: Query, extra: tuple[Path, str] | None = None
) -> list[dict[str, Any]]:
    """Every node's history lines that ``query`` wants, oldest first: each a
    dict of FIELDS with ``time`` an aware UTC datetime, ``node``, and
    ``uid`` None where the line has none. ``extra``: a history file outside
    the store (the ``history`` key) and its node. The files are in the shared store,
    written by other nodes' daemons: each field is validated, a line that
    does not parse is skipped, a file that cannot be read is skipped whole,
    and only the newest ``limit`` lines are kept while reading (memory
    bounded whatever the files hold). Blocking: run it in a thread."""
    newest: list[tuple[float, int, dict[str, Any]]] = []  # a heap: the oldest first
    seen = 0
    try:
        names = [n for n in dirs.names(HISTORY) if n.endswith(".csv")]
    except FileNotFoundError:
        names = []
    sources: list[tuple[str, int | None, str]] = [
        (name, dirs.private(HISTORY), _node_of(name)) for name in sorted(names)
    ]
    if extra is not None:
        sources.append((str(extra[0]), None, extra[1]))
    for name, dir_fd, node in sources:
        where = dirs.path(HISTORY) / name if dir_fd is not None else Path(name)
        try:
            for line in _lines(name, dir_fd, node, where):
                if not query.wants(line):
                    continue
                seen += 1
                entry = (line["time"].timestamp(), seen, line)
                if len(newest) < query.limit:
                    heapq.heappush(newest, entry)
                else:
                    heapq.heappushpop(newest, entry)
        except (OSError, csv.Error, UnicodeError) as exc:
            log.warning("history %s: skipped: %s", where, exc)
    return [line for _, _, line in sorted(newest)]


def _node_of(name: str) -> str:
    old = _OLD.match(name)
    return old.group(1) if old else name.removesuffix(".csv")


def _lines(name: str, dir_fd: int | None, node: str, where: Path) -> Iterator[dict[str, Any]]:
    """The valid lines of one history file; a file that is not a regular
    file of at most MAX_READ is refused before it is opened (a device node
    is never opened as root)."""
    st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_READ:
        raise OSError(f"not a regular file of at most {MAX_READ >> 20} MiB")
    fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    with open(fd, newline="", errors="replace") as f:
        opened = os.fstat(fd)
        if (opened.st_dev, opened.st_ino) != (st.st_dev, st.st_ino):
            raise OSError("replaced while it was opened")
        bad = 0
        # At most the bytes it had when looked at: one growing meanwhile (a
        # node appending now) is read to there.
        for row in csv.DictReader(io.StringIO(f.read(st.st_size))):
            line = _valid(row, node)
            if line is None:
                bad += 1
            else:
                yield line
    if bad:
        log.warning("history %s: %d line(s) that do not parse were skipped", where, bad)


def _valid(row: dict[str | None, Any], node: str) -> dict[str, Any] | None:
    try:
        when = datetime.fromisoformat(row["time"])
        if when.tzinfo is None:  # an older release's local time
            when = when.astimezone()
        line = {
            "time": when.astimezone(UTC),
            "node": node,
            "path": str(row["path"]),
            "size": int(row["size"]),
            "uid": int(row["uid"]) if row.get("uid") not in (None, "") else None,
        }
        for key in ("close_s", "mirrored_s", "durable_s", "throughput_MBps"):
            value = row.get(key)
            line[key] = float(value) if value not in (None, "") else None
    except (KeyError, TypeError, ValueError):
        return None
    if line["size"] < 0 or not line["path"] or line["path"].startswith("/"):
        return None
    return line
