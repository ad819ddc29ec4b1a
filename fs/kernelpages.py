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
- While the push runs (``KernelCache.PUSHING``), whatever would change the
  content waits for it (a writable open, a write, a truncate; none of them
  holds a page lock while it waits). So the bytes pushed are the content
  for as long as they are being pushed: a reader opening meanwhile may keep
  the kernel's pages (the publish made the inode's ``kernel_version`` this
  version), pushed or read, and they are all of that version.
- The mount does not ask for FUSE_AUTO_INVAL_DATA (fusesession.py): with it
  the first getattr after the save, whose mtime is the last write's and not
  the create's the kernel still has, would drop the pages pushed.
- The notification waits for each page's lock; a page is locked by a READ of
  it in flight, which the loop or the request thread answers, never this
  thread. So it runs in a worker thread, and nothing waits for it while
  holding anything a READ needs.
"""

from __future__ import annotations

import enum
import logging
import mmap
from collections.abc import Callable, Sequence

import trio

log = logging.getLogger("ckptfs.fs")

HEAD = 64 << 10  # a zip's magic, a safetensors header
TAIL = 256 << 10  # a zip's central directory: about 90 bytes an entry

# (nodeid, offset, bytes) -> whether the kernel took them (blocking).
Store = Callable[[int, int, bytes], bool]


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
    """Pushes byte ranges into the kernel's page cache of an inode."""

    def __init__(self, store: Store) -> None:
        self._store = store
        self.files = 0  # pushes the kernel took whole
        self.bytes = 0
        self.refused = 0  # pushes it did not (the inode forgotten, the mount gone)

    async def push(self, nodeid: int, ranges: Sequence[tuple[int, bytes]]) -> bool:
        """Whether the kernel took every range. Not cancellable: a notification
        half-written is not a thing, and it waits only for READs in flight."""
        taken = await trio.to_thread.run_sync(self._push_now, nodeid, ranges)
        if taken:
            self.files += 1
            self.bytes += sum(len(data) for _, data in ranges)
        else:
            self.refused += 1
        return taken

    def _push_now(self, nodeid: int, ranges: Sequence[tuple[int, bytes]]) -> bool:
        return all(self._store(nodeid, off, data) for off, data in ranges)

    def stats(self) -> dict[str, int]:
        return {"files": self.files, "bytes": self.bytes, "refused": self.refused}
