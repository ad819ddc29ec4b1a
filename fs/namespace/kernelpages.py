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
import mmap
from collections.abc import Sequence
from typing import Protocol

HEAD = 64 << 10  # a zip's magic, a safetensors header
TAIL = 256 << 10  # a zip's central directory: about 90 bytes an entry


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


class PagePusher(Protocol):
    """What the namespace asks of the kernel's caches: the FUSE session's
    KernelPages (fs/fuse/kernelpages.py) or None where pushes cannot be
    taken."""

    def wanted(self) -> bool: ...

    async def push(self, nodeid: int, ranges: Sequence[tuple[int, bytes]]) -> bool: ...

    def attributes_changed(self, nodeid: int) -> None: ...

    def stats(self) -> dict[str, int]: ...
