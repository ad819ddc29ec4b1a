"""The RAM write-back cache: file contents in arena slots under a budget.

Owns slot allocation, LRU eviction of durable files, backpressure when the
budget is full of bytes that are not durable, and spilling of dirty pages of
files still being written (so a file larger than the cache can be written).
It knows nothing of FUSE, inodes or paths beyond what it logs.
"""

from __future__ import annotations

import functools
import itertools
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any

import trio

from .arena import Arena
from .blocking import BackingIO, run_cpu
from .cachedfile import DURABLE, FLUSHING, LOST, CachedFile
from .chunkstore import ChunkCorrupt, ChunkStore, chunk_hash
from .manifest import Chunk, Manifest

log = logging.getLogger("ckptfs.cache")
MAX_IDLE_FILES = 4096


class FileLost(OSError):
    """The bytes of a file are gone: its holders and the backing store lack them."""


class Cache:
    def __init__(self, arena: Arena, store: ChunkStore, io: BackingIO, hash_threads: int) -> None:
        self.arena = arena
        self.store = store
        self.io = io
        self.page_size = arena.slot_size
        self.files: dict[str, CachedFile] = {}
        # Set by the filesystem: whether an inode still points at a file.
        self.referenced: Callable[[CachedFile], bool] = lambda f: False
        self.lost: dict[str, str] = {}  # path -> reason
        self.hash_limiter = trio.CapacityLimiter(hash_threads)
        self._space_event = trio.Event()
        self.need_space = trio.Event()
        self.waiting_writers = 0
        self.backpressure_events = 0
        self.backpressure_seconds = 0.0
        self.evicted_bytes = 0
        self.spilled_bytes = 0
        self._last_bp_log = 0.0
        self._recent: OrderedDict[str, bytes] = OrderedDict()  # recently fetched chunks
        self._inflight: dict[str, trio.Event] = {}
        self.chunk_reads = 0
        # Page generations are global and only grow: a page freed and written
        # again can never look "unchanged" to a spill that started before.
        self._page_gen = itertools.count(1)

    # ----- registry -------------------------------------------------------
    def add(self, f: CachedFile) -> CachedFile:
        self.files[f.file_id] = f
        return f

    def new_file(self, file_id: str, version: str, path: str, mode: int) -> CachedFile:
        return self.add(CachedFile(file_id, version, path, 0, mode, time.time_ns(), self.page_size))

    def from_manifest(self, m: Manifest, path: str) -> CachedFile:
        f = CachedFile(m.file_id, m.version, path, m.size, m.mode, m.mtime_ns, self.page_size)
        f.state = DURABLE
        f.chunking = m.chunking
        f.set_base(m.chunks, m.size)
        f.ensure_pages(f.npages)
        f.durable_event.set()
        return self.add(f)

    def drop(self, f: CachedFile) -> None:
        """Forget a file whose bytes nobody needs any more (unlinked and closed)."""
        self._release_pages(f, range(len(f.pages)))
        f.dirty_pages.clear()
        if self.files.get(f.file_id) is f:
            del self.files[f.file_id]

    # ----- memory ---------------------------------------------------------
    def _signal_space(self) -> None:
        self._space_event.set()
        self._space_event = trio.Event()

    def _release_pages(self, f: CachedFile, pages: Iterable[int]) -> int:
        freed = 0
        for p in pages:
            slot = f.pages[p]
            if slot >= 0:
                f.pages[p] = -1
                f.fill[p] = 0
                self.arena.release(slot)
                freed += 1
        if freed:
            self._signal_space()
        return freed

    def try_alloc(self) -> int | None:
        while True:
            slot = self.arena.alloc()
            if slot is not None or not self._evict_lru():
                return slot

    async def alloc_slot(self, f: CachedFile) -> int:
        """A free slot for a write to ``f``; waits (backpressure) rather than fail."""
        slot = self.try_alloc()
        if slot is not None:
            return slot
        self.backpressure_events += 1
        self.waiting_writers += 1
        start = time.monotonic()
        try:
            while slot is None:
                now = time.monotonic()
                if now - self._last_bp_log > 10:
                    self._last_bp_log = now
                    log.warning(
                        "backpressure: cache full (%d MiB, %d MiB not durable); "
                        "writes to %s wait for the flusher",
                        self.arena.capacity >> 20,
                        self.dirty_bytes() >> 20,
                        f.path,
                    )
                self.need_space.set()
                with trio.move_on_after(1):
                    await self._space_event.wait()
                slot = self.try_alloc()
        finally:
            self.waiting_writers -= 1
            self.backpressure_seconds += time.monotonic() - start
        return slot

    def _evict_lru(self) -> bool:
        victim = None
        for f in self.files.values():
            if f.state == DURABLE and f.writers == 0 and not f.dirty_pages and f.ram_pages():
                if victim is None or f.last_access < victim.last_access:
                    victim = f
        if victim is None:
            return False
        self.evict(victim)
        return True

    def evict(self, f: CachedFile) -> int:
        """Drop the RAM copy of a durable file; returns bytes freed."""
        if f.state != DURABLE or f.dirty_pages or f.writers:
            return 0
        freed = self._release_pages(f, range(len(f.pages))) * self.page_size
        self.evicted_bytes += freed
        if freed:
            log.debug("evicted %s (%d MiB)", f.path, freed >> 20)
            self.prune()
        return freed

    def prune(self) -> int:
        """Forget the oldest idle entries beyond MAX_IDLE_FILES: durable, no RAM,
        not open and not behind an inode the kernel holds. They are only
        metadata (rebuilt from the manifest on the next open), but a long job
        would otherwise accumulate one per checkpoint file forever."""
        idle = [
            f
            for f in self.files.values()
            if f.state == DURABLE and not f.handles and not f.ram_pages() and not self.referenced(f)
        ]
        excess = len(idle) - MAX_IDLE_FILES
        if excess <= 0:
            return 0
        for f in sorted(idle, key=lambda f: f.last_access)[:excess]:
            del self.files[f.file_id]
        return excess

    def dirty_bytes(self) -> int:
        return sum(len(f.dirty_pages) for f in self.files.values()) * self.page_size

    # ----- chunk fetch ------------------------------------------------------
    async def fetch_chunk(self, chunk: Chunk, what: str) -> bytes:
        """The verified bytes of ``chunk``; concurrent requests share one read.

        A waiter whose fetcher failed starts over: it then fetches itself (and
        meets the same error, reported to its own reader) or waits again.
        """
        while True:
            data = self._recent.get(chunk.hash)
            if data is not None:
                self._recent.move_to_end(chunk.hash)
                return data
            pending = self._inflight.get(chunk.hash)
            if pending is None:
                break
            await pending.wait()
        done = self._inflight[chunk.hash] = trio.Event()
        try:
            data = await self.io.run(
                functools.partial(self.store.get, chunk.hash, chunk.length, what=what),
                what=f"read chunk of {what}",
            )
            self.chunk_reads += 1
            self._recent[chunk.hash] = data
            while len(self._recent) > 8:
                self._recent.popitem(last=False)
            return data
        finally:
            if self._inflight.get(chunk.hash) is done:
                del self._inflight[chunk.hash]
            done.set()

    async def _assemble(self, f: CachedFile, start: int, end: int) -> bytes:
        parts = []
        for off, length, chunk in f.sources(start, end):
            if chunk is None:
                parts.append(bytes(length))
                continue
            try:
                data = await self.fetch_chunk(chunk, f.path)
            except ChunkCorrupt as exc:
                log.error("read of %s failed: %s", f.path, exc)
                raise
            rel = off - chunk.offset
            parts.append(data[rel : rel + length])
        return b"".join(parts)

    # ----- data -------------------------------------------------------------
    async def read(self, f: CachedFile, off: int, size: int) -> bytes:
        if f.state == LOST:
            raise FileLost(f"{f.path}: bytes lost ({self.lost.get(f.path, 'no holder')})")
        f.last_access = time.monotonic()
        end = min(off + size, f.size)
        parts: list[bytes] = []
        pos = off
        ps = self.page_size
        while pos < end:
            p = pos // ps
            pstart = p * ps
            stop = min(pstart + ps, end)
            if p < len(f.pages) and f.pages[p] >= 0:
                parts.append(self._read_ram(f, p, pos - pstart, stop - pos))
            else:
                page = await self._page_for_read(f, p)
                parts.append(page[pos - pstart : stop - pstart])
            pos = stop
        return b"".join(parts)

    def _read_ram(self, f: CachedFile, p: int, o: int, n: int) -> bytes:
        valid = max(0, min(n, f.fill[p] - o))
        data = self.arena.read(f.pages[p], o, valid) if valid else b""
        return data + bytes(n - valid) if valid < n else data

    async def _page_for_read(self, f: CachedFile, p: int) -> bytes:
        pstart = p * self.page_size
        gen = f.gen
        data = await self._assemble(f, pstart, min(pstart + self.page_size, f.size))
        # Keep the page as a clean copy if nothing changed meanwhile and
        # memory is free; a read never waits for memory.
        if f.gen == gen and p < len(f.pages) and f.pages[p] < 0 and data:
            slot = self.try_alloc()
            if slot is not None:
                self.arena.write(slot, 0, data)
                f.pages[p] = slot
                f.fill[p] = len(data)
        return data

    async def write(self, f: CachedFile, off: int, data: bytes) -> int:
        async with f.lock:
            end = off + len(data)
            ps = self.page_size
            f.ensure_pages(-(-end // ps))
            view = memoryview(data)
            pos = off
            while pos < end:
                p = pos // ps
                o = pos - p * ps
                n = min(ps - o, end - pos)
                if f.pages[p] < 0:
                    await self._page_in(f, p, o, n)
                slot = f.pages[p]
                if o > f.fill[p]:
                    self.arena.zero(slot, f.fill[p], o)
                self.arena.write(slot, o, view[pos - off : pos - off + n])
                f.fill[p] = max(f.fill[p], o + n)
                f.page_gen[p] = next(self._page_gen)
                f.dirty_pages.add(p)
                pos += n
            f.size = max(f.size, end)
            f.mark_modified()
            f.last_access = time.monotonic()
        return len(data)

    async def _page_in(self, f: CachedFile, p: int, o: int, n: int) -> None:
        """Give page ``p`` a slot holding its current bytes before a write of [o, o+n)."""
        slot = await self.alloc_slot(f)
        pstart = p * self.page_size
        existing = max(0, min(f.size, pstart + self.page_size) - pstart)
        fill = 0
        if existing and not (o == 0 and n >= existing):
            try:
                current = await self._assemble(f, pstart, pstart + existing)
            except BaseException:
                self.arena.release(slot)
                raise
            self.arena.write(slot, 0, current)
            fill = len(current)
        if f.pages[p] >= 0:  # a reader paged it in meanwhile
            self.arena.release(slot)
            return
        f.pages[p] = slot
        f.fill[p] = fill

    async def truncate(self, f: CachedFile, size: int) -> None:
        async with f.lock:
            ps = self.page_size
            if size < f.size:
                boundary = size // ps
                if size % ps and boundary < len(f.pages):
                    if f.pages[boundary] < 0:
                        await self._page_in(f, boundary, 0, 0)
                    f.fill[boundary] = min(f.fill[boundary], size - boundary * ps)
                    f.dirty_pages.add(boundary)
                    f.page_gen[boundary] = next(self._page_gen)
                first_gone = -(-size // ps)
                self._release_pages(f, range(first_gone, len(f.pages)))
                for p in range(first_gone, len(f.pages)):
                    f.dirty_pages.discard(p)
                    f.spilled.pop(p, None)
                del f.pages[first_gone:], f.fill[first_gone:], f.page_gen[first_gone:]
                f.base_end = min(f.base_end, size)
            f.size = size
            f.ensure_pages(-(-size // ps))
            f.mark_modified()

    def read_sync(self, f: CachedFile, off: int, size: int) -> bytes:
        """Blocking read for the flusher's threads: RAM pages, else verified chunks.

        The event loop may truncate the file meanwhile; then this returns
        whatever it saw and the flusher discards the result (its generation
        check), so a vanished page only has to read as zeros, not crash.
        """
        end = min(off + size, f.size)
        parts = []
        pos = off
        ps = self.page_size
        while pos < end:
            p = pos // ps
            stop = min(p * ps + ps, end)
            try:
                slot, fill = f.pages[p], f.fill[p]
            except IndexError:
                slot, fill = -1, 0
            if slot >= 0:
                o, n = pos - p * ps, stop - pos
                valid = max(0, min(n, fill - o))
                data = self.arena.read(slot, o, valid) if valid else b""
                parts.append(data + bytes(n - valid) if valid < n else data)
            else:
                for o, n, chunk in f.sources(pos, stop):
                    if chunk is None:
                        parts.append(bytes(n))
                    else:
                        data = self.store.get(chunk.hash, chunk.length, what=f.path)
                        parts.append(data[o - chunk.offset : o - chunk.offset + n])
            pos = stop
        return b"".join(parts)

    # ----- spilling under pressure -------------------------------------------
    async def relieve_pressure(self) -> bool:
        """Free memory for waiting writers; returns whether anything was freed."""
        for f in list(self.files.values()):
            # A clean page can always be rebuilt from its chunks (or is zeros).
            # Closed files that are not durable yet keep theirs: the crash
            # journal lists their slots.
            if f.state == DURABLE or (f.writers and f.state != FLUSHING):
                clean = [p for p, s in enumerate(f.pages) if s >= 0 and p not in f.dirty_pages]
                if clean and self._release_pages(f, clean):
                    return True
        # Only files still being written are spilled: closed ones are on their
        # way to durable (then evictable), and their cache journal stays exact.
        candidates = [
            f for f in self.files.values() if f.writers and f.state != FLUSHING and f.dirty_pages
        ]
        if not candidates:
            return False
        f = max(candidates, key=lambda c: len(c.dirty_pages))
        # Full pages first, lowest offsets first: the sequential writer is done with them.
        pages = sorted(f.dirty_pages, key=lambda p: (f.fill[p] < self.page_size, p))[:8]
        async with trio.open_nursery() as nursery:
            for p in pages:
                nursery.start_soon(self._spill_page, f, p)
        return True

    async def _spill_page(self, f: CachedFile, p: int) -> None:
        slot, gen = f.pages[p], f.page_gen[p]
        if slot < 0:
            return
        length = min(f.fill[p], max(0, f.size - p * self.page_size))

        def read_and_hash() -> tuple[bytes, str]:
            data = self.arena.read(slot, 0, length)
            return data, chunk_hash(data)

        data, digest = await run_cpu(read_and_hash, limiter=self.hash_limiter)
        await self.io.run(self.store.put, digest, data, what=f"spill of {f.path}")
        unchanged = p < len(f.pages) and f.pages[p] == slot and f.page_gen[p] == gen
        if unchanged and f.state != FLUSHING:
            f.spilled[p] = Chunk(p * self.page_size, length, digest)
            f.dirty_pages.discard(p)
            self._release_pages(f, [p])
            self.spilled_bytes += length

    async def run_spiller(self) -> None:
        """Background task: whenever writers wait for memory, spill until they don't."""
        while True:
            await self.need_space.wait()
            self.need_space = trio.Event()
            while self.waiting_writers:
                try:
                    progressed = await self.relieve_pressure()
                except Exception as exc:  # incl. ExceptionGroups: the spiller must live on
                    cause = exc
                    while isinstance(cause, BaseExceptionGroup) and cause.exceptions:
                        cause = cause.exceptions[0]
                    log.warning("spilling dirty pages to the backing store failed: %s", cause)
                    progressed = False
                    await trio.sleep(1)
                if not progressed:
                    await trio.sleep(0.05)

    def stats(self) -> dict[str, Any]:
        return {
            "capacity": self.arena.capacity,
            "used": self.arena.used_slots * self.page_size,
            "dirty": self.dirty_bytes(),
            "page_size": self.page_size,
            "waiting_writers": self.waiting_writers,
            "backpressure_events": self.backpressure_events,
            "backpressure_seconds": round(self.backpressure_seconds, 3),
            "evicted_bytes": self.evicted_bytes,
            "spilled_bytes": self.spilled_bytes,
            "chunk_reads": self.chunk_reads,
        }
