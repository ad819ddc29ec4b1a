"""The cache without FUSE: eviction, pruning of idle metadata, sparse files."""

from __future__ import annotations

import errno
import random
from collections.abc import Callable

import pytest
import trio
from caches import make_cache, read_all
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


def test_a_write_that_waited_while_a_commit_began_sends_the_file_back_to_modified(tmp_path):
    """A write makes its file MODIFIED, then waits (here for cache space;
    also a page-in or a copy of a pinned page); a commit begins meanwhile
    (another descriptor's close: a child's exec, a reader's close) and takes
    a snapshot without the write's bytes. When the write goes on, the file
    must be MODIFIED again: the snapshot's publish leaves it so, and the
    writer's close publishes what it wrote. Left PUBLISHING, nothing would:
    the close skipped it and the file was never durable (fault trials, seed
    5 trial 12), and a crash would have recovered the snapshot's older bytes."""

    async def main() -> None:
        cache = make_cache(tmp_path, capacity=4 << 20)
        ps = cache.page_size
        f = cache.new_file("f", "v0", "f.bin", 0o644, 0, 0)
        g = cache.new_file("g", "v0", "g.bin", 0o644, 0, 0)
        head, tail = random.randbytes(2 * ps), random.randbytes(ps // 2)
        await cache.write(f, 0, head)
        await cache.write(g, 0, random.randbytes(2 * ps))  # the 4 slots are taken
        written: list[int] = []
        async with trio.open_nursery() as nursery:

            async def write_tail() -> None:
                written.append(await cache.write(f, 2 * ps, tail))

            nursery.start_soon(write_tail)
            await wait_until(lambda: cache.waiting_writers == 1)
            snap = cache.begin_publish(f, "v1")  # the commit, without the tail
            assert snap.size == 2 * ps and f.state is FileState.PUBLISHING
            cache.unlink(g)  # room: the write goes on
        assert written == [len(tail)]
        assert f.state is FileState.MODIFIED
        assert not cache.published(snap)  # its pending manifest is already outdated
        assert f.state is FileState.MODIFIED and f.modified and not f.owes_flush
        # The writer's close commits the whole file.
        snap = cache.begin_publish(f, "v2")
        assert snap.size == 2 * ps + len(tail)
        assert cache.published(snap) and f.state is FileState.PENDING
        assert await cache.read(f, 0, f.size + 1) == head + tail

    trio.run(main)


def test_a_truncate_that_waited_for_a_record_while_a_commit_began_leaves_the_file_modified(
    tmp_path,
):
    """The same for a change's first wait: a truncate of a PENDING file
    waits until the journal record listing its slots is dropped (held here
    by a save of that record); a commit that begins meanwhile takes a
    snapshot without the truncation, and the file must be MODIFIED again
    once the truncate has changed it."""

    async def main() -> None:
        cache = make_cache(tmp_path)
        f = cache.new_file("f", "v0", "f.bin", 0o644, 0, 0)
        data = random.randbytes(3 * cache.page_size)
        await cache.write(f, 0, data)
        assert cache.published(cache.begin_publish(f, "v1")) and f.state is FileState.PENDING
        release = trio.Event()
        async with trio.open_nursery() as nursery:

            async def hold_record() -> None:
                async with cache.journal.locked(("f", "v1")):
                    await release.wait()

            nursery.start_soon(hold_record)
            await trio.sleep(0.01)
            nursery.start_soon(cache.truncate, f, 10)
            await wait_until(lambda: f.state is FileState.MODIFIED)  # waiting for the drop
            snap = cache.begin_publish(f, "v2")  # the whole file: not truncated yet
            assert snap.size == len(data)
            release.set()
        assert f.size == 10 and f.state is FileState.MODIFIED
        assert not cache.published(snap) and f.state is FileState.MODIFIED
        snap = cache.begin_publish(f, "v3")
        assert snap.size == 10 and cache.published(snap) and f.state is FileState.PENDING
        assert await cache.read(f, 0, 100) == data[:10]

    trio.run(main)


def test_a_version_owed_its_flush_outlives_an_older_one_seen_at_its_name(tmp_path):
    """Another node's rewrite of the same file, older than ours (Manifest.order),
    landed over our pending version (a check and a rename are not atomic
    across nodes), and a lookup here reads it. Ours stays, to be flushed
    over it; a newer version seen there retires ours."""

    async def main() -> None:
        cache = make_cache(tmp_path)
        f = cache.new_file("x", "v0", "m.pt", 0o644, 0, 0)
        ours = random.randbytes(3000)
        await cache.write(f, 0, ours)
        snap = cache.begin_publish(f, "v2")
        assert cache.published(snap) and f.state is FileState.PENDING
        older = Manifest("x", "v3", 10, 0o600, 0, "pending", ["n3"], seq=snap.seq - 1)
        assert cache.load(older, "m.pt", 0, 0) is f
        assert (f.state, f.version, f.size, f.mode) == (FileState.PENDING, "v2", 3000, 0o644)
        assert await read_all(cache, f) == ours
        newer = Manifest("x", "v4", 10, 0o644, 0, "pending", ["n3"], seq=snap.seq + 1)
        g = cache.load(newer, "m.pt", 0, 0)
        assert g is not f and g.version == "v4" and f.unlinked

    trio.run(main)
