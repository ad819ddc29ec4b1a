"""Writes and truncates of a cached file: page-in of partly written pages,
copy on write of pinned slots, and the truncate-to-0 fork. A part of
:class:`ckptfs.fs.cache.cache.Cache`."""

from __future__ import annotations

import errno
import logging
import time
from typing import TYPE_CHECKING

from ckptfs.fs.cache.transitions import move
from ckptfs.fs.content.cachedfile import CachedFile, ChunkMap, Page
from ckptfs.fs.content.state import FileRole, FileState, PageState
from ckptfs.fs.interrupts import Interrupted

if TYPE_CHECKING:
    pass

log = logging.getLogger("ckptfs.cache")

# The largest file ckptfs accepts (16 TiB): larger sizes and offsets get EFBIG.
# Memory does not depend on it (page tables are sparse); it bounds what a
# hostile or mistaken truncate can ask of the chunk list and the store.
MAX_FILE_SIZE = 1 << 44


class Writing:
    """Writes and truncates of a cached file: page-in of partly written pages, (see the module)."""

    # ----- writing --------------------------------------------------------------
    async def write(self, f: CachedFile, off: int, data: bytes) -> int:
        end = off + len(data)
        if end > MAX_FILE_SIZE:
            raise OSError(errno.EFBIG, f"{f.path}: writing up to {end} bytes exceeds the maximum")
        async with f.lock:
            await self._begin_change(f)
            ps = self.page_size
            view = memoryview(data)
            pos = off
            while pos < end:
                p, o = divmod(pos, ps)
                n = min(ps - o, end - pos)
                page = f.pages.get(p)
                try:
                    if page is None or not page.in_ram:
                        await self._page_in(f, p, o, n)
                        continue  # look again: the page table may have moved meanwhile
                    if self.arena.pinned(page.slot):
                        await self._copy_on_write(f, p, page)
                        continue
                except Interrupted:
                    if pos == off:
                        raise
                    break  # a short write: the pages before this one are written
                if f.state is not FileState.MODIFIED and f.state is not FileState.UNLINKED:
                    # A commit began while this write waited above (another
                    # descriptor's close: a snapshot without these bytes).
                    # Changed from here on, the file must be MODIFIED again, or
                    # that commit's publish would leave it PUBLISHING, which
                    # no later commit publishes. That takes an await: look again.
                    await self._begin_change(f)
                    continue
                # No await from here to the end of this page.
                if o > page.fill:
                    self.arena.zero(page.slot, page.fill, o)
                self.arena.write(page.slot, o, view[pos - off : pos - off + n])
                page.fill = max(page.fill, o + n)
                self._changed(f, p, page)
                pos += n
                # Grown page by page: a later page may wait for memory, and the
                # spiller and readers must see the bytes already written.
                if pos > f.size:
                    f.size = pos
            f.mtime_ns = time.time_ns()
            self._touch(f)
        return pos - off

    async def _copy_on_write(self, f: CachedFile, p: int, page: Page) -> None:
        """Move page ``p`` to a new slot before writing it: its slot is pinned by a
        thread (flusher, spiller) that relies on those bytes not changing."""
        slot = await self.alloc_for_write(f)
        if f.pages.get(p) is not page or not page.in_ram or not self.arena.pinned(page.slot):
            self.arena.release(slot)  # moved or unpinned meanwhile: the caller looks again
            return
        self.arena.copy(page.slot, slot, page.fill)
        self.arena.release(page.slot)  # deferred until the last pin goes
        page.slot = slot

    async def _page_in(self, f: CachedFile, p: int, o: int, n: int) -> None:
        """Give page ``p`` a slot holding its current bytes before a write of [o, o+n).

        Only writes and truncates (under f.lock) add pages to a file, so page
        ``p`` is still not in RAM after the awaits here.
        """
        slot = await self.alloc_for_write(f)
        pstart = p * self.page_size
        existing = max(0, min(f.size, pstart + self.page_size) - pstart)
        fill = 0
        if existing and not (o == 0 and n >= existing):
            try:
                current = await self.reader.read(f, pstart, pstart + existing)
            except BaseException:
                self.arena.release(slot)
                raise
            self.arena.write(slot, 0, current)
            fill = len(current)
        old = f.pages.get(p)
        if old is not None and old.in_ram:
            self.arena.release(slot)
            return
        if old is not None:
            self._drop_page(f, p)  # a spilled page: its chunk is superseded
        # DIRTY at once: it is about to be written, and a page-in of a spilled
        # page holds bytes newer than the base.
        page = f.pages[p] = Page(PageState.CLEAN, slot, fill)
        f.ram_count += 1
        self._resident.setdefault(f, None)
        self._changed(f, p, page)

    async def truncate(self, f: CachedFile, size: int) -> None:
        if size > MAX_FILE_SIZE:
            raise OSError(errno.EFBIG, f"{f.path}: size {size} exceeds the maximum")
        async with f.lock:
            if size == 0 and f.owes_flush:
                self._fork(f)
            elif size == 0 and f.lost:
                if f.unlinked:  # a handle of the removed file rewrites it: nothing publishes it
                    f.unlinked_while_lost = False
                    self._content_here(f)
                else:
                    move(f, FileState.MODIFIED)
                    f.role = FileRole.LOCAL
                f.lost_reason, f.base = "", ChunkMap()
                self._notify(f)
            else:
                await self._begin_change(f)
            ps = self.page_size
            if size < f.size:
                first_gone = -(-size // ps)
                self._release_pages(f, [p for p in f.pages if p >= first_gone])
                boundary = size // ps
                page = f.pages.get(boundary)
                if size % ps and page is not None and page.fill > size - boundary * ps:
                    # A CLEAN page stays equal to the base, which is cut at the same
                    # place; a SPILLED page's chunk is read only up to its fill.
                    page.fill = size - boundary * ps
                    if page.state is PageState.DIRTY:
                        self._changed(f, boundary, page)
                f.base = f.base.truncated(size)
            f.content_gen = next(self._gen)
            f.size = size
            f.mtime_ns = time.time_ns()
