"""The frame cache's chunk reads when their callers are interrupted, driven
without FUSE: a chunk read that hangs in the store (an NFS server that
stopped answering: here a gate the store's read waits at), a reader that
fills the frame and readers that wait for that fill, each interrupted in
turn (what a FUSE_INTERRUPT for Ctrl-C does, interrupts.py).

tests/mount/test_interrupts.py does the same through a real mount with the NFS
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
from ckptfs.fs.content.arena import Arena
from ckptfs.fs.read.frames import FrameCache
from ckptfs.fs.store.blocking import BackingIO
from ckptfs.fs.store.chunkstore import ChunkStore, chunk_hash
from ckptfs.fs.store.manifest import Chunk
from waits import until

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


class Node:
    """A frame cache over its own arena and hung store, holding chunks of
    random bytes, and FUSE readers of them, each in a request of its own (as
    the session marks a READ), with how each ended: the bytes,
    "interrupted", or (errno, trio time)."""

    def __init__(self, root: Path, sizes: list[int], timeout: float = 60.0, threads: int = 16):
        self.arena = Arena(root / "arena", 16 * MiB)
        self.store = HungStore(root / "backing")
        self.io = BackingIO(timeout, max_threads=threads)
        self.frames = FrameCache(self.arena, self.store, self.io)
        self.data = [os.urandom(size) for size in sizes]
        self.chunks = []
        for data in self.data:
            self.store.put(chunk_hash(data), data)
            self.chunks.append(Chunk(0, len(data), chunk_hash(data)))
        self.free_at_start = self.arena.free_slots
        self.inflight: dict[str, interrupts.InFlight] = {}
        self.outcome: dict[str, Any] = {}

    async def read(
        self, name: str, k: int = 0, task_status: Any = trio.TASK_STATUS_IGNORED
    ) -> None:
        chunk = self.chunks[k]
        with interrupts.handling(len(self.inflight) + 1) as request:
            self.inflight[name] = request
            task_status.started()
            try:
                frame = await self.frames.acquire(chunk, name, self.arena.alloc)
            except interrupts.Interrupted:
                self.outcome[name] = "interrupted"
                return
            except OSError as exc:
                self.outcome[name] = (exc.errno, trio.current_time())
                return
            assert frame is not None
            self.outcome[name] = self.frames.copy(frame, 0, chunk.length)

    async def interrupt(self, name: str) -> Any:
        """Interrupt ``name``'s request; how its read ended."""
        self.inflight[name].interrupt()
        await until(lambda: name in self.outcome, f"the interrupt of {name}")
        return self.outcome[name]

    def no_pins(self) -> bool:
        return not any(self.arena.pinned(s) for s in range(self.arena.nslots))


def test_an_interrupted_fill_or_wait_ends_at_once_and_the_read_goes_on_for_the_others(
    tmp_path: Path,
) -> None:
    n = Node(tmp_path, [2 * MiB + 12345])  # three slots, the last one partly
    store, frames = n.store, n.frames

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            frames.nursery = nursery  # as the cache's background nursery
            await nursery.start(n.read, "first")
            await until(lambda: store.reads_started == 1, "the first reader's fill")
            await nursery.start(n.read, "waiter")
            await nursery.start(n.read, "patient")
            await until(lambda: frames.waits == 2, "two readers waiting for the fill")

            assert await n.interrupt("waiter") == "interrupted"
            assert store.reads_started == 1  # the fill goes on for the others

            assert await n.interrupt("first") == "interrupted"
            # The patient reader, not failed, waits for the same read, which
            # goes on in its thread: no second read of the chunk.
            await trio.sleep(0.1)
            assert "patient" not in n.outcome
            assert store.reads_started == 1
            assert frames.stats()["chunk_reads_left_running"] == 1
            assert n.arena.free_slots == n.free_at_start - 3

            # A reader that comes now waits for that read too.
            await nursery.start(n.read, "late")
            await until(lambda: frames.waits == 3, "the late reader waiting")

            store.gate.set()
        assert n.outcome["patient"] == n.outcome["late"] == n.data[0]
        assert store.reads_started == 1 and frames.reads == 1
        assert frames.stats()["chunk_reads_left_running"] == 0
        assert n.no_pins()
        assert frames.evict(frames.frames[n.chunks[0].hash]) == 3
        assert n.arena.free_slots == n.free_at_start
        assert frames.failed == 0  # an interrupt is no failed read

    trio.run(main)


def test_a_read_left_running_lets_go_of_its_frame_when_the_cache_closes(tmp_path: Path) -> None:
    """A read whose reader was interrupted goes on, holding its frame until
    its deadline; if the cache's background nursery (the deadline's timer)
    is cancelled first, the frame fails at once and its waiters fill it
    themselves, rather than wait for a store that may never answer."""
    n = Node(tmp_path, [MiB])
    store, frames = n.store, n.frames

    async def main() -> None:
        async with trio.open_nursery() as readers:
            async with trio.open_nursery() as background:
                frames.nursery = background  # as the cache's background nursery
                await readers.start(n.read, "first")
                await until(lambda: store.reads_started == 1, "the first reader's fill")
                await readers.start(n.read, "patient")
                await until(lambda: frames.waits == 1, "a reader waiting for the fill")
                assert await n.interrupt("first") == "interrupted"
                assert frames.stats()["chunk_reads_left_running"] == 1
                background.cancel_scope.cancel()
            assert frames.stats()["chunk_reads_left_running"] == 0
            await until(lambda: store.reads_started == 2, "the waiting reader's own fill")
            store.gate.set()
        assert n.outcome["patient"] == n.data[0]

    trio.run(main)


