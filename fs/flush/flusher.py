"""Background persistence: chunk, hash, deduplicate and store PENDING files.

Workers take files from a trio memory channel. The cache gives each flush a
snapshot whose RAM slots are pinned; a pinned slot is never reused and never
written in place (a write copies the page first), so worker threads hash and
store a chunk straight from the arena without copying it. A chunk is written
to the backing store only when no chunk of that hash exists yet. When every
chunk is stored, the durable manifest is published and the cache is asked to
mark the snapshot durable; it refuses if the file changed since the snapshot,
and the file's next commit queues it again.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections import Counter, deque
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import trio
from ckptfs.fs.cache.cache import Cache
from ckptfs.fs.content.arena import Arena
from ckptfs.fs.content.cachedfile import CachedFile, ChunkMap, Snapshot
from ckptfs.fs.content.state import PageState
from ckptfs.fs.store.blocking import BackingIO, Call, in_background, on_loop_later
from ckptfs.fs.store.chunking import plan_chunks
from ckptfs.fs.store.chunkstore import Buffer, ChunkStore, pieces_hash
from ckptfs.fs.store.manifest import Chunk, Manifest
from ckptfs.fs.store.publish import Published

log = logging.getLogger("ckptfs.flusher")

Publish = Callable[[CachedFile, Callable[[Manifest | None], Manifest | None]], Awaitable[Published]]
OnDurable = Callable[[CachedFile, Manifest], Awaitable[None]]
_ZEROS = memoryview(bytes(1 << 20))


def describe(exc: BaseException) -> str:
    """The first real cause inside (nested) exception groups, for a log line."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return f"{type(exc).__name__}: {exc}"


# Throughputs are measured over this many seconds: long enough to span
# several chunks under a bandwidth cap, short enough to follow a change.
RATE_WINDOW = 10.0


class Rate:
    """Bytes per second over the last ``window`` seconds (monotonic clock).
    Samples older than the window are dropped as new ones come, so an idle
    daemon nobody asks keeps no history."""

    def __init__(self, window: float = RATE_WINDOW) -> None:
        self.window = window
        self._samples: deque[tuple[float, int]] = deque()

    def add(self, nbytes: int) -> None:
        now = time.monotonic()
        self._samples.append((now, nbytes))
        self._trim(now)

    def per_second(self) -> float:
        self._trim(time.monotonic())
        return sum(n for _, n in self._samples) / self.window

    def _trim(self, now: float) -> None:
        while self._samples and self._samples[0][0] < now - self.window:
            self._samples.popleft()


class Bandwidth:
    """A pacing limiter: at most ``rate`` bytes/s on average (0 = unlimited)."""

    def __init__(self, rate: int) -> None:
        self.rate = rate
        self._next = 0.0

    async def acquire(self, nbytes: int) -> None:
        if not self.rate:
            return
        now = trio.current_time()
        start = max(now, self._next)
        self._next = start + nbytes / self.rate
        await trio.sleep_until(start)

    def refund(self, nbytes: int) -> None:
        """Give back the share of bytes acquired but not written."""
        if self.rate and nbytes > 0:
            self._next = max(trio.current_time(), self._next - nbytes / self.rate)


class SnapshotReader:
    """Blocking access to a snapshot's bytes, for worker threads.

    RAM pages come back as views of their (pinned) slots; spilled pages and
    base chunks are read from the store and verified; holes are zeros.
    """

    def __init__(self, snap: Snapshot, arena: Arena, store: ChunkStore, what: str) -> None:
        self.snap = snap
        self.arena = arena
        self.store = store
        self.what = what
        self.ps = arena.slot_size
        self._chunk: tuple[str, bytes] | None = None  # the last stored chunk read

    def pieces(self, off: int, n: int) -> list[Buffer]:
        out: list[Buffer] = []
        end = min(off + n, self.snap.size)
        pos = off
        while pos < end:
            p, o = divmod(pos, self.ps)
            stop = min((p + 1) * self.ps, end)
            page = self.snap.pages.get(p)
            if page is not None and page.in_ram:
                valid = max(0, min(stop - pos, page.fill - o))
                if valid:
                    out.append(self.arena.slot_view(page.slot, o, valid))
                if valid < stop - pos:
                    out.append(_ZEROS[: stop - pos - valid])
            else:
                if page is not None and page.state is PageState.SPILLED and page.chunk is not None:
                    c = page.chunk  # valid up to the page's fill
                    sources = ChunkMap.of([c], c.offset + page.fill).pieces(pos, stop)
                else:
                    sources = self.snap.base.pieces(pos, stop)
                for start, length, chunk in sources:
                    if chunk is None:
                        out.append(_ZEROS[:length])
                    else:
                        data = self._chunk_data(chunk)
                        rel = start - chunk.offset
                        out.append(memoryview(data)[rel : rel + length])
            pos = stop
        return out

    def _chunk_data(self, chunk: Chunk) -> bytes:
        if self._chunk is not None and self._chunk[0] == chunk.hash:
            return self._chunk[1]
        data = self.store.get(chunk.hash, chunk.length, what=self.what)
        self._chunk = (chunk.hash, data)
        return data

    def read(self, off: int, n: int) -> bytes:
        return b"".join(bytes(p) for p in self.pieces(off, n))


