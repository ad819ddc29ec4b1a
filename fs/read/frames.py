"""Clean chunks read from the backing store, held in arena slots.

A frame is one whole chunk, verified, laid out from its first byte in as
many slots as it needs. Frames are keyed by the chunk's hash, so every file
and every reader that needs the same bytes shares one read from the store
and one copy in RAM; they are clean and are evicted least-recently-used when
memory is needed. A worker thread reads the chunk file straight into the
slots and hashes it there, so the bytes served are the bytes verified.

A frame is reserved (slots taken, registered as LOADING) before it is
filled, so a reader and the read-ahead (fs/read/readahead.py) that want the same
chunk find each other: whoever comes second waits for the first fill, and a
reader that finds a read-ahead frame still queued fills it itself rather than
wait behind the queue. A fill that fails removes the frame: the readers that
waited for it get the error (EIO, never the bytes), and a later reader tries
the store again.

A FUSE reader's Ctrl-C ends its wait in the store (interrupts.py), whether
it fills the frame or waits for another's fill; so does a cancellation of
the filling task (a node that asked this one, its representative, for the
chunk sent CANCEL). The read itself goes on in its thread for the frame
(READING_ON), which it makes READY (or fails) when it returns, so the other
readers of the chunk wait for that one read rather than each start another
in a store that hangs or is slow; it keeps the
deadline the reader's wait had (``backing_timeout``), after which the frame
fails with the store marked down, as if the reader had waited. A read
given up on before it began (every store thread busy) is not made: the
frame goes, and its waiters fill it again themselves.

A reader never waits for memory: if no slot can be freed for a frame, the
reader gets None and reads its range through a bounded bounce buffer instead
(still verified, see ChunkStore.read_range).
"""

from __future__ import annotations

import errno
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from enum import Enum

import trio
from ckptfs.fs.content.arena import Arena
from ckptfs.fs.interrupts import Interrupted, interruptible
from ckptfs.fs.store.blocking import BackingIO, Call, on_loop_later
from ckptfs.fs.store.chunkstore import DIRECT_ALIGN, ChunkCorrupt, ChunkStore
from ckptfs.fs.store.manifest import Chunk

log = logging.getLogger("ckptfs.frames")


# Fills a frame's slots (whole, in order) with a chunk's verified bytes from
# elsewhere (another node's RAM, peer/reads/represent.py): True if it did, False if
# the frame must be read from the store as usual. It returns, or raises (an
# Interrupted: its caller's stop signal), only once nothing writes into the
# slots any more; on False or a raise their contents are unspecified.
RemoteFill = Callable[[Chunk, list[memoryview], str], Awaitable[bool]]


class FrameState(Enum):
    LOADING = "loading"  # reserved; a thread is filling the slots, or will: not readable yet
    # Its filler was interrupted or cancelled while the store read ran: the
    # read goes on in its thread and completes the frame (``_read_ended``),
    # or the frame fails at its deadline (``_expire``). Not readable yet.
    READING_ON = "reading on"
    READY = "ready"  # verified; readable until evicted
    FAILED = "failed"  # its fill failed or timed out: gone from the cache (see ``failure``)


@dataclass(eq=False)
class Frame:
    chunk: Chunk
    slots: list[int]
    state: FrameState = FrameState.LOADING
    done: trio.Event = field(default_factory=trio.Event)
    started: bool = False  # a fill is running (only one ever does)
    failure: BaseException | None = None
    read: Call[bool] | None = None  # its store read, once asked for (shared with the thread)
    expiry: trio.CancelScope = field(default_factory=trio.CancelScope)  # READING_ON's timer
    prefetched: bool = False  # reserved by the read-ahead
    unread: bool = False  # reserved by the read-ahead, no reader yet: counted in unread_bytes
    last_access: float = field(default_factory=time.monotonic)


def shared_error(exc: BaseException) -> OSError:
    """The error a waiter of a failed fill gets: its own exception object, so
    that tracebacks of different tasks do not pile onto one."""
    if isinstance(exc, ChunkCorrupt):
        return ChunkCorrupt(str(exc))
    return OSError(errno.EIO, str(exc) or type(exc).__name__)


