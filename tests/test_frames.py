"""The frame cache's chunk reads when their callers are interrupted, driven
without FUSE: a chunk read that hangs in the store (an NFS server that
stopped answering: here a gate the store's read waits at), a reader that
fills the frame and readers that wait for that fill, each interrupted in
turn (what a FUSE_INTERRUPT for Ctrl-C does, interrupts.py).

tests/test_interrupts.py does the same through a real mount with the NFS
stand-in stopped; this one checks what a mount cannot show: that an
interrupted reader's store read goes on for the others (no second read of
the chunk while the store hangs), and that every slot comes back.
"""

from __future__ import annotations

import errno
import os
import threading
from pathlib import Path
from typing import Any

import trio
from ckptfs.fs import interrupts
from ckptfs.fs.arena import Arena
from ckptfs.fs.blocking import BackingIO
from ckptfs.fs.chunkstore import ChunkStore, chunk_hash
from ckptfs.fs.frames import FrameCache
from ckptfs.fs.manifest import Chunk

MiB = 1 << 20
TIMEOUT = 20


class HungStore(ChunkStore):
    """A chunk store whose reads wait at ``gate`` until it opens (and then
    fail, with ``fail``)."""

    def __init__(self, backing: Path) -> None:
        super().__init__(backing)
        self.gate = threading.Event()
        self.fail = False
        self.reads_started = 0
        self._count = threading.Lock()

    def read_into(self, *args: Any, **kwargs: Any) -> Any:
        with self._count:
            self.reads_started += 1
        assert self.gate.wait(TIMEOUT), "the test never let the store answer"
        if self.fail:
            raise OSError(errno.EIO, "the NFS server came back broken")
        return super().read_into(*args, **kwargs)


async def until(predicate: Any, what: str) -> None:
    with trio.fail_after(TIMEOUT):
        while not predicate():
            await trio.sleep(0.005)


