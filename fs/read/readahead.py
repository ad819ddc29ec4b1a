"""Read-ahead: while a reader moves through a file in order, read the next chunks now.

Without it, a cold sequential reader (a restore) waits at every chunk
boundary for a whole read-and-verify while the disk sits idle. With it, the
next chunks are already being read by worker threads, several at once,
straight into arena slots (as frames, verified there; fs/read/frames.py), and the
reader takes them from RAM.

Detection is per file, over a few streams, so that several readers of one
file (ranks loading the same checkpoint) and the kernel's own read-ahead
(which sends neighbouring requests concurrently and slightly out of order)
each count as sequential. A stream becomes sequential at its second read
that starts near where it left off; how far ahead it reads grows with how
long it has been sequential.

Bounds: at most ``max_inflight`` chunk reads at once (a worker-thread budget
apart from demand reads, flushes and metadata calls), and at most
``budget`` bytes of read-ahead frames that no reader has used yet, a
fraction of the cache. Nothing is read ahead while writers wait for memory,
and read-ahead takes only free or clean slots, so it never makes anyone wait.

Read-ahead never decides which bytes a reader gets: a frame is the content
of one chunk hash, and readers resolve their ranges from the file's current
chunk map (fs/read/readsource.py). A prefetch of a version that was rewritten or
renamed over meanwhile is an unused frame, evicted like any clean bytes; a
prefetch that fails verification is EIO for the reader that needs that chunk.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import trio
from ckptfs.fs.read.frames import Frame, FrameCache, FrameState
from ckptfs.fs.read.readsource import chunks_ahead

if TYPE_CHECKING:
    from ckptfs.fs.content.cachedfile import CachedFile

log = logging.getLogger("ckptfs.readahead")
MIB = 1 << 20
MIN_AHEAD = 8 * MIB  # how far ahead a stream reads when it becomes sequential
MAX_AHEAD = 32 * MIB  # ... and at most, once it has read this much in order
MAX_INFLIGHT = 4  # chunk reads at once: enough to keep a disk or NFS queue busy
BUDGET_FRACTION = 8  # unused read-ahead bytes stay under capacity / this
# A read-ahead frame no reader used this long after it was ready (the reader
# stopped, jumped elsewhere, or the file was rewritten) stops counting against
# the budget; it stays cached as clean bytes until evicted.
STALE_SECONDS = 10.0


class ReadAhead:
    def __init__(
        self,
        frames: FrameCache,
        alloc: Callable[[], int | None],
        capacity: int,
        *,
        busy: Callable[[], bool] = lambda: False,
        max_inflight: int = MAX_INFLIGHT,
    ) -> None:
        self.frames = frames
        self.alloc = alloc
        self.busy = busy  # writers are waiting for memory
        self.budget = max(capacity // BUDGET_FRACTION, 1)
        self.limiter = trio.CapacityLimiter(max_inflight)
        self._nursery: trio.Nursery | None = None
        self._reserved: deque[Frame] = deque()  # oldest first; for writing off stale ones
        self.started = 0  # chunks read ahead
        self.failed = 0
        self.skipped = 0  # chunks not read ahead: no room, or over the budget

    async def run(self) -> None:
        """Host the read-ahead fetches until cancelled (a background task)."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            try:
                await trio.sleep_forever()
            finally:
                self._nursery = None

    def observe(self, f: CachedFile, off: int, end: int) -> None:
        """A reader asks for [off, end) of ``f``: if it reads in order, read on ahead."""
        stream = f.read_pattern.observe(off, end)
        if stream is None or self._nursery is None or self.busy():
            return
        ahead = min(MAX_AHEAD, max(MIN_AHEAD, stream.run))
        start = max(end, stream.frontier)
        stop = min(end + ahead, f.size)
        if start >= stop:
            return
        self._write_off()
        for chunk in chunks_ahead(f, start, stop):
            if self.frames.known(chunk.hash):
                continue
            if self.frames.unread_bytes + chunk.length > self.budget:
                self.skipped += 1
                stop = chunk.offset  # try again from here at a later read
                break
            frame = self.frames.reserve(chunk, self.alloc, prefetch=True)
            if frame is None:
                self.skipped += 1
                stop = chunk.offset
                break
            self.started += 1
            self._reserved.append(frame)
            self._nursery.start_soon(self._fetch, frame, f.path)
        stream.frontier = max(stream.frontier, stop)

    def _write_off(self) -> None:
        """Forget read-ahead frames that were used or are gone, and stop counting
        stale unused ones against the budget (oldest first)."""
        now = time.monotonic()
        while self._reserved:
            frame = self._reserved[0]
            if frame.unread and (
                frame.state is not FrameState.READY or now - frame.last_access < STALE_SECONDS
            ):
                break
            self._reserved.popleft()
            self.frames.write_off(frame)

    async def _fetch(self, frame: Frame, what: str) -> None:
        try:
            async with self.limiter:
                # A reader that needed it meanwhile has started it (fill is then a no-op).
                await self.frames.fill(frame, what)
        except OSError as exc:
            # The frame is gone: a reader that needs this chunk reads it again
            # and gets the error itself (EIO, logged), never these bytes.
            self.failed += 1
            log.info("read-ahead of a chunk of %s failed: %s", what, exc)
        except Exception:
            self.failed += 1
            log.exception("read-ahead of a chunk of %s failed", what)
        finally:
            self.frames.cancel(frame)  # still queued when cancelled (shutdown)

    def stats(self) -> dict[str, Any]:
        return {
            "started": self.started,
            "failed": self.failed,
            "skipped": self.skipped,
            "used": self.frames.prefetch_used,
            "taken_by_reader": self.frames.prefetch_taken,
            "wasted": self.frames.prefetch_wasted,
            "unread_bytes": self.frames.unread_bytes,
            "budget": self.budget,
        }
