"""The cache without FUSE: eviction, pruning of idle metadata, sparse files."""

from __future__ import annotations

import errno
import random
from collections.abc import Callable

import pytest
import trio
from caches import make_cache
from ckptfs.fs import interrupts
from ckptfs.fs.cache import cache as cache_mod
from ckptfs.fs.cache.writing import MAX_FILE_SIZE
from ckptfs.fs.content.state import FileState
from ckptfs.fs.interrupts import interruptible
from ckptfs.fs.store.manifest import Manifest


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


def test_an_interrupted_write_keeps_what_it_wrote_before_its_wait(tmp_path):
    """A write that waits for cache space (nothing spills or flushes here)
    and whose caller is interrupted (FUSE_INTERRUPT): it returns the bytes of
    the pages it wrote before the wait, a short write; one that wrote nothing
    fails with EINTR. Either way the cache's accounting is as before the wait,
    and a task the handler started is not interrupted with it."""

    async def main() -> None:
        cache = make_cache(tmp_path, capacity=4 << 20)
        ps = cache.page_size
        f = cache.new_file("x", "v", "x.bin", 0o644, 0, 0)
        old = random.randbytes(3 * ps + 100)
        assert await cache.write(f, 0, old) == len(old)  # the 4 slots are taken
        new = random.randbytes(3 * ps)
        results: list[object] = []
        others: list[str] = []

        async def other() -> None:
            with interruptible("a task the handler started"):
                await trio.sleep(0.2)
            others.append("not interrupted")

        async def handler(unique: int, off: int, data: bytes, nursery: trio.Nursery) -> None:
            with interrupts.handling(unique) as inflight:
                inflights[unique] = inflight
                nursery.start_soon(other)
                try:
                    results.append(await cache.write(f, off, data))
                except OSError as exc:
                    results.append(exc)

        inflights: dict[int, interrupts.InFlight] = {}
        async with trio.open_nursery() as nursery:
            # Page 3 is in RAM (its first 100 bytes): written; page 4 waits.
            nursery.start_soon(handler, 1, 3 * ps + 100, new, nursery)
            await wait_until(lambda: cache.waiting_writers == 1)
            inflights[1].interrupt()
        assert results == [ps - 100]
        assert cache.waiting_writers == 0 and f.size == 4 * ps
        expected = old + new[: ps - 100]
        assert await cache.read(f, 0, f.size + 1) == expected

        async with trio.open_nursery() as nursery:
            nursery.start_soon(handler, 2, 4 * ps, new, nursery)  # waits at once
            await wait_until(lambda: cache.waiting_writers == 1)
            inflights[2].interrupt()
        (exc,) = results[1:]
        assert isinstance(exc, interrupts.Interrupted) and exc.errno == errno.EINTR
        assert "x.bin" in str(exc)
        assert await cache.read(f, 0, f.size + 1) == expected
        assert others == ["not interrupted"] * 2
        assert f.dirty_count == f.ram_count == 4 == cache.dirty_pages
        assert sum(1 for p in f.pages.values() if p.in_ram) == 4

    trio.run(main)


async def wait_until(predicate: Callable[[], bool], timeout: float = 10) -> None:
    with trio.fail_after(timeout):
        while not predicate():
            await trio.sleep(0.01)
