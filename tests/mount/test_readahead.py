"""Pipelined cold reads: read-ahead, shared chunk fetches, verification, memory.

The cache-level tests drive Cache.read with the read-ahead running (hosted by
the cache's background task) and count reads of the chunk store per chunk.
The mount-level tests do the same through FUSE, counting with the daemon's
``chunk_reads`` in ``ckptfs stat --json``.
"""

from __future__ import annotations

import errno
import os
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
import trio
from caches import make_cache, read_all
from ckptfs.fs.cache.cache import Cache
from ckptfs.fs.content.arena import Arena
from ckptfs.fs.content.cachedfile import CachedFile
from ckptfs.fs.store.chunkstore import ChunkCorrupt, ChunkStore, chunk_hash
from ckptfs.fs.store.manifest import Chunk, Manifest, new_id, read_manifest
from data import rand
from waits import wait_for

MiB = 1 << 20


# ----- the cache, without FUSE -------------------------------------------------------------


class CountingStore(ChunkStore):
    """A chunk store that counts the reads of each chunk (from worker threads)."""

    def __init__(self, backing: Path) -> None:
        super().__init__(backing)
        self.reads: Counter[str] = Counter()
        self._lock = threading.Lock()

    def read_into(self, digest, length, targets, **kw):  # noqa: ANN001, ANN003, ANN201
        with self._lock:
            self.reads[digest] += 1
        time.sleep(0.002)  # a disk's latency: readers would wait at every chunk without read-ahead
        return super().read_into(digest, length, targets, **kw)

    def read_range(self, digest, length, start, count, *, what=""):  # noqa: ANN001, ANN201
        with self._lock:
            self.reads[digest] += 1
        return super().read_range(digest, length, start, count, what=what)


def counted_cache(tmp_path: Path, capacity: int) -> tuple[Cache, CountingStore]:
    store = CountingStore(tmp_path / "backing")
    return make_cache(tmp_path, capacity=capacity, store=store, io_timeout=30), store


def durable_file(cache: Cache, store: ChunkStore, data: bytes, chunk_len: int) -> CachedFile:
    """A durable file of ``data`` in ``chunk_len`` chunks, as if loaded from its manifest."""
    chunks = []
    for off in range(0, len(data), chunk_len):
        piece = data[off : off + chunk_len]
        store.put(chunk_hash(piece), piece)
        chunks.append(Chunk(off, len(piece), chunk_hash(piece)))
    m = Manifest(new_id(), new_id(), len(data), 0o644, 0, "durable", chunks=chunks)
    return cache.load(m, "f.bin", 0, 0)


def with_background(cache: Cache, body: Callable[[], Awaitable[None]]) -> None:
    """Run ``body`` with the cache's background task (spiller, read-ahead) running."""

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(cache.run_spiller)
            await trio.sleep(0)
            await body()
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_sequential_cold_read_reads_each_chunk_once_ahead_of_the_reader(tmp_path):
    cache, store = counted_cache(tmp_path, 64 * MiB)
    data = rand(24 * 1536 * 1024, 1)  # 24 chunks of 1.5 MiB: chunks straddle pages
    f = durable_file(cache, store, data, 1536 * 1024)

    async def body() -> None:
        assert await read_all(cache, f) == data

    with_background(cache, body)
    assert set(store.reads) == {c.hash for c in f.base.chunks}
    assert set(store.reads.values()) == {1}, "a chunk was read from the store twice"
    ra = cache.readahead.stats()
    # The reader found most chunks read ahead (or queued, and took them over).
    assert ra["started"] >= 20 and ra["used"] >= 20, ra
    assert ra["failed"] == 0 and ra["unread_bytes"] == 0


def test_eight_concurrent_readers_share_each_chunk_fetch(tmp_path):
    cache, store = counted_cache(tmp_path, 64 * MiB)
    data = rand(16 * 2 * MiB + 12345, 2)
    f = durable_file(cache, store, data, 2 * MiB)
    results: list[bytes] = []

    async def reader(piece: int) -> None:
        results.append(await read_all(cache, f, piece))

    async def body() -> None:
        async with trio.open_nursery() as nursery:
            for i in range(8):
                nursery.start_soon(reader, (i + 1) * 128 * 1024)

    with_background(cache, body)
    assert results == [data] * 8
    assert set(store.reads.values()) == {1}, store.reads
    assert len(store.reads) == len(f.base.chunks)