def test_an_interrupted_fill_or_wait_ends_at_once_and_the_read_goes_on_for_the_others(
    tmp_path: Path,
) -> None:
    arena = Arena(tmp_path / "arena", 16 * MiB)
    store = HungStore(tmp_path / "backing")
    data = os.urandom(2 * MiB + 12345)  # three slots, the last one partly
    digest = chunk_hash(data)
    store.put(digest, data)
    chunk = Chunk(0, len(data), digest)
    frames = FrameCache(arena, store, BackingIO(60.0))
    free_at_start = arena.free_slots
    inflight: dict[str, interrupts.InFlight] = {}
    outcome: dict[str, bytes | str] = {}

    async def reader(name: str, unique: int, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        with interrupts.handling(unique) as request:  # as the session marks a READ
            inflight[name] = request
            task_status.started()
            try:
                frame = await frames.acquire(chunk, name, arena.alloc)
            except interrupts.Interrupted:
                outcome[name] = "interrupted"
                return
            assert frame is not None
            outcome[name] = frames.copy(frame, 0, chunk.length)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            frames.nursery = nursery  # as the cache's background nursery
            await nursery.start(reader, "first", 1)
            await until(lambda: store.reads_started == 1, "the first reader's fill")
            await nursery.start(reader, "waiter", 2)
            await nursery.start(reader, "patient", 3)
            await until(lambda: frames.waits == 2, "two readers waiting for the fill")

            inflight["waiter"].interrupt()
            await until(lambda: "waiter" in outcome, "the waiter's interrupt")
            assert outcome["waiter"] == "interrupted"
            assert store.reads_started == 1  # the fill goes on for the others

            inflight["first"].interrupt()
            await until(lambda: "first" in outcome, "the filler's interrupt")
            assert outcome["first"] == "interrupted"
            # The patient reader, not failed, waits for the same read, which
            # goes on in its thread: no second read of the chunk.
            await trio.sleep(0.1)
            assert "patient" not in outcome
            assert store.reads_started == 1
            assert arena.free_slots == free_at_start - 3

            # A reader that comes now waits for that read too.
            await nursery.start(reader, "late", 4)
            await until(lambda: frames.waits == 3, "the late reader waiting")

            store.gate.set()
        assert outcome["patient"] == outcome["late"] == data
        assert store.reads_started == 1 and frames.reads == 1
        assert not any(arena.pinned(s) for s in range(arena.nslots))
        frame = frames.frames[chunk.hash]
        assert frames.evict(frame) == 3
        assert arena.free_slots == free_at_start
        assert frames.failed == 0  # an interrupt is no failed read

    trio.run(main)


def test_a_read_interrupted_while_it_waits_for_a_thread_gives_its_slots_back_at_once(
    tmp_path: Path,
) -> None:
    """Every store thread busy in the hung store (one here): a second
    chunk's read waits for a thread, and its reader is interrupted. The read
    never begins, so nothing will release its slots later: they come back
    at once, and the first read still completes."""
    arena = Arena(tmp_path / "arena", 16 * MiB)
    store = HungStore(tmp_path / "backing")
    chunks = []
    for _ in range(2):
        data = os.urandom(MiB + 777)  # two slots each
        store.put(chunk_hash(data), data)
        chunks.append((Chunk(0, len(data), chunk_hash(data)), data))
    frames = FrameCache(arena, store, BackingIO(60.0, max_threads=1))
    free_at_start = arena.free_slots
    inflight: dict[str, interrupts.InFlight] = {}
    outcome: dict[str, bytes | str] = {}

    async def reader(name: str, chunk: Chunk, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        with interrupts.handling(len(inflight) + 1) as request:
            inflight[name] = request
            task_status.started()
            try:
                frame = await frames.acquire(chunk, name, arena.alloc)
            except interrupts.Interrupted:
                outcome[name] = "interrupted"
                return
            assert frame is not None
            outcome[name] = frames.copy(frame, 0, chunk.length)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(reader, "in the store", chunks[0][0])
            await until(lambda: store.reads_started == 1, "the first read in the store")
            await nursery.start(reader, "queued", chunks[1][0])
            await until(lambda: arena.free_slots == free_at_start - 4, "the second reservation")
            await trio.sleep(0.05)  # it waits for the only thread
            assert store.reads_started == 1
            inflight["queued"].interrupt()
            await until(lambda: "queued" in outcome, "the queued reader's interrupt")
            assert outcome["queued"] == "interrupted"
            await until(lambda: arena.free_slots == free_at_start - 2, "the queued read's slots")
            store.gate.set()
        assert outcome["in the store"] == chunks[0][1]
        assert store.reads_started == 1  # the read given up on was never made
        assert not any(arena.pinned(s) for s in range(arena.nslots))
        assert frames.evict(frames.frames[chunks[0][0].hash]) == 2
        assert arena.free_slots == free_at_start

    trio.run(main)


def test_a_read_that_fails_after_its_reader_was_interrupted_fails_its_waiters(
    tmp_path: Path,
) -> None:
    """The read that went on for the others fails when the store answers:
    they get EIO, as if its reader had waited, the frame goes and its slots
    come back, and the next reader tries the store again."""
    arena = Arena(tmp_path / "arena", 16 * MiB)
    store = HungStore(tmp_path / "backing")
    data = os.urandom(MiB + 99)
    store.put(chunk_hash(data), data)
    chunk = Chunk(0, len(data), chunk_hash(data))
    frames = FrameCache(arena, store, BackingIO(60.0))
    free_at_start = arena.free_slots
    inflight: dict[str, interrupts.InFlight] = {}
    outcome: dict[str, bytes | str] = {}

    async def reader(name: str, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        with interrupts.handling(len(inflight) + 1) as request:
            inflight[name] = request
            task_status.started()
            try:
                frame = await frames.acquire(chunk, name, arena.alloc)
            except interrupts.Interrupted:
                outcome[name] = "interrupted"
                return
            except OSError as exc:
                outcome[name] = f"errno {exc.errno}"
                return
            assert frame is not None
            outcome[name] = frames.copy(frame, 0, chunk.length)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            frames.nursery = nursery
            await nursery.start(reader, "first")
            await until(lambda: store.reads_started == 1, "the first read in the store")
            await nursery.start(reader, "waiter")
            await until(lambda: frames.waits == 1, "the waiter")
            inflight["first"].interrupt()
            await until(lambda: "first" in outcome, "the filler's interrupt")
            store.fail = True
            store.gate.set()
        assert outcome == {"first": "interrupted", "waiter": f"errno {errno.EIO}"}
        assert frames.failed == 1 and chunk.hash not in frames.frames
        assert arena.free_slots == free_at_start
        store.fail = False
        async with trio.open_nursery() as nursery:
            nursery.start_soon(reader, "next")
        assert outcome["next"] == data and store.reads_started == 2

    trio.run(main)


def test_a_reader_interrupted_before_its_fill_leaves_the_chunk_to_the_next_reader(
    tmp_path: Path,
) -> None:
    """A request interrupted at an earlier wait that could not end (a peer's
    read, say) comes to a chunk read: it ends at once, asks the store for
    nothing, and the frame it reserved goes, so the next reader reads it."""
    arena = Arena(tmp_path / "arena", 16 * MiB)
    store = HungStore(tmp_path / "backing")
    store.gate.set()
    data = os.urandom(MiB + 5)
    store.put(chunk_hash(data), data)
    chunk = Chunk(0, len(data), chunk_hash(data))
    frames = FrameCache(arena, store, BackingIO(60.0))
    free_at_start = arena.free_slots

    async def main() -> None:
        with interrupts.handling(1) as request:
            request.interrupt()
            try:
                await frames.acquire(chunk, "interrupted", arena.alloc)
            except interrupts.Interrupted:
                pass
            else:
                raise AssertionError("the interrupted request read the chunk")
        assert store.reads_started == 0 and chunk.hash not in frames.frames
        assert arena.free_slots == free_at_start and frames.failed == 0
        with trio.fail_after(TIMEOUT), interrupts.handling(2):
            frame = await frames.acquire(chunk, "next", arena.alloc)
        assert frame is not None and frames.copy(frame, 0, chunk.length) == data

    trio.run(main)


def test_a_read_that_goes_on_for_the_others_fails_them_at_its_deadline(tmp_path: Path) -> None:
    """The read an interrupted reader left to the others keeps the deadline
    its wait had (the store timeout): when the store still hangs then, the
    waiters get EIO and the store is marked down, as if the reader had
    waited; the slots come back once the thread returns."""
    arena = Arena(tmp_path / "arena", 16 * MiB)
    store = HungStore(tmp_path / "backing")
    data = os.urandom(MiB + 3)
    store.put(chunk_hash(data), data)
    chunk = Chunk(0, len(data), chunk_hash(data))
    io = BackingIO(0.5)
    frames = FrameCache(arena, store, io)
    free_at_start = arena.free_slots
    inflight: dict[str, interrupts.InFlight] = {}
    outcome: dict[str, Any] = {}

    async def read(name: str) -> None:
        with interrupts.handling(len(inflight) + 1) as request:
            inflight[name] = request
            try:
                await frames.acquire(chunk, name, arena.alloc)
                outcome[name] = "read"
            except interrupts.Interrupted:
                outcome[name] = "interrupted"
            except OSError as exc:
                outcome[name] = (exc.errno, trio.current_time())

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            frames.nursery = nursery
            nursery.start_soon(read, "first")
            await until(lambda: store.reads_started == 1, "the first read in the store")
            started = trio.current_time()
            nursery.start_soon(read, "waiter")
            await until(lambda: frames.waits == 1, "the waiter")
            inflight["first"].interrupt()
            await until(lambda: outcome.get("first") == "interrupted", "the filler's interrupt")
            await until(lambda: isinstance(outcome.get("waiter"), tuple), "the deadline")
            err, when = outcome["waiter"]
            assert err == errno.EIO and when - started < 0.5 + 2
            assert io.health == "down" and io.timeouts == 1 and frames.failed == 1
            assert chunk.hash not in frames.frames
            store.gate.set()
            await until(lambda: arena.free_slots == free_at_start, "the slots, once it returned")
        assert frames.reads == 0 and store.reads_started == 1

    trio.run(main)
