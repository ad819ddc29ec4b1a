"""Pushes into the kernel's caches of the FUSE mount, through notifications
written to the connection: FUSE_NOTIFY_STORE of a file's pages, and
FUSE_NOTIFY_INVAL_INODE of its attributes. What is pushed, and when it is
safe, is the namespace's decision (fs/namespace/kernelpages.py)."""

from __future__ import annotations

import errno
import logging
import os
import threading
from collections.abc import Callable, Sequence

import trio
from ckptfs.fs.fuse import abi

log = logging.getLogger("ckptfs.fs")

# (fd, nodeid, offset, bytes) -> whether the kernel took them (blocking).
Store = Callable[[int, int, int, bytes], bool]
PUSH_THREADS = 2  # of their own: a push blocked on a page must not hold up the journal's


class KernelPages:
    """Pushes byte ranges into the kernel's page cache of an inode, through a
    descriptor of its own on the FUSE connection (a duplicate): a push that
    outlives the session (see close) then never writes to a descriptor
    number the process has reused for another file."""

    def __init__(self, fd: int, store: Store, allowed: Callable[[], bool] = lambda: True) -> None:
        self._fd = os.dup(fd)
        self._store = store
        self._allowed = allowed  # whether the kernel keeps pushed pages coherent
        self._limiter = trio.CapacityLimiter(PUSH_THREADS)
        self._lock = threading.Lock()  # _busy and _closed, with the threads
        self._busy = 0  # pushes whose thread still runs
        self._closed = False
        self._waits: set[trio.CancelScope] = set()
        self.files = 0  # pushes the kernel took whole
        self.bytes = 0
        self.refused = 0  # pushes it did not (the inode forgotten, the mount gone)

    def wanted(self) -> bool:
        """Whether a push now could be taken: the kernel keeps pushed pages
        coherent, and the session has not ended. Asked before the pages are
        copied out of the cache."""
        return not self._closed and self._allowed()

    async def push(self, nodeid: int, ranges: Sequence[tuple[int, bytes]]) -> bool:
        """Whether the kernel took every range (False once closed). A push
        waits for the lock of each page, which a READ in flight holds until
        it is answered; when the session ends (close) nobody answers any
        more, so its wait is given up and its thread left to fail once the
        connection goes (the unmount that follows)."""
        if not self.wanted():
            return False
        with self._lock:
            if self._closed:
                return False
            self._busy += 1
        taken = False
        with trio.CancelScope() as wait:
            self._waits.add(wait)
            try:
                taken = await trio.to_thread.run_sync(
                    self._push_now, nodeid, ranges, abandon_on_cancel=True, limiter=self._limiter
                )
            finally:
                self._waits.discard(wait)
        if taken:
            self.files += 1
            self.bytes += sum(len(data) for _, data in ranges)
        else:
            self.refused += 1
        return taken

    def _push_now(self, nodeid: int, ranges: Sequence[tuple[int, bytes]]) -> bool:
        try:
            return all(
                not self._closed and self._store(self._fd, nodeid, off, data)
                for off, data in ranges
            )
        finally:
            with self._lock:
                self._busy -= 1
                if self._closed and not self._busy:
                    os.close(self._fd)

    def attributes_changed(self, nodeid: int) -> None:
        """The kernel's cached attributes of ``nodeid`` (its size above all)
        are of another version than the one an open just gave it: drop them
        (FUSE_NOTIFY_INVAL_INODE, attributes only), so that its next stat,
        and a read past the old size, ask again. Without it, within the
        attribute timeout a read of a version rewritten elsewhere stopped
        at the old version's size: bytes no version had. Never waits (no
        page lock is taken for attributes alone)."""
        message = abi.OUT_HEADER.pack(
            abi.OUT_HEADER.size + abi.NOTIFY_INVAL_INODE_OUT.size, abi.NOTIFY_INVAL_INODE, 0
        ) + abi.NOTIFY_INVAL_INODE_OUT.pack(nodeid, -1, 0)
        with self._lock:
            if self._closed:
                return
            try:
                os.write(self._fd, message)
            except OSError as exc:
                # ENOENT: the kernel has no such inode (nothing cached to drop).
                if exc.errno not in (errno.ENOENT, errno.ENODEV):
                    log.warning("attributes of inode %d not invalidated: %s", nodeid, exc)

    def close(self) -> None:
        """The session ends: no more pushes, and none is waited for."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if not self._busy:
                os.close(self._fd)
        for wait in list(self._waits):
            wait.cancel()

    @property
    def threads(self) -> int:
        """Pushes whose thread still runs (a given-up one until it returns)."""
        return self._busy

    def stats(self) -> dict[str, int]:
        return {"files": self.files, "bytes": self.bytes, "refused": self.refused}