def test_a_prefetched_corrupt_chunk_is_eio_for_its_reader_and_never_bytes(tmp_path):
    cache, store = counted_cache(tmp_path, 64 * MiB)
    data = rand(10 * MiB, 3)
    f = durable_file(cache, store, data, MiB)
    bad = f.base.chunks[4]
    path = store.path_for(bad.hash)
    os.chmod(path, 0o644)
    with open(path, "r+b") as chunk_file:
        chunk_file.seek(1000)
        byte = chunk_file.read(1)
        chunk_file.seek(1000)
        chunk_file.write(bytes([byte[0] ^ 0x40]))

    async def body() -> None:
        for off in range(0, 4 * MiB, 256 * 1024):  # sequential: chunk 4 is read ahead
            assert await cache.read(f, off, 256 * 1024) == data[off : off + 256 * 1024]
        with trio.fail_after(10):
            while store.reads[bad.hash] == 0 or cache.frames.known(bad.hash):
                await trio.sleep(0.01)  # the read-ahead of chunk 4 has failed
        assert cache.readahead.stats()["failed"] == 1
        for off in (4 * MiB, 4 * MiB + 1000, 5 * MiB - 1):
            with pytest.raises(OSError) as exc:
                await cache.read(f, off, 4096)
            assert exc.value.errno in (errno.EIO, None)  # ChunkCorrupt: EIO at the FUSE layer
        # The ranges before and after it still read fine.
        assert await cache.read(f, 0, MiB) == data[:MiB]
        assert await cache.read(f, 5 * MiB, 2 * MiB) == data[5 * MiB : 7 * MiB]

    with_background(cache, body)


def test_a_rewritten_file_never_reads_the_prefetched_old_version(tmp_path):
    cache, store = counted_cache(tmp_path, 64 * MiB)
    old = rand(8 * MiB, 4)
    f = durable_file(cache, store, old, MiB)
    new = rand(8 * MiB, 5)

    async def body() -> None:
        for off in range(0, 2 * MiB, 256 * 1024):
            await cache.read(f, off, 256 * 1024)  # the old version is being read ahead
        # A new version of the same file arrives (another node's rewrite).
        chunks = []
        for off in range(0, len(new), MiB):
            piece = new[off : off + MiB]
            store.put(chunk_hash(piece), piece)
            chunks.append(Chunk(off, len(piece), chunk_hash(piece)))
        m = Manifest(f.file_id, new_id(), len(new), 0o644, 0, "durable", chunks=chunks)
        g = cache.load(m, "f.bin", 0, 0)
        assert g is not f
        assert await read_all(cache, g) == new

    with_background(cache, body)


def test_a_cold_read_completes_with_the_cache_full_of_dirty_bytes(tmp_path):
    """Readers never wait for memory: with every slot holding bytes that are
    not yet stored anywhere else (nothing can be evicted or spilled: no
    flusher here), a cold read still completes, with the right bytes."""
    cache, store = counted_cache(tmp_path, 16 * MiB)
    data = rand(12 * MiB, 11)
    f = durable_file(cache, store, data, MiB)
    dirty = cache.new_file(new_id(), new_id(), "dirty.bin", 0o644, 0, 0)
    blob = rand(cache.arena.nslots * cache.page_size, 12)

    async def body() -> None:
        with trio.fail_after(20):
            await cache.write(dirty, 0, blob)
        assert cache.dirty_pages == cache.arena.used_slots == cache.arena.nslots
        with trio.fail_after(20):
            assert await read_all(cache, f, 256 * 1024) == data
        # The dirty bytes are untouched.
        assert await cache.read(dirty, 0, len(blob)) == blob

    with_background(cache, body)
    assert set(store.reads) == {c.hash for c in f.base.chunks}


def test_read_ahead_stays_within_its_share_of_a_small_cache(tmp_path):
    cache, store = counted_cache(tmp_path, 16 * MiB)
    data = rand(48 * MiB, 6)  # three times the cache
    f = durable_file(cache, store, data, MiB)
    peak = {"unread": 0, "used": 0}

    async def body() -> None:
        out = bytearray()
        while len(out) < f.size:
            out += await cache.read(f, len(out), 256 * 1024)
            peak["unread"] = max(peak["unread"], cache.frames.unread_bytes)
            peak["used"] = max(peak["used"], cache.arena.used_slots)
        assert bytes(out) == data

    with_background(cache, body)
    assert peak["used"] <= cache.arena.nslots
    assert peak["unread"] <= cache.readahead.budget
    # Consumed chunks are evicted before the ones read ahead: each read once.
    assert sum(store.reads.values()) <= 1.05 * len(f.base.chunks), store.reads


