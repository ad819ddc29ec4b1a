"""The frame cache's chunk reads when their callers are interrupted, driven
without FUSE: a chunk read that hangs in the store (an NFS server that
stopped answering: here a gate the store's read waits at), a reader that
fills the frame and readers that wait for that fill, each interrupted in
turn (what a FUSE_INTERRUPT for Ctrl-C does, interrupts.py).

tests/test_interrupts.py does the same through a real mount with the NFS
stand-in stopped; this one checks what a mount cannot show: which task fills
after which interrupt, and that every slot an abandoned read held comes
back once its thread returns.
"""

from __future__ import annotations

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
    """A chunk store whose reads wait at ``gate`` until it opens."""

    def __init__(self, backing: Path) -> None:
        super().__init__(backing)
        self.gate = threading.Event()
        self.reads_started = 0
        self._count = threading.Lock()

    def read_into(self, *args: Any, **kwargs: Any) -> Any:
        with self._count:
            self.reads_started += 1
        assert self.gate.wait(TIMEOUT), "the test never let the store answer"
        return super().read_into(*args, **kwargs)


async def until(predicate: Any, what: str) -> None:
    with trio.fail_after(TIMEOUT):
        while not predicate():
            await trio.sleep(0.005)


def test_an_interrupted_fill_or_wait_ends_at_once_and_a_waiter_reads_the_chunk_itself(
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
            # The patient reader, not failed, reads the chunk itself, into
            # other slots: the abandoned read still holds its own.
            await until(lambda: store.reads_started == 2, "the patient reader's own fill")
            assert "patient" not in outcome
            assert arena.free_slots == free_at_start - 6

            store.gate.set()
        assert outcome["patient"] == data
        # The abandoned read's slots come back once its thread has returned.
        await until(lambda: arena.free_slots == free_at_start - 3, "the abandoned slots")
        assert not any(arena.pinned(s) for s in range(arena.nslots))
        frame = frames.frames[chunk.hash]
        assert frames.evict(frame) == 3
        assert arena.free_slots == free_at_start
        assert frames.failed == 0  # an interrupt is no failed read

    trio.run(main)