class FrameCache:
    def __init__(self, arena: Arena, store: ChunkStore, io: BackingIO) -> None:
        self.arena = arena
        self.store = store
        self.io = io
        # Where a READING_ON frame's deadline runs (the cache's background
        # nursery); without one, an interrupted read fails its frame at once.
        self.nursery: trio.Nursery | None = None
        self.slot_size = arena.slot_size
        self.frames: OrderedDict[str, Frame] = OrderedDict()  # LRU order: oldest first
        self.reads = 0  # chunk reads from the backing store (frames and streamed ranges)
        self.bytes_read = 0
        self.streamed = 0  # reads that found no room and used the bounce buffer
        self.failed = 0  # fills that failed (corrupt, missing, backing store error)
        self.waits = 0  # a reader waited for a fill another task had started
        # Read-ahead accounting: frames it reserved that no reader has used yet
        # (bounded by the read-ahead), used before eviction, or evicted unused.
        self.unread_bytes = 0
        self.prefetch_used = 0
        self.prefetch_wasted = 0
        self.prefetch_taken = 0  # a reader filled a read-ahead frame still queued
        # Set by the daemon when peers are configured (representative fetch);
        # None on a single node, where every fill reads the store.
        self.remote: RemoteFill | None = None

    @property
    def slots_held(self) -> int:
        return sum(len(f.slots) for f in self.frames.values())

    def oldest(self) -> Frame | None:
        for frame in self.frames.values():
            if frame.state is FrameState.READY:
                return frame
        return None

    def evict(self, frame: Frame) -> int:
        """Drop a ready frame; returns slots freed."""
        if frame.state is not FrameState.READY or self.frames.get(frame.chunk.hash) is not frame:
            return 0
        if frame.unread:
            self.prefetch_wasted += 1
        self._forget(frame)
        return len(frame.slots)

    def _forget(self, frame: Frame) -> None:
        """Unregister ``frame`` and give its slots back (deferred while a thread pins them)."""
        if self.frames.get(frame.chunk.hash) is frame:
            del self.frames[frame.chunk.hash]
        self._settle(frame)
        for slot in frame.slots:
            self.arena.release(slot)

    def _settle(self, frame: Frame) -> None:
        """``frame`` no longer counts as unused read-ahead."""
        if frame.unread:
            frame.unread = False
            self.unread_bytes -= frame.chunk.length

    def write_off(self, frame: Frame) -> None:
        """A read-ahead frame no reader came for in time: it stays cached as
        clean bytes, but no longer holds back further read-ahead."""
        if frame.unread:
            self.prefetch_wasted += 1
            self._settle(frame)

    # ----- reserving and filling --------------------------------------------------
    def known(self, digest: str) -> bool:
        return digest in self.frames

    def is_ready(self, chunk: Chunk) -> bool:
        """Whether ``chunk`` has a ready frame now (without marking it used)."""
        frame = self.frames.get(chunk.hash)
        return frame is not None and frame.state is FrameState.READY

    def ready(self, chunk: Chunk) -> Frame | None:
        """The ready frame of ``chunk`` now, without waiting (marks it used)."""
        if not self.is_ready(chunk):
            return None
        frame = self.frames[chunk.hash]
        self._use(frame)
        return frame

    def _use(self, frame: Frame) -> None:
        frame.last_access = time.monotonic()
        self.frames.move_to_end(frame.chunk.hash)
        if frame.unread:
            self.prefetch_used += 1
            self._settle(frame)

    def reserve(
        self, chunk: Chunk, alloc: Callable[[], int | None], *, prefetch: bool = False
    ) -> Frame | None:
        """A new LOADING frame for ``chunk`` with its slots; None if there is no room.

        The caller must then ``fill`` it (or ``cancel`` it). The chunk must
        have no frame yet.
        """
        assert chunk.hash not in self.frames
        slots: list[int] = []
        for _ in range(-(-chunk.length // self.slot_size)):
            slot = alloc()
            if slot is None:
                for s in slots:
                    self.arena.release(s)
                return None
            slots.append(slot)
        frame = Frame(chunk, slots, prefetched=prefetch, unread=prefetch)
        self.frames[chunk.hash] = frame
        if prefetch:
            self.unread_bytes += chunk.length
        return frame

    def cancel(self, frame: Frame) -> None:
        """Give up a reserved frame nobody started to fill; its waiters try again."""
        if frame.started or frame.done.is_set():
            return
        self._forget(frame)
        frame.done.set()

    async def fill(self, frame: Frame, what: str) -> None:
        """Read and verify the chunk into the frame's slots (once; a no-op if
        another task has started). On failure the frame is gone and the error
        is raised here and to every waiter."""
        if frame.started or frame.done.is_set():
            return
        frame.started = True
        try:
            await self._read_into(frame, what)
        except BaseException as exc:
            if frame.state is FrameState.READING_ON:
                raise  # the caller was interrupted or cancelled; the read completes the frame
            if isinstance(exc, Exception) and not isinstance(exc, Interrupted):
                self.failed += 1
            self._fail(frame, exc)
            raise
        self._ready(frame)

    async def acquire(
        self, chunk: Chunk, what: str, alloc: Callable[[], int | None]
    ) -> Frame | None:
        """The ready frame of ``chunk``, reading it if needed; None if there is no room.

        Concurrent requests for one chunk share one read. A failed read raises
        in every waiter (ChunkCorrupt, or OSError).
        """
        while True:
            frame = self.frames.get(chunk.hash)
            if frame is None:
                frame = self.reserve(chunk, alloc)
                if frame is None:
                    return None
            if frame.state is FrameState.READY:
                self._use(frame)
                return frame
            if not frame.started:
                # Just reserved, or reserved by the read-ahead but still queued:
                # this reader needs it now, so it reads it rather than wait
                # behind the queue.
                if frame.prefetched:
                    self.prefetch_taken += 1
                await self.fill(frame, what)
                continue
            self.waits += 1
            with interruptible(f"read chunk of {what}"):
                await frame.done.wait()
            failure = frame.failure
            if isinstance(failure, Exception) and not isinstance(failure, Interrupted):
                raise shared_error(failure)
            # Ready (look again: it may have been evicted meanwhile), or the
            # task that filled it was cancelled, or its caller interrupted
            # before the read began: try again.

    async def _read_into(self, frame: Frame, what: str) -> None:
        chunk = frame.chunk
        for slot in frame.slots:
            self.arena.back(slot)  # the copies into these views are stores from user space
        # Whole slots: an O_DIRECT read rounds the chunk's end up to a block,
        # into the rest of its last slot (slots start page-aligned in the mapping).
        views = [self.arena.slot_view(slot) for slot in frame.slots]
        if self.remote is not None:
            try:
                if await self.remote(chunk, views, what):
                    return  # verified there, in these slots; not a read from the store
            except BaseException:  # interrupted (its caller's signal) or cancelled
                for view in views:
                    view.release()
                raise
        direct = self.slot_size % DIRECT_ALIGN == 0
        for slot in frame.slots:
            self.arena.pin(slot)

        def read() -> bool:
            self.store.read_into(chunk.hash, chunk.length, views, what=what, direct=direct)
            return True

        # If the loop gives up on this read, the thread's end releases the
        # slots, and completes the frame if its caller was interrupted.
        call = frame.read = Call(on_loop_later(self._read_ended, frame, what))
        deadline = trio.current_time() + self.io.timeout  # as io.run's own
        try:
            await self.io.run(read, what=f"read chunk of {what}", call=call, interruptible=True)
        except (Interrupted, trio.Cancelled):
            # The read was on its way: it goes on, until its deadline, for
            # whoever wants the chunk next. (Else the request was interrupted
            # before, and no read was asked for.) Cancelled: a node that
            # asked this representative for the chunk gave up (its reader's
            # Ctrl-C, its timeout) and sent CANCEL; it, or another node,
            # asks again, and a second read of the store would serve that.
            if call.abandoned():
                self._read_on(frame, deadline, what)
            raise
        finally:
            if not call.abandoned():
                for view in views:
                    view.release()
                self._unpin(frame.slots)
        self._count_read(chunk)

    def _read_ended(self, frame: Frame, what: str) -> None:
        """On the loop, once a read the loop gave up on has ended (or, given
        up before it began, never will)."""
        read = frame.read
        assert read is not None
        self._unpin(frame.slots)
        if frame.state is not FrameState.READING_ON:
            return  # it failed meanwhile (its deadline), or its reader timed out
        frame.expiry.cancel()
        if read.outcome() is True:
            self._count_read(frame.chunk)
            self._ready(frame)
        elif read.began():
            self.failed += 1
            error = read.error()
            if not isinstance(error, OSError):
                error = OSError(errno.EIO, f"read chunk of {what} failed: {error!r}")
            self._fail(frame, error)
        else:  # nothing was read: its waiters fill it themselves
            self._fail(frame, Interrupted(f"read chunk of {what}"))

    def _read_on(self, frame: Frame, deadline: float, what: str) -> None:
        """Its reader was interrupted or cancelled: the frame waits for the
        read (READING_ON) until ``deadline`` (trio clock), if there is a
        nursery for that timer."""
        if self.nursery is None:
            return
        try:
            self.nursery.start_soon(self._expire, frame, deadline, what)
        except RuntimeError:  # the cache is closing: the frame fails now
            return
        frame.state = FrameState.READING_ON

    async def _expire(self, frame: Frame, deadline: float, what: str) -> None:
        """A READING_ON frame whose read outlives the deadline its reader's
        wait had fails then, as that wait would have (the store is down).
        If the timer itself is cancelled (the cache is closing), it fails at
        once: nothing would end a wait for it."""
        try:
            with frame.expiry:
                await trio.sleep_until(deadline)
                if frame.state is FrameState.READING_ON:
                    self.failed += 1
                    self._fail(frame, self.io.timed_out(f"read chunk of {what}"))
        finally:
            if frame.state is FrameState.READING_ON and not frame.expiry.cancel_called:
                self._fail(frame, Interrupted(f"read chunk of {what}"))

    def _ready(self, frame: Frame) -> None:
        """The frame's fill succeeded: readable, and its waiters read it."""
        frame.state = FrameState.READY
        frame.last_access = time.monotonic()
        frame.done.set()

    def _fail(self, frame: Frame, failure: BaseException) -> None:
        """The frame's fill failed: it goes (its slots once no thread pins
        them), and its waiters get ``failure`` (or, an Interrupted or a
        cancellation, fill it again)."""
        frame.state = FrameState.FAILED
        frame.failure = failure
        self._forget(frame)
        frame.done.set()

    def _count_read(self, chunk: Chunk) -> None:
        self.reads += 1
        self.bytes_read += chunk.length

    def _unpin(self, slots: list[int]) -> None:
        for slot in slots:
            self.arena.unpin(slot)

    # ----- reading ------------------------------------------------------------------
    def views(self, frame: Frame, start: int, count: int) -> list[memoryview]:
        """Views of bytes [start, start+count) of a ready frame (chunk-relative).

        Valid until the next await (the frame may be evicted then): copy first.
        """
        views = []
        pos = start
        end = start + count
        while pos < end:
            i, o = divmod(pos, self.slot_size)
            n = min(self.slot_size - o, end - pos)
            views.append(self.arena.slot_view(frame.slots[i], o, n))
            pos += n
        return views

    def copy(self, frame: Frame, start: int, count: int) -> bytes:
        """Bytes [start, start+count) of a ready frame (chunk-relative), on the loop."""
        return b"".join(self.views(frame, start, count))

    async def read_range(self, chunk: Chunk, start: int, count: int, what: str) -> bytes:
        """A verified range of a chunk without a frame (no room in the cache)."""
        data = await self.io.run(
            lambda: self.store.read_range(chunk.hash, chunk.length, start, count, what=what),
            what=f"read chunk of {what}",
            interruptible=True,
        )
        self.reads += 1
        self.streamed += 1
        self.bytes_read += chunk.length
        return data

    def stats(self) -> dict[str, int]:
        return {
            "chunk_reads": self.reads,
            "chunk_bytes_read": self.bytes_read,
            "chunk_reads_streamed": self.streamed,
            "chunk_reads_failed": self.failed,
            "chunk_read_waits": self.waits,
            # Reads whose reader was interrupted, going on for other readers
            # (a store that hangs shows here).
            "chunk_reads_left_running": sum(
                1 for f in self.frames.values() if f.state is FrameState.READING_ON
            ),
        }
