"""The per-node history of durable files (a CSV in the backing store).

Lines are appended by a background task, all those queued in one
backing-store call, so a directory of small files does not pay a thread
round trip per file; ``stat`` shows the most recent ones from memory.
"""

from __future__ import annotations

import csv
import logging
import math
import os
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio
from ckptfs.fs.store.blocking import BackingIO
from ckptfs.fs.store.storedirs import HISTORY, StoreDirs

log = logging.getLogger(__name__)

FIELDS = ["time", "path", "size", "close_s", "mirrored_s", "durable_s", "throughput_MBps"]
SHUTDOWN_WRITE_TIMEOUT = 5.0


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
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
        if self.dirs is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            return os.open(self.path, flags, 0o644)
        return os.open(self.path.name, flags, 0o644, dir_fd=self.dirs.private(HISTORY))

    def _append(self, records: list[dict[str, Any]]) -> None:
        fd = self._open()
        new = os.fstat(fd).st_size == 0
        with open(fd, "a", newline="") as out:
            writer = csv.DictWriter(out, fieldnames=FIELDS)
            if new:
                writer.writeheader()
            writer.writerows(records)
