"""The cache without FUSE: eviction and pruning of idle metadata."""

from __future__ import annotations

from pathlib import Path

import trio
from ckptfs.fs import cache as cache_mod
from ckptfs.fs.arena import Arena
from ckptfs.fs.blocking import BackingIO
from ckptfs.fs.cache import Cache
from ckptfs.fs.cachedfile import DURABLE
from ckptfs.fs.chunkstore import ChunkStore
from ckptfs.fs.manifest import Manifest


def make_cache(tmp_path: Path) -> Cache:
    arena = Arena(tmp_path / "arena", 8 << 20)
    return Cache(arena, ChunkStore(tmp_path / "backing"), BackingIO(10), hash_threads=1)


def test_prune_forgets_only_idle_unreferenced_files_beyond_the_cap(tmp_path, monkeypatch):
    monkeypatch.setattr(cache_mod, "MAX_IDLE_FILES", 3)

    async def main() -> None:
        cache = make_cache(tmp_path)
        files = [
            cache.from_manifest(Manifest(f"id{i}", "v", 0, 0o644, 0, "durable"), f"f{i}")
            for i in range(8)
        ]
        for i, f in enumerate(files):
            f.last_access = i
        files[0].handles = 1  # open: kept
        pinned = files[1]
        cache.referenced = lambda f: f is pinned  # behind a live inode: kept
        files[2].state = "dirty"  # not durable: kept
        assert cache.prune() == 2  # 5 idle, cap 3: the two least recently used go
        assert sorted(cache.files) == ["id0", "id1", "id2", "id5", "id6", "id7"]
        assert all(f.state == DURABLE for f in files if f is not files[2])

    trio.run(main)


def test_write_read_truncate_roundtrip_in_ram(tmp_path):
    async def main() -> None:
        cache = make_cache(tmp_path)
        f = cache.new_file("x", "v", "x.bin", 0o644)
        data = bytes(range(256)) * 9000  # spans three 1 MiB pages
        await cache.write(f, 10, data)
        assert await cache.read(f, 0, 10) == bytes(10)
        assert await cache.read(f, 10, len(data)) == data
        await cache.truncate(f, 20)
        assert f.size == 20 and await cache.read(f, 0, 100) == bytes(10) + data[:10]
        await cache.truncate(f, 3 << 20)
        assert await cache.read(f, 0, 30) == bytes(10) + data[:10] + bytes(10)
        assert cache.arena.used_slots == 1  # only the first page holds data

    trio.run(main)