@pytest.mark.parametrize("direct", [True, False])
@pytest.mark.parametrize("length", [1, 4096, 5000, 3 * MiB + 17])
def test_chunk_reads_into_slots_are_verified(tmp_path, direct, length):
    """O_DIRECT or buffered: a chunk reads back exactly, and a chunk that is
    short, long or changed is ChunkCorrupt, whatever the block alignment."""
    store = ChunkStore(tmp_path)
    arena = Arena(tmp_path / "arena", 8 * MiB)
    slots = [arena.alloc() for _ in range(-(-length // MiB))]
    views = [arena.slot_view(s) for s in slots]  # whole slots: room to round up
    data = rand(length, length)
    digest = chunk_hash(data)
    store.put(digest, data)
    store.read_into(digest, length, views, direct=direct)
    assert b"".join(views)[:length] == data
    path = store.path_for(digest)
    os.chmod(path, 0o644)
    for damaged in (data[:-1], data + b"x", data[:-1] + bytes([data[-1] ^ 1])):
        path.write_bytes(damaged)
        with pytest.raises(ChunkCorrupt):
            store.read_into(digest, length, views, direct=direct)
    for view in views:
        view.release()
    arena.close()


def test_a_filesystem_without_o_direct_reads_buffered(tmp_path, monkeypatch):
    store = ChunkStore(tmp_path)
    data = rand(5000, 11)
    store.put(chunk_hash(data), data)
    real_open = os.open

    def no_direct(path, flags, *args):  # noqa: ANN001, ANN002, ANN202
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", no_direct)
    buf = bytearray(8192)
    store.read_into(chunk_hash(data), len(data), [memoryview(buf)], direct=True)
    assert bytes(buf[:5000]) == data and not store.direct_ok


# ----- through FUSE -----------------------------------------------------------------------


def drop_kernel_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def cold(m, name: str) -> None:  # noqa: ANN001 - a conftest Mount
    """Evicted from the ckptfs cache and from the kernel's page cache."""
    m.cli("evict", str(m.mnt))
    drop_kernel_cache(m.mnt / name)
    assert m.stat()["cache"]["used"] == 0


def test_mount_eight_readers_of_one_cold_file_read_each_chunk_once(mounted):
    m = mounted
    data = rand(64 * MiB + 4321, 7)
    (m.mnt / "f.bin").write_bytes(data)
    m.wait_durable()
    chunks = read_manifest(m.backing / "f.bin").chunks
    assert len(chunks) >= 16
    cold(m, "f.bin")
    before = m.stat()["cache"]
    results: list[bytes] = [b""] * 8

    def reader(i: int) -> None:
        with open(m.mnt / "f.bin", "rb", buffering=0) as src:
            out = bytearray()
            while piece := src.read(4 * MiB):
                out += piece
            results[i] = bytes(out)

    threads = [threading.Thread(target=reader, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert all(r == data for r in results)
    after = m.stat()["cache"]
    assert after["chunk_reads"] - before["chunk_reads"] == len(chunks)
    assert after["chunk_bytes_read"] - before["chunk_bytes_read"] == len(data)


def test_mount_corrupt_chunk_is_eio_at_its_range_and_never_wrong_bytes(mounted):
    m = mounted
    data = rand(40 * MiB, 8)
    (m.mnt / "f.bin").write_bytes(data)
    m.wait_durable()
    chunks = read_manifest(m.backing / "f.bin").chunks
    bad = chunks[6]
    path = ChunkStore(m.backing).path_for(bad.hash)
    os.chmod(path, 0o644)
    with open(path, "r+b") as chunk_file:
        chunk_file.seek(12345)
        byte = chunk_file.read(1)
        chunk_file.seek(12345)
        chunk_file.write(bytes([byte[0] ^ 1]))
    m.allowed_log = ["does not match its hash"]
    cold(m, "f.bin")
    fd = os.open(m.mnt / "f.bin", os.O_RDONLY)
    try:
        # Sequential up to 2 MiB short of the bad chunk (the kernel's own
        # read-ahead goes up to 2 MiB further): ckptfs reads the bad chunk ahead.
        for off in range(0, bad.offset - 2 * MiB, MiB):
            assert os.pread(fd, MiB, off) == data[off : off + MiB]
        wait_for_stat(m, lambda s: s["cache"]["chunk_reads_failed"] >= 1, "the read-ahead")
        for off in (bad.offset, bad.offset + 12345, bad.end - 1):
            with pytest.raises(OSError) as exc:
                os.pread(fd, 4096, off)
            assert exc.value.errno == errno.EIO
        # Earlier and later ranges still read fine.
        assert os.pread(fd, MiB, 0) == data[:MiB]
        assert os.pread(fd, MiB, bad.end) == data[bad.end : bad.end + MiB]
    finally:
        os.close(fd)


def test_mount_a_name_renamed_over_during_read_ahead_serves_each_version_whole(mounted):
    """A reader holds the old file open while its read-ahead runs; another file
    is renamed over its name. The open descriptor keeps reading the old bytes
    to the end, and a new open of the name reads only the new ones."""
    m = mounted
    old, new = rand(48 * MiB + 123, 21), rand(40 * MiB + 7, 22)
    (m.mnt / "ckpt.pt").write_bytes(old)
    (m.mnt / "ckpt.pt.tmp").write_bytes(new)
    m.wait_durable()
    cold(m, "ckpt.pt")
    drop_kernel_cache(m.mnt / "ckpt.pt.tmp")
    started = m.stat()["cache"]["readahead"]["started"]
    with open(m.mnt / "ckpt.pt", "rb", buffering=0) as reader:
        got = bytearray(reader.read(8 * MiB))
        assert m.stat()["cache"]["readahead"]["started"] > started  # chunks are being read ahead
        os.replace(m.mnt / "ckpt.pt.tmp", m.mnt / "ckpt.pt")
        assert (m.mnt / "ckpt.pt").read_bytes() == new
        while piece := reader.read(4 * MiB):
            got += piece
    assert got == old
    assert (m.mnt / "ckpt.pt").read_bytes() == new


def test_mount_cold_read_of_a_file_larger_than_the_cache_stays_in_budget(mounts):
    m = mounts()
    m.mount(cache_size="64MiB")
    data = rand(160 * MiB, 9)
    (m.mnt / "f.bin").write_bytes(data)
    m.wait_durable()
    chunks = read_manifest(m.backing / "f.bin").chunks
    cold(m, "f.bin")
    before = m.stat()["cache"]
    peak = {"used": 0, "unread": 0, "samples": 0}
    done = threading.Event()

    lock = threading.Lock()

    def sample() -> None:
        cache = m.stat()["cache"]
        with lock:
            peak["used"] = max(peak["used"], cache["used"])
            peak["unread"] = max(peak["unread"], cache["readahead"]["unread_bytes"])
            peak["samples"] += 1

    # Sampled between the reader's reads (40 of them, however fast the read
    # is) and by a thread while a read waits.
    def watch() -> None:
        while not done.is_set():
            sample()
            time.sleep(0.05)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        with open(m.mnt / "f.bin", "rb", buffering=0) as src:
            got = bytearray()
            while piece := src.read(4 * MiB):
                got += piece
                sample()
    finally:
        done.set()
        watcher.join(30)
    assert got == data
    after = m.stat()
    cache = after["cache"]
    # The peaks bound something only if the watcher saw the read going on:
    # a watcher that died at once would leave them at 0.
    assert peak["samples"] >= 40 and peak["used"] > 0, peak
    assert peak["used"] <= cache["capacity"] and cache["used"] <= cache["capacity"]
    assert peak["unread"] <= cache["readahead"]["budget"]
    read = cache["chunk_reads"] - before["chunk_reads"]
    assert len(chunks) <= read <= 1.05 * len(chunks)
    assert after["memory"]["anon"] < 256 * MiB  # the daemon's own memory, outside the arena


def wait_for_stat(m, predicate, what: str, timeout: float = 20) -> None:  # noqa: ANN001
    wait_for(lambda: predicate(m.stat()), timeout, lambda: f"{what}: {m.stat()['cache']}")
