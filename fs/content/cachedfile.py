"""One file's content as ckptfs holds it: a sparse page table over a chunk map.

A page (one arena slot's worth of the file) is in the page table only if it
is in RAM or was spilled; any other page comes from the base chunk map (the
chunks of the last durable version), and a byte that neither covers is zero.
So memory grows with the bytes a file holds, never with its size or with the
offsets written (a 1 TiB truncate costs nothing).

This module holds data and answers questions about it. Every change of a
file's or a page's state is made by :class:`ckptfs.fs.cache.Cache`.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import trio
from ckptfs.fs.content.readpattern import ReadPattern
from ckptfs.fs.content.state import FileRole, FileState, MirrorState, PageState, stat_state
from ckptfs.fs.store.manifest import Chunk, Manifest, new_id

if TYPE_CHECKING:
    from ckptfs.fs.store.entries import PlainFile

# A piece of a byte range: (file offset, length, chunk or None for zeros).
Piece = tuple[int, int, Chunk | None]


@dataclass(frozen=True)
class ChunkMap:
    """The chunks of a durable version, sorted; gaps are holes. Immutable.

    ``end`` is where the map stops counting: a truncation below the last
    chunk leaves the chunks as they are and moves ``end`` down, so bytes past
    it read as zeros even if a later extension makes the file longer again.
    """

    chunks: tuple[Chunk, ...] = ()
    end: int = 0
    offsets: tuple[int, ...] = field(default=(), compare=False)

    @classmethod
    def of(cls, chunks: list[Chunk] | tuple[Chunk, ...], end: int) -> ChunkMap:
        chunks = tuple(chunks)
        return cls(chunks, end, tuple(c.offset for c in chunks))

    def truncated(self, size: int) -> ChunkMap:
        return self if size >= self.end else ChunkMap(self.chunks, size, self.offsets)

    def pieces(self, start: int, end: int) -> list[Piece]:
        """Where bytes [start, end) come from, in order."""
        pieces: list[Piece] = []
        pos = start
        limit = min(end, self.end)
        i = max(0, bisect.bisect_right(self.offsets, start) - 1)
        while pos < limit and i < len(self.chunks):
            chunk = self.chunks[i]
            if chunk.end <= pos:
                i += 1
                continue
            if chunk.offset > pos:  # a hole
                stop = min(limit, chunk.offset)
                pieces.append((pos, stop - pos, None))
                pos = stop
                continue
            stop = min(limit, chunk.end)
            pieces.append((pos, stop - pos, chunk))
            pos = stop
            i += 1
        if pos < end:
            pieces.append((pos, end - pos, None))
        return pieces

    def extents(self) -> Iterator[tuple[int, int]]:
        """The [start, end) ranges that hold data (not holes), clipped to ``end``."""
        for c in self.chunks:
            if c.offset >= self.end:
                break
            yield c.offset, min(c.end, self.end)


@dataclass(slots=True)
class Page:
    state: PageState
    slot: int = -1  # arena slot while in RAM
    fill: int = 0  # valid bytes from the page start; the rest of the page reads as zeros
    gen: int = 0  # generation of the content: global, only grows
    chunk: Chunk | None = None  # the spilled chunk (SPILLED only)

    @property
    def in_ram(self) -> bool:
        return self.slot >= 0


@dataclass
class Snapshot:
    """A file's content at one instant, taken on the event loop.

    The flusher and the journal work from it; the cache accepts it back (as
    published, or as durable) only if the file did not change since:
    ``content_gen`` is the generation of the file's latest change, assigned
    at the moment of the change, so any write or truncate after the snapshot
    makes it differ.
    """

    file: CachedFile
    version: str
    content_gen: int
    size: int
    pages: dict[int, Page]  # copies
    base: ChunkMap
    holders: list[str] = field(default_factory=list)  # for its pending manifest
    seq: int = 0  # the order of ``version`` (Manifest.seq): a new version's at a commit
    pinned: list[int] = field(default_factory=list)
    threads: int = 0  # worker threads reading the pinned slots
    ended: bool = False  # the flush is over; pins go when the last thread does

    def newest_gen(self) -> int:
        """The newest generation given to this content up to the snapshot:
        every page generation it ever had is at most this, and every change
        after the snapshot gets a higher one. (``content_gen`` alone is not
        enough: an adopted file's pages get generations after it.)"""
        return max([self.content_gen, *(page.gen for page in self.pages.values())])

    def extents(self, page_size: int) -> list[tuple[int, int]]:
        """Sorted, merged [start, end) ranges that hold data; the rest is holes."""
        spans = [(p * page_size, min((p + 1) * page_size, self.size)) for p in self.pages]
        spans += list(self.base.extents())
        spans = sorted((a, min(b, self.size)) for a, b in spans if a < self.size)
        merged: list[tuple[int, int]] = []
        for a, b in spans:
            if merged and a <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(merged[-1][1], b))
            else:
                merged.append((a, b))
        return merged


