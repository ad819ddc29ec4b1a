"""The first and last bytes of a file just saved here, put into the kernel's
page cache (FUSE_NOTIFY_STORE) when its writer closes it.

A save's handle writes with direct I/O (operations.py), so nothing of the
file is in the kernel's page cache when the writer closes it. The first load
after it, torch.load(mmap=True), then sends a READ for the 4-byte magic at
the start and one for the zip directory at the end, each a round trip, and
each READ makes the kernel ask for the attributes again at the next stat
(docs/PERFORMANCE.md, "The first load after a save here"). Those reads fall
inside the load's race window (the replace-while-loading tear). Pushing the
head and the tail of the file at its close removes them: the next open says
FOPEN_KEEP_CACHE, and the kernel finds those pages.

Why it is safe:

- Only for an inode whose pages the kernel cannot hold otherwise: created
  here through a direct-I/O handle, with no other handle opened on it since
  (``KernelCache.EMPTY``). So every page there after the push is of the
  version pushed.
- The push holds the file's ``f.lock`` (Filesystem._push_pages), which a
  write or a truncate takes before it changes a byte (taken only if free: a
  write waiting for room in the cache holds it for as long as that takes,
  and a close must not wait behind it, so nothing is pushed then), and a
  writable open
  waits for the push right before its handle exists (``PUSHING``, then
  ``Inode.pushed``). So the bytes pushed are the file's for as long as they
  are being pushed, and a reader opening meanwhile may keep them (the
  publish made the inode's ``kernel_version`` this version).
- The notification waits for each page's lock. A READ in flight holds it
  until the loop or the request thread answers; a writer through the page
  cache holds it while its WRITE waits for ``f.lock``, which is why no such
  writer may open during a push. The thread that pushes answers nothing.
- When the session ends, nobody answers READs any more: ``close`` gives up
  the waits (the FLUSH returns and the unmount goes on, which ends the
  connection and with it the blocked notification), and the descriptor the
  thread writes through, a duplicate of the connection's, stays open until
  that thread returns, so it never writes to a number reused meanwhile.
- Only where the kernel drops the cached pages that a direct write
  overwrites (FUSE 7.39, Linux 6.6 on): there the mount does not ask for
  FUSE_AUTO_INVAL_DATA (fusesession.py), which would drop the pages pushed
  at the first stat after the save (its mtime is the last write's, not the
  create's the kernel still has). Older kernels keep AUTO_INVAL_DATA and get
  no pushes.
"""

from __future__ import annotations

import enum
import errno
import logging
import mmap
import os
import threading
from collections.abc import Callable, Sequence

import trio
from ckptfs.fs.fuse import abi as abi

log = logging.getLogger("ckptfs.fs")

HEAD = 64 << 10  # a zip's magic, a safetensors header
TAIL = 256 << 10  # a zip's central directory: about 90 bytes an entry

# (fd, nodeid, offset, bytes) -> whether the kernel took them (blocking).
Store = Callable[[int, int, int, bytes], bool]
PUSH_THREADS = 2  # of their own: a push blocked on a page must not hold up the journal's


class KernelCache(enum.Enum):
    """What the kernel's page cache of an inode may hold, as far as we know."""

    ANY = "any"  # whatever opens let it keep (Inode.kernel_version: of which version)
    EMPTY = "empty"  # created here through direct I/O, no other handle since: no page
    PUSHING = "pushing"  # a push of its head and tail runs; changes wait for it


def pieces(size: int, page: int = mmap.PAGESIZE) -> list[tuple[int, int]]:
    """The ranges pushed for a file of ``size`` bytes: its head and its tail,
    the tail starting at a (kernel) page boundary, neither overlapping the
    other."""
    head = min(size, HEAD)
    out = [(0, head)] if head else []
    if size > head:
        start = max(head, (size - TAIL) // page * page)
        out.append((start, size))
    return out


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
