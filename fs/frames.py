"""Clean chunks read from the backing store, held in arena slots.

A frame is one whole chunk, verified, laid out from its first byte in as
many slots as it needs. Frames are keyed by the chunk's hash, so every file
and every reader that needs the same bytes shares one read from the store
and one copy in RAM; they are clean and are evicted least-recently-used when
memory is needed. A worker thread reads the chunk file straight into the
slots and hashes it there, so the bytes served are the bytes verified.

A reader never waits for memory: if no slot can be freed for a frame, the
reader gets None and reads its range through a bounded bounce buffer instead
(still verified, see ChunkStore.read_range).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

import trio

from .arena import Arena
from .blocking import BackingIO, Call, on_loop_later
from .chunkstore import ChunkCorrupt, ChunkStore
from .manifest import Chunk

log = logging.getLogger("ckptfs.frames")


class FrameState(Enum):
    LOADING = "loading"  # a thread is filling the slots; not readable yet
    READY = "ready"  # verified; readable until evicted


@dataclass(eq=False)
class Frame:
    chunk: Chunk
    slots: list[int]
    state: FrameState = FrameState.LOADING
    done: trio.Event = field(default_factory=trio.Event)
    error: str = ""
    last_access: float = field(default_factory=time.monotonic)


class FrameCache:
    def __init__(self, arena: Arena, store: ChunkStore, io: BackingIO) -> None:
        self.arena = arena
        self.store = store
        self.io = io
        self.slot_size = arena.slot_size
        self.frames: OrderedDict[str, Frame] = OrderedDict()  # LRU order: oldest first
        self.reads = 0  # chunk reads from the backing store (frames and streamed ranges)
        self.bytes_read = 0
        self.streamed = 0  # reads that found no room and used the bounce buffer

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
        del self.frames[frame.chunk.hash]
        for slot in frame.slots:
            self.arena.release(slot)
        return len(frame.slots)

    async def acquire(
        self, chunk: Chunk, what: str, alloc: Callable[[], int | None]
    ) -> Frame | None:
        """The ready frame of ``chunk``, reading it if needed; None if there is no room.

        Concurrent requests for one chunk share one read. A failed read raises
        ChunkCorrupt (or OSError) in every waiter.
        """
        while True:
            frame = self.frames.get(chunk.hash)
            if frame is None:
                break
            if frame.state is FrameState.READY:
                frame.last_access = time.monotonic()
                self.frames.move_to_end(chunk.hash)
                return frame
            await frame.done.wait()
            if frame.error:
                raise ChunkCorrupt(frame.error)
        slots: list[int] = []
        for _ in range(-(-chunk.length // self.slot_size)):
            slot = alloc()
            if slot is None:
                for s in slots:
                    self.arena.release(s)
                return None
            slots.append(slot)
        frame = Frame(chunk, slots)
        self.frames[chunk.hash] = frame
        try:
            await self._fill(frame, what)
        except BaseException as exc:
            frame.error = str(exc) or type(exc).__name__
            if self.frames.get(chunk.hash) is frame:
                del self.frames[chunk.hash]
            for slot in slots:
                self.arena.release(slot)
            raise
        finally:
            frame.done.set()
        frame.state = FrameState.READY
        return frame

    async def _fill(self, frame: Frame, what: str) -> None:
        chunk = frame.chunk
        views = []
        left = chunk.length
        for slot in frame.slots:
            n = min(self.slot_size, left)
            views.append(self.arena.slot_view(slot, 0, n))
            left -= n
        for slot in frame.slots:
            self.arena.pin(slot)
        # If the loop gives up on this read, the thread unpins when it is done.
        call: Call[None] = Call(on_loop_later(self._unpin, frame.slots))
        try:
            await self.io.run(
                lambda: self.store.read_into(chunk.hash, chunk.length, views, what=what),
                what=f"read chunk of {what}",
                call=call,
            )
        finally:
            if not call.abandoned():
                for view in views:
                    view.release()
                self._unpin(frame.slots)
        self.reads += 1
        self.bytes_read += chunk.length

    def _unpin(self, slots: list[int]) -> None:
        for slot in slots:
            self.arena.unpin(slot)

    def copy(self, frame: Frame, start: int, count: int) -> bytes:
        """Bytes [start, start+count) of a ready frame (chunk-relative), on the loop."""
        parts = []
        pos = start
        end = start + count
        while pos < end:
            i, o = divmod(pos, self.slot_size)
            n = min(self.slot_size - o, end - pos)
            parts.append(self.arena.read(frame.slots[i], o, n))
            pos += n
        return parts[0] if len(parts) == 1 else b"".join(parts)

    async def read_range(self, chunk: Chunk, start: int, count: int, what: str) -> bytes:
        """A verified range of a chunk without a frame (no room in the cache)."""
        data = await self.io.run(
            lambda: self.store.read_range(chunk.hash, chunk.length, start, count, what=what),
            what=f"read chunk of {what}",
        )
        self.reads += 1
        self.streamed += 1
        self.bytes_read += chunk.length
        return data
