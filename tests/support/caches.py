"""A node's cache (arena, chunk store, journal) without the rest of the daemon."""

from __future__ import annotations

from pathlib import Path

from ckptfs.fs.cache.cache import Cache
from ckptfs.fs.cache.journal import Journal
from ckptfs.fs.content.arena import SLOT_SIZE, Arena
from ckptfs.fs.content.cachedfile import CachedFile
from ckptfs.fs.store.blocking import BackingIO
from ckptfs.fs.store.chunkstore import ChunkStore

MiB = 1 << 20


def make_cache(
    root: Path,
    name: str = "n1",
    *,
    node: str | None = None,
    capacity: int = 8 * MiB,
    slot_size: int = SLOT_SIZE,
    store: ChunkStore | None = None,
    io_timeout: float = 10,
) -> Cache:
    """Node ``node``'s cache (default: ``name``), its arena and journal in
    files named after ``name`` under ``root``, over the chunk store of the
    backing directory ``root/backing`` (shared by every cache made there)."""
    arena = Arena(root / f"arena-{name}", capacity, slot_size)
    journal = Journal(root / f"journal-{name}")
    store = store if store is not None else ChunkStore(root / "backing")
    return Cache(arena, store, BackingIO(io_timeout), journal, node=node or name)


async def read_all(cache: Cache, f: CachedFile, piece: int = MiB) -> bytes:
    """The whole of ``f`` through ``cache.read``, ``piece`` bytes at a time."""
    out = bytearray()
    while len(out) < f.size:
        out += await cache.read(f, len(out), piece)
    return bytes(out)
