"""The cache without FUSE: eviction, pruning of idle metadata, sparse files."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest
import trio
from ckptfs.fs import cache as cache_mod
from ckptfs.fs.arena import Arena
from ckptfs.fs.blocking import BackingIO
from ckptfs.fs.cache import MAX_FILE_SIZE, Cache
from ckptfs.fs.chunkstore import ChunkStore
from ckptfs.fs.journal import Journal
from ckptfs.fs.manifest import Manifest
from ckptfs.fs.state import FileState


def make_cache(tmp_path: Path, capacity: int = 8 << 20) -> Cache:
    arena = Arena(tmp_path / "arena", capacity)
    store = ChunkStore(tmp_path / "backing")
    return Cache(arena, store, BackingIO(10), Journal(tmp_path / "journal"), node="n1")


def test_prune_forgets_the_oldest_idle_files_beyond_the_cap(tmp_path, monkeypatch):
    monkeypatch.setattr(cache_mod, "MAX_IDLE_FILES", 3)
    monkeypatch.setattr(cache_mod, "PRUNE_SLACK", 0)

    async def main() -> None:
        cache = make_cache(tmp_path)
        files = [
            cache.load(Manifest(f"id{i}", "v", 0, 0o644, 0, "durable"), f"f{i}", 0, 0)
            for i in range(8)
        ]
        for i, f in enumerate(files):
            f.last_access = i
        files[0].handles = 1  # open: kept
        files[2].state = FileState.MODIFIED  # not durable: kept
        let_go: list[str] = []
        cache.unreference = lambda f: let_go.append(f.file_id)  # an inode lets go of it
        assert cache.prune() == 3  # 6 idle, cap 3: the three least recently used go
        assert sorted(cache.files) == ["id0", "id2", "id5", "id6", "id7"]
        assert sorted(let_go) == ["id1", "id3", "id4"]

    trio.run(main)


def test_write_read_truncate_roundtrip_in_ram(tmp_path):
    async def main() -> None:
        cache = make_cache(tmp_path)
        f = cache.new_file("x", "v", "x.bin", 0o644, 0, 0)
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


def test_huge_sparse_files_cost_no_memory_and_beyond_the_maximum_is_efbig(tmp_path):
    async def main() -> None:
        cache = make_cache(tmp_path)
        f = cache.new_file("x", "v", "x.bin", 0o644, 0, 0)
        await cache.truncate(f, MAX_FILE_SIZE)  # 16 TiB of holes
        await cache.write(f, MAX_FILE_SIZE - 5, b"tail!")
        assert len(f.pages) == 1 and cache.arena.used_slots == 1
        assert await cache.read(f, MAX_FILE_SIZE - 10, 10) == bytes(5) + b"tail!"
        assert await cache.read(f, 1 << 40, 4) == bytes(4)
        for call in (cache.truncate(f, MAX_FILE_SIZE + 1), cache.write(f, MAX_FILE_SIZE, b"x")):
            with pytest.raises(OSError) as exc:
                await call
            assert exc.value.errno == errno.EFBIG

    trio.run(main)
