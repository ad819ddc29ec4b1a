"""The cache's memory: slot allocation under the budget, LRU eviction of
clean bytes, backpressure on writers, and spilling dirty pages of files
still being written. A part of :class:`ckptfs.fs.cache.cache.Cache`."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import trio
from ckptfs.fs.content.cachedfile import CachedFile
from ckptfs.fs.content.state import FileState, PageState
from ckptfs.fs.interrupts import interruptible
from ckptfs.fs.store.blocking import Call, on_loop_later
from ckptfs.fs.store.chunkstore import chunk_hash
from ckptfs.fs.store.manifest import Chunk

if TYPE_CHECKING:
    pass

log = logging.getLogger("ckptfs.cache")

BACKPRESSURE_WARN_SECONDS = 60.0


class Memory:
    """The cache's memory: slot allocation under the budget, LRU eviction of (see the module)."""

    # ----- memory ---------------------------------------------------------
    def _touch(self, f: CachedFile) -> None:
        f.last_access = time.monotonic()
        if f.ram_count:
            self._resident.pop(f, None)
            self._resident[f] = None

    def _free_slot(self, slot: int) -> None:
        self.arena.release(slot)
        self._signal_space()

    def _signal_space(self) -> None:
        self._space_event.set()
        self._space_event = trio.Event()

    def _drop_page(self, f: CachedFile, p: int) -> None:
        page = f.pages.pop(p)
        if page.in_ram:
            self.arena.release(page.slot)
            f.ram_count -= 1
        if page.state is PageState.DIRTY:
            f.dirty_count -= 1
            self.dirty_pages -= 1

    def _release_pages(self, f: CachedFile, pages: list[int]) -> int:
        freed = 0
        for p in pages:
            if p in f.pages:
                freed += f.pages[p].in_ram
                self._drop_page(f, p)
        if freed:
            self._signal_space()
        return freed

    def _clean_pages(self, f: CachedFile) -> list[int]:
        return [
            p
            for p, pg in f.pages.items()
            if pg.state is PageState.CLEAN and not self.arena.pinned(pg.slot)
        ]

    def _evict_one(self) -> bool:
        """Free the least recently used clean bytes: a chunk frame or a file's clean pages."""
        frame = self.frames.oldest()
        victim: CachedFile | None = None
        gone: list[CachedFile] = []
        for f in self._resident:
            if not f.ram_count:
                gone.append(f)
            elif f.ram_count > f.dirty_count and self._clean_pages(f):
                victim = f
                break
        for f in gone:
            del self._resident[f]
        if frame is not None and (victim is None or frame.last_access <= victim.last_access):
            freed = self.frames.evict(frame)
        elif victim is not None:
            freed = self._release_pages(victim, self._clean_pages(victim))
            if victim.state is FileState.DURABLE:
                log.debug("evicted %s (%d MiB)", victim.path, freed * self.page_size >> 20)
        else:
            return False
        self.evicted_bytes += freed * self.page_size
        self._signal_space()
        return freed > 0

    def try_alloc(self) -> int | None:
        """A free slot, evicting clean bytes if needed; None rather than wait."""
        while True:
            slot = self.arena.alloc()
            if slot is not None or not self._evict_one():
                return slot

    async def alloc_for_write(self, f: CachedFile) -> int:
        """A free slot for a write to ``f``; waits (backpressure) rather than fail."""
        slot = self.try_alloc()
        if slot is not None:
            return slot
        self.backpressure_events += 1
        self.waiting_writers += 1
        start = time.monotonic()
        warned = False
        try:
            while slot is None:
                waited = time.monotonic() - start
                if not self._bp_logged:
                    self._bp_logged = True
                    log.info(
                        "backpressure: cache full (%d MiB, %d MiB not durable); "
                        "writes to %s wait for the flusher",
                        self.arena.capacity >> 20,
                        self.dirty_pages * self.page_size >> 20,
                        f.path,
                    )
                if waited > BACKPRESSURE_WARN_SECONDS and not warned:
                    warned = True
                    log.warning(
                        "a write to %s has waited %.0fs for cache space; the backing store "
                        "is not keeping up (health %s)",
                        f.path,
                        waited,
                        self.io.health,
                    )
                self.need_space.set()
                with interruptible(f"write to {f.path} waiting for cache space"):
                    with trio.move_on_after(self.backpressure_poll):
                        await self._space_event.wait()
                slot = self.try_alloc()
        finally:
            self.waiting_writers -= 1
            self.backpressure_seconds += time.monotonic() - start
            if not self.waiting_writers:
                self._bp_logged = False
        return slot

    def evict(self, f: CachedFile) -> int:
        """Drop the RAM copy of a durable file; returns bytes freed."""
        if f.state is not FileState.DURABLE or f.writers:
            return 0
        freed = self._release_pages(f, self._clean_pages(f)) * self.page_size
        self.evicted_bytes += freed
        if freed:
            log.debug("evicted %s (%d MiB)", f.path, freed >> 20)
            self.prune()
        return freed

    def evict_frames(self) -> int:
        freed = 0
        while (frame := self.frames.oldest()) is not None:
            freed += self.frames.evict(frame)
        if freed:
            self._signal_space()
        return freed * self.page_size

    # ----- spilling under pressure -------------------------------------------
    async def relieve_pressure(self) -> bool:
        """Free memory for waiting writers; returns whether anything was freed."""
        if self._evict_one():
            return True
        # Spilling is for content no journal record lists (MODIFIED), or that
        # only open handles still read (UNLINKED).
        candidates = [
            f
            for f in self.all_files()
            if f.state in (FileState.MODIFIED, FileState.UNLINKED) and f.dirty_count
        ]
        if not candidates:
            return False
        f = max(candidates, key=lambda c: c.dirty_count)
        # Full pages first, lowest offsets first: the sequential writer is done with them.
        dirty = [p for p, pg in f.pages.items() if pg.state is PageState.DIRTY]
        pages = sorted(dirty, key=lambda p: (f.pages[p].fill < self.page_size, p))[:8]
        async with trio.open_nursery() as nursery:
            for p in pages:
                nursery.start_soon(self._spill_page, f, p)
        return True

    async def _spill_page(self, f: CachedFile, p: int) -> None:
        page = f.pages.get(p)
        if page is None or page.state is not PageState.DIRTY or not page.fill:
            return
        slot, gen = page.slot, page.gen
        length = page.fill  # a truncation clips fill, so it never runs past the size
        view = self.arena.slot_view(slot, 0, length)
        self.arena.pin(slot)

        def hash_and_store() -> str:
            digest = chunk_hash(view)
            self.store.put(digest, view)
            return digest

        call: Call[str] = Call(on_loop_later(self.arena.unpin, slot))
        try:
            digest = await self.io.run(hash_and_store, what=f"spill of {f.path}", call=call)
        finally:
            if not call.abandoned():
                view.release()
                self.arena.unpin(slot)
        current = f.pages.get(p)
        if (
            current is page
            and page.gen == gen
            and page.state is PageState.DIRTY
            and f.state in (FileState.MODIFIED, FileState.UNLINKED)
        ):
            self.arena.release(slot)
            page.slot = -1
            page.state = PageState.SPILLED
            page.chunk = Chunk(p * self.page_size, length, digest)
            page.fill = length
            f.ram_count -= 1
            f.dirty_count -= 1
            self.dirty_pages -= 1
            self.spilled_bytes += length
            self._signal_space()

    async def run_spiller(self) -> None:
        """The cache's background task (Core starts it): spills whenever writers
        wait for memory, and hosts the read-ahead's chunk reads."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self.readahead.run)
            self.remote.nursery = self.frames.nursery = nursery
            await self._spill_when_needed()

    async def _spill_when_needed(self) -> None:
        """Whenever writers wait for memory, spill until they don't."""
        while True:
            await self.need_space.wait()
            self.need_space = trio.Event()
            while self.waiting_writers:
                try:
                    progressed = await self.relieve_pressure()
                except Exception as exc:  # incl. ExceptionGroups: the spiller must live on
                    cause: BaseException = exc
                    while isinstance(cause, BaseExceptionGroup) and cause.exceptions:
                        cause = cause.exceptions[0]
                    log.warning("spilling dirty pages to the backing store failed: %s", cause)
                    progressed = False
                    await trio.sleep(1)
                if not progressed:
                    await trio.sleep(0.05)
