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
import logging
import math
import os
import stat
from collections import deque
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


def read_all(dirs: StoreDirs) -> list[dict[str, Any]]:
    """Every node's history lines, validated (the files are in the shared
    store, written by other nodes' daemons): each a dict of FIELDS with
    ``time`` as an aware UTC datetime, ``node``, and ``uid`` None where the
    line has none. Blocking: run it in a thread. Lines that do not parse
    are skipped and counted in the log."""
    try:
        names = dirs.names(HISTORY)
    except FileNotFoundError:
        return []
    out: list[dict[str, Any]] = []
    for name in sorted(names):
        if not name.endswith(".csv"):
            continue
        node = name[:-4].split("-", 2)[2] if name.startswith("old-") else name[:-4]
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK,
                         dir_fd=dirs.private(HISTORY))  # fmt: skip
        except OSError as exc:
            log.warning("history %s: %s", dirs.path(HISTORY) / name, exc.strerror)
            continue
        with open(fd, newline="", errors="replace") as f:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_READ:
                log.warning("history %s: not a regular file of at most %d MiB: skipped",
                            dirs.path(HISTORY) / name, MAX_READ >> 20)  # fmt: skip
                continue
            bad = 0
            for row in csv.DictReader(f):
                line = _valid(row, node)
                if line is None:
                    bad += 1
                else:
                    out.append(line)
            if bad:
                log.warning("history %s: %d line(s) that do not parse were skipped",
                            dirs.path(HISTORY) / name, bad)  # fmt: skip
    return out


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