def plan(
    snap: Snapshot, reader: SnapshotReader, chunk_size: int
) -> tuple[str, list[tuple[int, int]]]:
    """Chunk boundaries for a snapshot (blocking). Holes are left out: a
    sparse file costs chunks only for the bytes it holds."""
    extents = snap.extents(reader.ps)
    if snap.size == 0 or extents == [(0, snap.size)]:
        return plan_chunks(reader.read, snap.size, chunk_size)
    ranges = []
    for start, end in extents:
        pos = start
        while pos < end:
            stop = min(end, (pos // chunk_size + 1) * chunk_size)
            ranges.append((pos, stop - pos))
            pos = stop
    return "fixed", ranges


# Files up to this size are flushed in one backing-store call.
SMALL_FILE = 1 << 20
MIN_IN_FLIGHT = 2  # chunk writes in flight at once, whatever flush.workers is


class Flusher:
    def __init__(
        self,
        cache: Cache,
        io: BackingIO,
        *,
        node: str,
        workers: int,
        bandwidth: int,
        chunk_size: int,
        settle: float = 0.0,
        publish: Publish,
        on_durable: OnDurable,
    ) -> None:
        self.cache = cache
        self.io = io
        self.node = node
        self.workers = workers
        self.chunk_size = chunk_size
        self.settle = settle  # seconds from a file's queueing to its flush
        self.bandwidth = Bandwidth(bandwidth)
        self.publish = publish
        self.on_durable = on_durable
        # Chunks in flight at once, over all files being flushed: never fewer
        # than two, so that one chunk's write overlaps another's fsync.
        self.chunk_limiter = trio.CapacityLimiter(max(MIN_IN_FLIGHT, workers))
        # Each queued file with when it was queued (trio's clock).
        self._send, self._recv = trio.open_memory_channel[tuple[CachedFile, float]](math.inf)
        self._queued: set[CachedFile] = set()
        self._again: set[CachedFile] = set()
        # An operator's flush (and an unmount) cuts the settle short for every
        # file queued until then (hurry), and for files someone waits to see
        # durable whenever they are queued again (awaited).
        self._hurried_at = -math.inf
        self._hurry = trio.Event()
        self._awaited: Counter[CachedFile] = Counter()
        self.active: set[CachedFile] = set()
        # Counters for `stat`.
        self.bytes_stored = 0
        self.bytes_deduped = 0
        self.bytes_hashed = 0
        self.hash_seconds = 0.0
        self.files_durable = 0
        self.failures = 0
        self._consecutive_failures = 0
        # Bytes written to the store; and bytes of files flushed, written or
        # found there already (dedup): the rate at which flushes progress.
        self._written = Rate()
        self._progressed = Rate()

    def enqueue(self, f: CachedFile) -> None:
        """Queue ``f`` once. A file being flushed right now is not queued a second
        time (two workers would flush it concurrently); it is queued again when
        its current flush ends, in case it changed meanwhile."""
        if not f.owes_flush:
            return
        if f in self.active:
            self._again.add(f)
        elif f not in self._queued:
            self._queued.add(f)
            self._send.send_nowait((f, trio.current_time()))

    def hurry(self) -> None:
        """Files queued until now start their flush without waiting for the
        rest of ``settle``: someone waits for them to be durable."""
        self._hurried_at = trio.current_time()
        self._hurry.set()
        self._hurry = trio.Event()

    @contextlib.contextmanager
    def awaited(self, files: list[CachedFile]) -> Iterator[None]:
        """While this is held, ``files`` skip the settle each time they are
        queued (a file changed during its flush is queued again)."""
        self._awaited.update(files)
        self.hurry()
        try:
            yield
        finally:
            self._awaited.subtract(files)
            self._awaited = +self._awaited  # without the files no drain awaits any more

    async def _settled(self, f: CachedFile, queued_at: float) -> None:
        if queued_at <= self._hurried_at or f in self._awaited:
            return
        with trio.move_on_at(queued_at + self.settle):
            await self._hurry.wait()

    @property
    def queued(self) -> int:
        return len(self._queued)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            for _ in range(self.workers):
                nursery.start_soon(self._worker)
            task_status.started()

    async def _worker(self) -> None:
        # Nothing may end this loop: chunk tasks fail as ExceptionGroups, and
        # a dead worker would leave files pending forever (or end the daemon).
        async for f, queued_at in self._recv:
            # Queued again meanwhile: flushed once, with what it holds then.
            await self._settled(f, queued_at)
            self._queued.discard(f)
            try:
                await self.flush_file(f)
                self._consecutive_failures = 0
            except Exception as exc:
                self.failures += 1
                self._consecutive_failures += 1
                log.error("flush of %s failed, will retry: %s", f.path, describe(exc))
                await trio.sleep(min(60.0, 2.0 ** min(self._consecutive_failures, 6)))
                self.enqueue(f)

    async def flush_file(self, f: CachedFile) -> None:
        snap = self.cache.flush_snapshot(f)
        if snap is None:
            return  # not ours to flush, already durable, or changed (its commit queues it)
        self.active.add(f)
        try:
            await self._flush(snap)
        finally:
            self.active.discard(f)
            self.cache.flush_ended(snap)
            target = snap.file  # a fork may have taken the snapshot's content over
            for g in {f, target}:
                if g in self._again:
                    self._again.discard(g)
                    self.enqueue(g)

    async def _flush(self, snap: Snapshot) -> None:
        what = snap.file.path
        reader = SnapshotReader(snap, self.cache.arena, self.cache.store, what)
        if snap.size <= SMALL_FILE and not self.bandwidth.rate:
            kind, stored = await self._store_small(snap, reader)
        else:
            kind, ranges = await self._in_thread(
                snap, lambda: plan(snap, reader, self.chunk_size), f"plan of {what}"
            )
            chunks: list[Chunk | None] = [None] * len(ranges)
            async with trio.open_nursery() as nursery:
                for i, (off, length) in enumerate(ranges):
                    nursery.start_soon(self._store_chunk, snap, i, off, length, chunks)
            stored = [c for c in chunks if c is not None]
        f = snap.file
        manifest = Manifest(
            file_id=f.file_id,
            version=snap.version,
            size=snap.size,
            mode=f.mode,
            mtime_ns=f.mtime_ns,
            state="durable",
            holders=[self.node],
            chunks=stored,
            chunking=kind,
            atime_ns=f.atime_ns,
            seq=snap.seq,
        )

        # Checked again under the publish lock: the file may have changed; and
        # the backing store must still hold the pending manifest of this very
        # version (another node may have published a newer one meanwhile).
        def fresh() -> Manifest | None:
            if not self._unchanged(snap):
                return None
            manifest.mode, manifest.mtime_ns, manifest.atime_ns = f.mode, f.mtime_ns, f.atime_ns
            return manifest

        result = (
            await self.publish(snap.file, fresh, snap.version) if self._unchanged(snap) else None
        )
        if result is Published.NAME_GONE:
            # Its name was removed or replaced in the backing store (by another
            # node, or it was a version being rewritten that was renamed away).
            log.info("%s no longer names this file; not making it durable", snap.file.path)
            self.cache.unlink(snap.file)
            return
        if result is Published.STALE and self._unchanged(snap):
            # Nothing changed here, yet the backing store names another version:
            # another node rewrote the file. Ours is obsolete; publishing it
            # would put an older version over a newer one, and keeping it
            # pending would leave a flush owed for ever.
            log.info("%s was rewritten elsewhere; this version is dropped, not flushed", what)
            self.cache.unlink(snap.file)
            return
        if result is not Published.DONE:
            log.info("%s changed while it was flushed; its next commit flushes it", what)
            return
        if self.cache.mark_durable(snap, stored, kind):
            self.files_durable += 1
            await self.on_durable(snap.file, manifest)
        else:
            log.info("%s changed while its durable manifest was written", snap.file.path)

    @staticmethod
    def _unchanged(snap: Snapshot) -> bool:
        f = snap.file
        return f.owes_flush and f.version == snap.version and f.content_gen == snap.content_gen

    async def _store_chunk(
        self, snap: Snapshot, i: int, off: int, length: int, out: list[Chunk | None]
    ) -> None:
        """Hash one chunk and store it unless the store has it: one thread hop.

        Each hop to a thread and back costs about 250 us here, plus the GIL
        handed around: hashing, the dedup check and the write used to be three
        hops. Now they are one (``ChunkStore.put`` checks for the chunk first,
        and makes a second put of a digest being stored wait for the first,
        which keeps each digest stored once however many files carry it).
        Under a bandwidth cap the stored bytes are paced before they are
        written, so the hop only hashes and checks; a chunk that is missing
        then takes a second hop, after its turn under the cap.
        """
        what = snap.file.path
        store = self.cache.store
        paced = bool(self.bandwidth.rate)
        async with self.chunk_limiter:
            if not self._unchanged(snap):
                return  # superseded (rewritten, replaced, removed): nothing will publish it
            reader = SnapshotReader(snap, self.cache.arena, store, what)

            def hash_and_store() -> tuple[str, int | None, float]:
                pieces = reader.pieces(off, length)
                t0 = time.perf_counter()
                digest = pieces_hash(pieces)
                hash_time = time.perf_counter() - t0
                if paced:  # None: missing, to be stored in its turn
                    return digest, (0 if store.touch(digest) else None), hash_time
                return digest, store.put(digest, pieces), hash_time

            digest, written, hash_time = await self._in_thread(
                snap, hash_and_store, f"flush of {what}"
            )
            self.bytes_hashed += length
            self.hash_seconds += hash_time
            if written is None:
                await self.bandwidth.acquire(length)

                def store_it() -> int:
                    return store.put(digest, reader.pieces(off, length))

                written = await self._in_thread(snap, store_it, f"flush of {what}")
                # Another flush stored it meanwhile: its turn was not used.
                self.bandwidth.refund(length - written)
            self.bytes_stored += written
            self.bytes_deduped += length - written
            if written:
                self._written.add(written)
                self.io.wrote()  # room in the store again, if it was full
            out[i] = Chunk(off, length, digest)
            self.cache.flushed(snap.file, length)
            self._progressed.add(length)

    async def _store_small(self, snap: Snapshot, reader: SnapshotReader) -> tuple[str, list[Chunk]]:
        """Plan, hash and store a small file in one backing-store call: for a
        directory of small files the round trips, not the bytes, are the cost.
        Two files with the same small chunk store it once (``ChunkStore.put``
        makes the second wait for the first)."""
        store = self.cache.store

        def plan_and_store() -> tuple[str, list[tuple[Chunk, int]], float]:
            kind, ranges = plan(snap, reader, self.chunk_size)
            done, hash_time = [], 0.0
            for off, length in ranges:
                pieces = reader.pieces(off, length)
                t0 = time.perf_counter()
                digest = pieces_hash(pieces)
                hash_time += time.perf_counter() - t0
                written = store.put(digest, pieces)  # 0 if it was there: dedup
                done.append((Chunk(off, length, digest), written))
            return kind, done, hash_time

        async with self.chunk_limiter:
            kind, done, hash_time = await self._in_thread(
                snap, plan_and_store, f"flush of {snap.file.path}"
            )
        self.hash_seconds += hash_time
        for chunk, written in done:
            self.bytes_hashed += chunk.length
            self.bytes_stored += written
            self.bytes_deduped += chunk.length - written
            self._written.add(written)
            self.cache.flushed(snap.file, chunk.length)
            self._progressed.add(chunk.length)
        return kind, [chunk for chunk, _ in done]

    async def _in_thread(self, snap: Snapshot, fn: Callable[[], Any], what: str) -> Any:
        """``fn`` in a backing-store thread that reads the snapshot's pinned slots,
        at a lower CPU priority than the daemon's (a flush is background work).

        If the loop gives up on it, the snapshot's pins stay until the thread
        ends, whatever the flush does meanwhile.
        """
        self.cache.thread_started(snap)
        call: Call[Any] = Call(on_loop_later(self.cache.thread_ended, snap))
        try:
            return await self.io.run(in_background(fn), what=what, call=call)
        finally:
            if not call.abandoned():
                self.cache.thread_ended(snap)

    def throughput(self) -> float:
        """Bytes/s written to the backing store over the last RATE_WINDOW seconds."""
        return self._written.per_second()

    def progress_throughput(self) -> float:
        """Bytes/s of files flushed (stored, or already in the store) over the
        last RATE_WINDOW seconds: what the time until durable is reckoned from."""
        return self._progressed.per_second()

    def stats(self) -> dict[str, Any]:
        return {
            "queued": self.queued,
            "active": sorted(f.path for f in self.active),
            "bytes_stored": self.bytes_stored,
            "bytes_deduped": self.bytes_deduped,
            "bytes_hashed": self.bytes_hashed,
            "hash_throughput": self.bytes_hashed / self.hash_seconds if self.hash_seconds else 0,
            "throughput": self.throughput(),
            "files_durable": self.files_durable,
            "failures": self.failures,
            # Flushes failed in a row, the last one included: 0 once one succeeds.
            "failing": self._consecutive_failures,
            "progress_throughput": self.progress_throughput(),
            "bandwidth_cap": self.bandwidth.rate,
        }