def test_a_read_interrupted_while_it_waits_for_a_thread_gives_its_slots_back_at_once(
    tmp_path: Path,
) -> None:
    """Every store thread busy in the hung store (one here): a second
    chunk's read waits for a thread, and its reader is interrupted. The read
    never begins, so nothing will release its slots later: they come back
    at once, and the first read still completes."""
    n = Node(tmp_path, [MiB + 777, MiB + 777], threads=1)  # two slots each

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            n.frames.nursery = nursery
            await nursery.start(n.read, "in the store", 0)
            await until(lambda: n.store.reads_started == 1, "the first read in the store")
            await nursery.start(n.read, "queued", 1)
            await until(lambda: n.arena.free_slots == n.free_at_start - 4, "the reservation")
            await trio.sleep(0.05)  # it waits for the only thread
            assert n.store.reads_started == 1
            assert await n.interrupt("queued") == "interrupted"
            await until(lambda: n.arena.free_slots == n.free_at_start - 2, "the queued slots")
            n.store.gate.set()
        assert n.outcome["in the store"] == n.data[0]
        assert n.store.reads_started == 1  # the read given up on was never made
        assert n.no_pins()
        assert n.frames.evict(n.frames.frames[n.chunks[0].hash]) == 2
        assert n.arena.free_slots == n.free_at_start

    trio.run(main)


def test_a_read_that_fails_after_its_reader_was_interrupted_fails_its_waiters(
    tmp_path: Path,
) -> None:
    """The read that went on for the others fails when the store answers:
    they get its error, as if its reader had waited, the frame goes and its
    slots come back, and the next reader tries the store again."""
    n = Node(tmp_path, [MiB + 99])

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            n.frames.nursery = nursery
            nursery.start_soon(n.read, "first")
            await until(lambda: n.store.reads_started == 1, "the first read in the store")
            nursery.start_soon(n.read, "waiter")
            await until(lambda: n.frames.waits == 1, "the waiter")
            assert await n.interrupt("first") == "interrupted"
            n.store.fail = True
            n.store.gate.set()
        assert n.outcome["waiter"][0] == errno.EIO
        assert n.frames.failed == 1 and n.chunks[0].hash not in n.frames.frames
        assert n.arena.free_slots == n.free_at_start
        n.store.fail = False
        await n.read("next")
        assert n.outcome["next"] == n.data[0] and n.store.reads_started == 2

    trio.run(main)


def test_a_reader_interrupted_before_its_fill_leaves_the_chunk_to_the_next_reader(
    tmp_path: Path,
) -> None:
    """A request interrupted at an earlier wait that could not end (a peer's
    read, say) comes to a chunk read: it ends at once, asks the store for
    nothing, and the frame it reserved goes, so the next reader reads it."""
    n = Node(tmp_path, [MiB + 5])
    n.store.gate.set()

    async def main() -> None:
        with interrupts.handling(99) as request:
            request.interrupt()
            try:
                await n.frames.acquire(n.chunks[0], "interrupted", n.arena.alloc)
            except interrupts.Interrupted:
                pass
            else:
                raise AssertionError("the interrupted request read the chunk")
        assert n.store.reads_started == 0 and n.chunks[0].hash not in n.frames.frames
        assert n.arena.free_slots == n.free_at_start and n.frames.failed == 0
        await n.read("next")
        assert n.outcome["next"] == n.data[0]

    trio.run(main)


def test_a_read_that_goes_on_for_the_others_fails_them_at_its_deadline(tmp_path: Path) -> None:
    """The read an interrupted reader left to the others keeps the deadline
    its wait had (the store timeout): when the store still hangs then, the
    waiters get EIO and the store is marked down, as if the reader had
    waited; the slots come back once the thread returns."""
    n = Node(tmp_path, [MiB + 3], timeout=0.5)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            n.frames.nursery = nursery
            nursery.start_soon(n.read, "first")
            await until(lambda: n.store.reads_started == 1, "the first read in the store")
            started = trio.current_time()
            nursery.start_soon(n.read, "waiter")
            await until(lambda: n.frames.waits == 1, "the waiter")
            assert await n.interrupt("first") == "interrupted"
            await until(lambda: "waiter" in n.outcome, "the deadline")
            err, when = n.outcome["waiter"]
            assert err == errno.EIO and when - started < 0.5 + 2
            assert n.io.health == "down" and n.io.timeouts == 1 and n.frames.failed == 1
            assert n.chunks[0].hash not in n.frames.frames
            n.store.gate.set()
            await until(lambda: n.arena.free_slots == n.free_at_start, "the slots")
        assert n.frames.reads == 0 and n.store.reads_started == 1

    trio.run(main)
