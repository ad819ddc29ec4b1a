"""Background persistence: chunk, hash, deduplicate and store closed files.

Workers take files from a trio memory channel. A file's chunks are processed
in parallel under one limiter shared by all files (``flush.workers``); each
chunk is read from the cache and hashed in a thread, and written to the
backing store only when no chunk of that hash exists yet. When every chunk is
stored, the durable manifest is published through ``publish``. A file that
was modified while it was being flushed is not marked durable: its next close
queues it again.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from .blocking import BackingIO, run_cpu
from .cache import Cache
from .cachedfile import DIRTY, DURABLE, FLUSHING, CachedFile
from .chunking import plan_chunks
from .chunkstore import chunk_hash
from .manifest import Chunk, Manifest

log = logging.getLogger("ckptfs.flusher")

Publish = Callable[[CachedFile, Callable[[Manifest | None], Manifest | None]], Awaitable[bool]]
OnDurable = Callable[[CachedFile, Manifest], Awaitable[None]]


def describe(exc: BaseException) -> str:
    """The first real cause inside (nested) exception groups, for a log line."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return f"{type(exc).__name__}: {exc}"


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
        publish: Publish,
        on_durable: OnDurable,
    ) -> None:
        self.cache = cache
        self.io = io
        self.node = node
        self.workers = workers
        self.chunk_size = chunk_size
        self.bandwidth = Bandwidth(bandwidth)
        self.publish = publish
        self.on_durable = on_durable
        self.chunk_limiter = trio.CapacityLimiter(workers)
        self._send, self._recv = trio.open_memory_channel[CachedFile](math.inf)
        self._queued: set[str] = set()
        self._again: set[str] = set()
        self._storing: dict[str, trio.Event] = {}
        self.active: dict[str, CachedFile] = {}
        # Counters for `stat`.
        self.bytes_stored = 0
        self.bytes_deduped = 0
        self.bytes_hashed = 0
        self.hash_seconds = 0.0
        self.files_durable = 0
        self.failures = 0
        self._consecutive_failures = 0
        self._window: deque[tuple[float, int]] = deque()

    def enqueue(self, f: CachedFile) -> None:
        """Queue ``f`` once. A file being flushed right now is not queued a second
        time (two workers would flush it concurrently); it is queued again when
        its current flush ends, in case it changed meanwhile."""
        if f.unlinked:
            return
        if f.file_id in self.active:
            self._again.add(f.file_id)
        elif f.file_id not in self._queued:
            self._queued.add(f.file_id)
            self._send.send_nowait(f)

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
        # a dead worker would leave files dirty forever (or end the daemon).
        async for f in self._recv:
            self._queued.discard(f.file_id)
            try:
                await self.flush_file(f)
                self._consecutive_failures = 0
            except Exception as exc:
                self.failures += 1
                self._consecutive_failures += 1
                f.state = DIRTY
                log.error("flush of %s failed, will retry: %s", f.path, describe(exc))
                await trio.sleep(min(60.0, 2.0 ** min(self._consecutive_failures, 6)))
                self.enqueue(f)

    async def flush_file(self, f: CachedFile) -> None:
        if f.unlinked or f.state == DURABLE or f.gen != f.published_gen:
            return  # gone, already done, or still being written (its close queues it)
        gen = f.gen
        f.state = FLUSHING
        f.flushed_bytes = 0
        self.active[f.file_id] = f
        try:
            kind, ranges = await run_cpu(
                plan_chunks,
                lambda off, n: self.cache.read_sync(f, off, n),
                f.size,
                self.chunk_size,
                limiter=self.cache.hash_limiter,
            )
            chunks: list[Chunk | None] = [None] * len(ranges)
            async with trio.open_nursery() as nursery:
                for i, (off, length) in enumerate(ranges):
                    nursery.start_soon(self._store_chunk, f, i, off, length, chunks)
            if f.gen != gen or f.unlinked:
                if not f.unlinked:
                    f.state = DIRTY
                log.info("%s changed while it was flushed; it will be flushed again", f.path)
                return
            manifest = Manifest(
                file_id=f.file_id,
                version=f.version,
                size=f.size,
                mode=f.mode,
                mtime_ns=f.mtime_ns,
                state="durable",
                holders=[self.node],
                chunks=[c for c in chunks if c is not None],
                chunking=kind,
            )

            # Checked again under the publish lock: a newer version may have
            # been published while this one's last chunks were stored.
            def fresh(current: Manifest | None) -> Manifest | None:
                if f.gen != gen or f.unlinked:
                    return None
                if current is not None and current.version != f.version:
                    return None  # a newer version was published (by another node)
                manifest.mode, manifest.mtime_ns = f.mode, f.mtime_ns
                return manifest

            if not await self.publish(f, fresh):
                log.info("%s was replaced or removed before it became durable", f.path)
                f.state = DIRTY
                return
            if f.gen != gen:  # written to while the manifest was being stored
                f.state = DIRTY
                return
            f.set_base(manifest.chunks, f.size)
            f.chunking = kind
            f.dirty_pages.clear()
            f.state = DURABLE
            f.durable_event.set()
            self.files_durable += 1
            await self.on_durable(f, manifest)
        finally:
            self.active.pop(f.file_id, None)
            if f.state == FLUSHING:
                f.state = DIRTY
            if f.file_id in self._again:
                self._again.discard(f.file_id)
                if f.state != DURABLE:
                    self.enqueue(f)

    async def _store_chunk(
        self, f: CachedFile, i: int, off: int, length: int, out: list[Chunk | None]
    ) -> None:
        async with self.chunk_limiter:

            def read_and_hash() -> tuple[bytes, str, float]:
                data = self.cache.read_sync(f, off, length)
                t0 = time.perf_counter()
                digest = chunk_hash(data)
                return data, digest, time.perf_counter() - t0

            # Through the backing-store runner: spilled pages are read from there.
            data, digest, hash_time = await self.io.run(read_and_hash, what=f"read of {f.path}")
            self.bytes_hashed += length
            self.hash_seconds += hash_time
            # One store per digest at a time: two files with the same bytes
            # flushed together would otherwise both find the chunk missing.
            while (busy := self._storing.get(digest)) is not None:
                await busy.wait()
            done = self._storing[digest] = trio.Event()
            try:
                what = f"flush of {f.path}"
                if await self.io.run(self.cache.store.touch, digest, what=what):
                    self.bytes_deduped += length
                else:
                    await self.bandwidth.acquire(length)
                    written = await self.io.run(self.cache.store.put, digest, data, what=what)
                    self.bytes_stored += written
                    self.bytes_deduped += length - written
                    self._window.append((time.monotonic(), written))
            finally:
                del self._storing[digest]
                done.set()
            out[i] = Chunk(off, length, digest)
            f.flushed_bytes += length

    def throughput(self, window: float = 10.0) -> float:
        """Bytes/s written to the backing store over the last ``window`` seconds."""
        now = time.monotonic()
        while self._window and self._window[0][0] < now - window:
            self._window.popleft()
        return sum(n for _, n in self._window) / window

    def stats(self) -> dict[str, Any]:
        return {
            "queued": self.queued,
            "active": [f.path for f in self.active.values()],
            "bytes_stored": self.bytes_stored,
            "bytes_deduped": self.bytes_deduped,
            "bytes_hashed": self.bytes_hashed,
            "hash_throughput": self.bytes_hashed / self.hash_seconds if self.hash_seconds else 0,
            "throughput": self.throughput(),
            "files_durable": self.files_durable,
            "failures": self.failures,
            "bandwidth_cap": self.bandwidth.rate,
        }
