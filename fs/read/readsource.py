"""Where a file's bytes come from: the one place that resolves a byte range to its sources.

Every byte of a file comes from exactly one source, decided from the file's
page table and chunk map at one instant on the event loop:

- ``RamSource``: a page in an arena slot (DIRTY or CLEAN), up to its fill;
- ``ChunkSource``: a stored chunk (a spilled page's chunk, or the base chunk
  map), served from a verified frame (fs/read/frames.py);
- ``ZeroSource``: a hole, a page past its fill, the file past its chunk map.

The multi-node read path adds one more: a peer's range, for a file whose
bytes only its holders have. It is resolved here like the others and served
by ``RangeReader`` next to chunks, verified by its hash the same way.

A resolution holds until the next await. A RAM page's slot may be released
and reused once the loop runs other tasks, so ``RangeReader`` copies what is
in RAM before it waits for anything. A chunk's bytes never change (chunks are
named by their hash), so a chunk source stays right: at worst it names the
content the file had when the read began, never another version's bytes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ckptfs.fs.content.arena import Arena
from ckptfs.fs.read.frames import FrameCache
from ckptfs.fs.store.chunkstore import ChunkCorrupt
from ckptfs.fs.store.manifest import Chunk

if TYPE_CHECKING:
    from ckptfs.fs.content.cachedfile import CachedFile

log = logging.getLogger("ckptfs.read")
_ZEROS = memoryview(bytes(1 << 20))


@dataclass(frozen=True, slots=True)
class RamSource:
    slot: int
    start: int  # offset in the slot
    count: int


@dataclass(frozen=True, slots=True)
class ChunkSource:
    chunk: Chunk
    start: int  # offset in the chunk
    count: int


@dataclass(frozen=True, slots=True)
class ZeroSource:
    count: int


Source = RamSource | ChunkSource | ZeroSource


def resolve(f: CachedFile, start: int, end: int) -> list[Source]:
    """Where bytes [start, end) of ``f`` come from now, in order.

    Adjacent pieces of one chunk (it spans several pages) and adjacent zeros
    are merged, so a reader takes each chunk's range in one piece.
    """
    out: list[Source] = []
    ps = f.page_size
    pos = start
    while pos < end:
        p, o = divmod(pos, ps)
        stop = min((p + 1) * ps, end)
        page = f.pages.get(p)
        if page is not None and page.in_ram:
            valid = max(0, min(stop - pos, page.fill - o))
            if valid:
                out.append(RamSource(page.slot, o, valid))
            if valid < stop - pos:
                _add(out, ZeroSource(stop - pos - valid))
        else:
            for off, length, chunk in f.sources(pos, stop):
                if chunk is None:
                    _add(out, ZeroSource(length))
                else:
                    _add(out, ChunkSource(chunk, off - chunk.offset, length))
        pos = stop
    return out


def _add(out: list[Source], src: Source) -> None:
    last = out[-1] if out else None
    if isinstance(src, ZeroSource) and isinstance(last, ZeroSource):
        out[-1] = ZeroSource(last.count + src.count)
    elif (
        isinstance(src, ChunkSource)
        and isinstance(last, ChunkSource)
        and last.chunk == src.chunk
        and last.start + last.count == src.start
    ):
        out[-1] = ChunkSource(last.chunk, last.start, last.count + src.count)
    else:
        out.append(src)


def chunks_ahead(f: CachedFile, start: int, end: int) -> list[Chunk]:
    """The stored chunks bytes [start, end) of ``f`` would be read from, in order."""
    seen: set[str] = set()
    chunks = []
    for src in resolve(f, start, end):
        if isinstance(src, ChunkSource) and src.chunk.hash not in seen:
            seen.add(src.chunk.hash)
            chunks.append(src.chunk)
    return chunks


class RangeReader:
    """Copies a file's byte range out of its sources (Cache.read, page-ins).

    Each byte is copied once on the loop: from the arena (a RAM page or a
    frame, through the shared mapping) into the bytes returned. Chunk frames
    are filled by worker threads straight into arena slots.
    """

    def __init__(self, arena: Arena, frames: FrameCache, alloc: Callable[[], int | None]) -> None:
        self.arena = arena
        self.frames = frames
        self.alloc = alloc

    async def read(
        self,
        f: CachedFile,
        start: int,
        end: int,
        *,
        view_ok: bool = False,
        into: bytearray | None = None,
    ) -> bytes | memoryview:
        """Bytes [start, end) of ``f`` (the caller clips ``end`` to the size).

        With ``view_ok``, a range that lies in one RAM page or frame comes back
        as a view of the arena, not a copy: for a caller that hands it on
        before its next await (the FUSE reply is written synchronously after
        the read handler returns); a slot may be reused after any await.
        With ``into`` (at least end - start long), the bytes are copied there
        and a view of it comes back: a caller that reuses its buffer avoids
        the first-touch faults of a fresh one for every range."""
        out: list[bytes] = []
        pending: list[memoryview | bytes] = []  # views valid until the next await
        filled = 0  # bytes copied into ``into`` so far

        def settle() -> None:
            """Copy the views out before the loop runs anything else."""
            nonlocal filled
            if into is None:
                out.append(b"".join(pending))
            else:
                for view in pending:
                    into[filled : filled + len(view)] = view
                    filled += len(view)
            pending.clear()

        pos = start
        while pos < end:
            waited = False
            for src in resolve(f, pos, end):
                if isinstance(src, RamSource):
                    pending.append(self.arena.slot_view(src.slot, src.start, src.count))
                elif isinstance(src, ZeroSource):
                    pending.append(zeros(src.count))
                else:
                    frame = self.frames.ready(src.chunk)
                    if frame is None:
                        if pending:
                            settle()
                        pending += await self._chunk(src, f.path)
                        waited = True
                    else:
                        pending += self.frames.views(frame, src.start, src.count)
                pos += src.count
                if waited:
                    break  # the file may have changed meanwhile: resolve the rest again
        if view_ok and not out and not filled and len(pending) == 1:
            return pending[0]  # zero-copy: the reply copies it into the kernel
        if pending:
            settle()
        if into is not None:
            return memoryview(into)[:filled]
        return out[0] if len(out) == 1 else b"".join(out)

    def read_now(
        self, f: CachedFile, start: int, end: int, *, frames_ok: bool
    ) -> list[memoryview] | None:
        """Views of bytes [start, end) of ``f`` if no byte needs a wait (each in
        a RAM page, a hole, or with ``frames_ok`` a ready frame); None if one
        does. Valid until the next await, as ``read``'s views are."""
        sources = resolve(f, start, end)
        for src in sources:  # first: a decline changes nothing (frames' use)
            if isinstance(src, ChunkSource) and not (frames_ok and self.frames.is_ready(src.chunk)):
                return None
        views: list[memoryview] = []
        for src in sources:
            if isinstance(src, RamSource):
                views.append(self.arena.slot_view(src.slot, src.start, src.count))
            elif isinstance(src, ZeroSource):
                views.append(memoryview(zeros(src.count)))
            else:
                frame = self.frames.ready(src.chunk)
                assert frame is not None  # (nothing ran since the look above)
                views += self.frames.views(frame, src.start, src.count)
        return views

    async def _chunk(self, src: ChunkSource, what: str) -> list[memoryview | bytes]:
        """Verified bytes of a chunk source, as views of its frame (valid until
        the next await) or, with no room for a frame, as streamed bytes."""
        try:
            frame = await self.frames.acquire(src.chunk, what, self.alloc)
            if frame is None:
                return [await self.frames.read_range(src.chunk, src.start, src.count, what)]
        except ChunkCorrupt as exc:
            log.error("read of %s failed: %s", what, exc)
            raise
        return self.frames.views(frame, src.start, src.count)

    async def chunk_bytes(self, chunk: Chunk, start: int, count: int, what: str) -> bytes:
        """Verified bytes [start, start+count) of a stored chunk."""
        return b"".join(await self._chunk(ChunkSource(chunk, start, count), what))


def zeros(count: int) -> memoryview | bytes:
    return _ZEROS[:count] if count <= len(_ZEROS) else bytes(count)
