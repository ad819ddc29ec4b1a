"""One file's content as ckptfs holds it: RAM pages over a chunk list.

A page (one arena slot) is either in RAM, or its bytes come from chunks: the
chunks of the last durable manifest (``base``) or chunks written early under
memory pressure (``spilled``, page-aligned). Bytes past both are zeros. State
that peers will need later (who holds what, dirty vs. durable) lives here.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field
from typing import Any

import trio

from .manifest import Chunk

# Per-file states shown by `ckptfs stat`.
DIRTY, FLUSHING, DURABLE, LOST = "dirty", "flushing", "durable", "lost"


@dataclass
class CachedFile:
    file_id: str
    version: str
    path: str
    size: int
    mode: int
    mtime_ns: int
    page_size: int
    state: str = DIRTY
    ino: int | None = None
    pages: list[int] = field(default_factory=list)  # arena slot, or -1
    fill: list[int] = field(default_factory=list)  # valid bytes in each RAM page
    page_gen: list[int] = field(default_factory=list)
    dirty_pages: set[int] = field(default_factory=set)
    base: list[Chunk] = field(default_factory=list)
    base_end: int = 0
    base_offsets: list[int] = field(default_factory=list)
    spilled: dict[int, Chunk] = field(default_factory=dict)
    chunking: str = "fixed"
    gen: int = 0
    published_gen: int = -1
    writers: int = 0
    handles: int = 0
    unlinked: bool = False
    replaces_plain: bool = False
    last_access: float = field(default_factory=time.monotonic)
    flushed_bytes: int = 0
    durable_event: trio.Event = field(default_factory=trio.Event)
    lock: trio.Lock = field(default_factory=trio.Lock)
    # Timings of the checkpoint currently in flight, for the history.
    opened_at: float = field(default_factory=time.time)
    closed_at: float | None = None

    @property
    def npages(self) -> int:
        return -(-self.size // self.page_size)

    def ram_pages(self) -> int:
        return sum(1 for s in self.pages if s >= 0)

    def ensure_pages(self, count: int) -> None:
        missing = count - len(self.pages)
        if missing > 0:
            self.pages.extend([-1] * missing)
            self.fill.extend([0] * missing)
            self.page_gen.extend([0] * missing)

    def set_base(self, chunks: list[Chunk], size: int) -> None:
        self.base = list(chunks)
        self.base_offsets = [c.offset for c in self.base]
        self.base_end = size
        self.spilled.clear()

    def sources(self, start: int, end: int) -> list[tuple[int, int, Chunk | None]]:
        """Where bytes [start, end) of a page not in RAM come from.

        Returns (file offset, length, chunk or None for zeros) pieces in order.
        """
        page = start // self.page_size
        spilled = self.spilled.get(page)
        if spilled is not None:
            end_of = spilled.offset + spilled.length
            return self._from_chunks([spilled], [spilled.offset], start, end, end_of)
        return self._from_chunks(self.base, self.base_offsets, start, end, self.base_end)

    @staticmethod
    def _from_chunks(
        chunks: list[Chunk], offsets: list[int], start: int, end: int, covered_end: int
    ) -> list[tuple[int, int, Chunk | None]]:
        pieces: list[tuple[int, int, Chunk | None]] = []
        pos = start
        i = max(0, bisect.bisect_right(offsets, start) - 1)
        while pos < end and pos < covered_end and i < len(chunks):
            chunk = chunks[i]
            if chunk.offset + chunk.length <= pos:
                i += 1
                continue
            if chunk.offset > pos:  # a gap in the chunk list reads as zeros
                stop = min(end, chunk.offset)
                pieces.append((pos, stop - pos, None))
                pos = stop
                continue
            stop = min(end, chunk.offset + chunk.length, covered_end)
            pieces.append((pos, stop - pos, chunk))
            pos = stop
            i += 1
        if pos < end:
            pieces.append((pos, end - pos, None))
        return pieces

    def mark_modified(self) -> None:
        self.gen += 1
        self.mtime_ns = time.time_ns()
        if self.state in (DURABLE, LOST):
            self.state = DIRTY
        if self.durable_event.is_set():
            self.durable_event = trio.Event()

    def describe(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "size": self.size,
            "state": self.state,
            "version": self.version,
            "open": self.handles > 0,
            "ram_bytes": self.ram_pages() * self.page_size,
            "dirty_bytes": len(self.dirty_pages) * self.page_size,
            "flushed_bytes": self.flushed_bytes,
        }