@dataclass(eq=False)
class CachedFile:
    file_id: str
    version: str  # the version of this file's latest manifest written to the backing store
    path: str
    size: int
    mode: int
    uid: int
    gid: int
    mtime_ns: int
    atime_ns: int
    page_size: int
    state: FileState = FileState.MODIFIED
    role: FileRole = FileRole.LOCAL
    mirror: MirrorState = MirrorState.NONE
    holders: list[str] = field(default_factory=list)
    seq: int = 0  # the order of ``version`` among the file's versions (Manifest.seq)
    # Names this content on the buddy (a new one per content incarnation: a
    # new file, a fork, a file adopted after a restart, whose page
    # generations start again); for a MIRROR, the writer node it came from.
    mirror_id: str = field(default_factory=new_id)
    origin: str = ""
    # A MIRROR's writer process (its daemon's incarnation) that committed
    # it: one that restarted since will never flush it (peer/node.py).
    origin_incarnation: str = ""
    prior_paths: list[str] = field(default_factory=list)  # a mirror's paths before renames
    # A MIRROR's generation floor: the writer's newest generation for this
    # content when the mirror was last committed (the commit's snapshot). A
    # page arriving at or below it is a late copy of bytes that commit
    # superseded (or listed): it must not make the mirror MODIFIED again.
    mirror_floor: int = 0
    pages: dict[int, Page] = field(default_factory=dict)
    base: ChunkMap = field(default_factory=ChunkMap)
    chunking: str = "fixed"
    content_gen: int = 0
    dirty_count: int = 0  # pages in state DIRTY
    ram_count: int = 0  # pages holding a slot
    ino: int | None = None
    writers: int = 0
    handles: int = 0
    # Inodes whose name was removed here but which the kernel still knows
    # (fs/namespace/inodes.py): like open handles, they keep an unlinked file's bytes.
    orphan_inodes: int = 0
    # The plain backing file that was adopted at this name and that the first
    # publish replaces; never another file put there since.
    replaces_plain: PlainFile | None = None
    lost_reason: str = ""
    # Removed while LOST: its handles and the inodes the kernel still has
    # must read EIO, not the zeros its missing pages would give.
    unlinked_while_lost: bool = False
    publishing: Snapshot | None = None  # the snapshot a commit is publishing
    flushing: Snapshot | None = None  # the snapshot the flusher is storing
    last_access: float = field(default_factory=time.monotonic)
    flushed_bytes: int = 0
    durable_event: trio.Event = field(default_factory=trio.Event)
    lock: trio.Lock = field(default_factory=trio.Lock)  # writes and truncates
    commit_lock: trio.Lock = field(default_factory=trio.Lock)
    # Timings of the checkpoint currently in flight, for the history.
    opened_at: float = field(default_factory=time.time)
    closed_at: float | None = None
    mirrored_at: float | None = None  # when the buddy acknowledged this content
    # Where recent reads left off, to detect sequential readers (fs/read/readahead.py).
    read_pattern: ReadPattern = field(default_factory=ReadPattern)

    @property
    def unlinked(self) -> bool:
        return self.state is FileState.UNLINKED

    @property
    def lost(self) -> bool:
        """Its bytes are gone (LOST, or removed while LOST): reads fail, and
        only a full rewrite (truncate to 0) may change it."""
        return self.state is FileState.LOST or (self.unlinked and self.unlinked_while_lost)

    @property
    def modified(self) -> bool:
        """Changed here since it was last published."""
        return self.state in (FileState.MODIFIED, FileState.PUBLISHING)

    @property
    def owes_flush(self) -> bool:
        """This node must still make it durable."""
        return self.state is FileState.PENDING and self.role in (FileRole.LOCAL, FileRole.TAKEOVER)

    def stands_for(self, m: Manifest) -> bool:
        """Whether this is the file a name showing ``m`` reads here: that very
        version, one being changed here, or a newer one of ours (supersedes)."""
        return self.version == m.version or self.modified or self.supersedes(m)

    def supersedes(self, m: Manifest) -> bool:
        """Whether this node's version of the file, still to be made durable,
        is newer (Manifest.order) than ``m``, another node's, at its name.

        That happens when the other node rewrote the file in place too and
        its publish, checked before ours landed, landed after (a check and a
        rename are not atomic across nodes). Ours stays the file here, for
        reads and attributes alike: its flush puts it back over the older
        one (publish._ours_or_older), and that node's flush, finding ours,
        drops its own. Had ours been dropped instead, the name could be left
        to a version whose writer had dropped it (bug 9 of
        docs/FAULT-TRIALS.md)."""
        return (
            self.role is FileRole.LOCAL
            and self.state is FileState.PENDING
            and self.file_id == m.file_id
            and (self.seq, self.version) > m.order
        )

    def page_range(self, start: int, end: int) -> range:
        return range(start // self.page_size, -(-end // self.page_size))

    def sources(self, start: int, end: int) -> list[Piece]:
        """Where bytes [start, end) of one page not in RAM come from."""
        page = self.pages.get(start // self.page_size)
        if page is not None and page.state is PageState.SPILLED and page.chunk is not None:
            c = page.chunk  # starts at the page start; valid up to the page's fill
            return ChunkMap.of([c], c.offset + page.fill).pieces(start, end)
        return self.base.pieces(start, end)

    def describe(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "size": self.size,
            "state": stat_state(self.state, self.flushing is not None, self.mirror, self.role),
            "version": self.version,
            "role": self.role.value,
            "mirror": self.mirror.value,
            "holders": list(self.holders),
            "open": self.handles > 0,
            "ram_bytes": self.ram_count * self.page_size,
            "dirty_bytes": self.dirty_count * self.page_size,
            "flushed_bytes": self.flushed_bytes,
        }
