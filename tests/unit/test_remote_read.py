"""Pipelined reads of a file pending on other nodes (fs/read/remoteread.py), without sockets."""

from __future__ import annotations

import random

import trio
import trio.testing
from ckptfs.fs import interrupts
from ckptfs.fs.read import remoteread
from ckptfs.fs.read.remoteread import BLOCK, RemoteReader

SIZE = 5 * BLOCK + 12345
DATA = {v: random.Random(v).randbytes(SIZE) for v in ("v1", "v2")}


class Holder:
    def __init__(self) -> None:
        self.calls: list[tuple[str, int, int]] = []
        self.fail_at: set[int] = set()
        self.gate = trio.Event()
        self.gate.set()

    async def fetch(self, holders, file_id, version, offset, length, into=None):
        self.calls.append((version, offset, length))
        await self.gate.wait()
        if offset in self.fail_at:
            raise OSError(5, f"no holder served {file_id}@{version} at {offset}")
        data = DATA[version][offset : offset + length]
        if into is None:
            return data
        into[: len(data)] = data
        return memoryview(into)[: len(data)]


def test_a_sequential_reader_has_blocks_in_flight_ahead_and_gets_exact_bytes():
    async def main() -> None:
        holder = Holder()
        async with trio.open_nursery() as nursery:
            reader = RemoteReader(holder.fetch, nursery)
            got = bytearray()
            off, piece = 0, 128 << 10
            while off < SIZE:
                end = min(off + piece, SIZE)
                got += await reader.read(["n1"], "f", "v1", SIZE, off, end, sequential=off > 0)
                if off == piece:  # the second read is sequential: the next blocks start
                    await trio.testing.wait_all_tasks_blocked()
                    assert len(holder.calls) == 1 + remoteread.AHEAD
                off = end
            assert bytes(got) == DATA["v1"]
            # Every block fetched once, whole.
            assert sorted(c[1] for c in holder.calls) == [i * BLOCK for i in range(6)]
            # Another version of the same file never meets v1's blocks.
            assert (
                await reader.read(["n1"], "f", "v2", SIZE, 10, 20, sequential=False)
                == (DATA["v2"][10:20])
            )

    trio.run(main)


def test_a_failed_block_is_an_error_for_its_reader_and_is_tried_again():
    async def main() -> None:
        holder = Holder()
        holder.fail_at = {BLOCK}
        async with trio.open_nursery() as nursery:
            reader = RemoteReader(holder.fetch, nursery)
            assert (
                await reader.read(["n1"], "f", "v1", SIZE, 0, 100, sequential=False)
                == (DATA["v1"][:100])
            )
            try:
                await reader.read(["n1"], "f", "v1", SIZE, BLOCK - 10, BLOCK + 10, sequential=False)
                raise AssertionError("a failed block returned bytes")
            except OSError as exc:
                assert "no holder served" in str(exc)
            holder.fail_at = set()
            assert (
                await reader.read(["n1"], "f", "v1", SIZE, BLOCK - 10, BLOCK + 10, sequential=False)
                == DATA["v1"][BLOCK - 10 : BLOCK + 10]
            )

    trio.run(main)


def test_an_interrupted_read_ends_its_wait_and_the_block_is_fetched_again():
    """A holder that hangs: the reader fetching a block itself and a reader
    waiting for another's fetch each end with EINTR when interrupted; a
    waiter whose fetcher was interrupted fetches the block itself and gets
    exact bytes; an interrupted waiter leaves the fetch it waited for alone."""

    async def main() -> None:
        holder = Holder()
        holder.gate = trio.Event()  # hangs until set
        results: dict[str, object] = {}
        requests: dict[str, interrupts.InFlight] = {}

        async def read(name: str, off: int, end: int) -> None:
            with interrupts.handling(len(requests) + 1) as request:
                requests[name] = request
                try:
                    results[name] = await reader.read(
                        ["n1"], "f", "v1", SIZE, off, end, sequential=False
                    )
                except OSError as exc:
                    results[name] = exc

        async with trio.open_nursery() as nursery:
            reader = RemoteReader(holder.fetch, nursery)
            nursery.start_soon(read, "fetcher", 10, 20)
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(read, "waiter", 30, 40)
            await trio.testing.wait_all_tasks_blocked()
            assert len(holder.calls) == 1  # the waiter waits for the fetcher's block
            requests["fetcher"].interrupt()
            await trio.testing.wait_all_tasks_blocked()
            error = results["fetcher"]
            assert isinstance(error, interrupts.Interrupted) and error.errno == 4, error
            assert "waiter" not in results and len(holder.calls) == 2  # it fetches anew
            nursery.start_soon(read, "patient", 50, 60)  # waits for the waiter's fetch
            await trio.testing.wait_all_tasks_blocked()
            requests["patient"].interrupt()
            await trio.testing.wait_all_tasks_blocked()
            assert isinstance(results["patient"], interrupts.Interrupted)
            assert "waiter" not in results  # its fetch goes on
            holder.gate.set()
            await trio.testing.wait_all_tasks_blocked()
            assert results["waiter"] == DATA["v1"][30:40]
            assert len(holder.calls) == 2
            # The block is there for the next reader, fetched once more in all.
            assert (
                await reader.read(["n1"], "f", "v1", SIZE, 0, 5, sequential=False)
                == (DATA["v1"][:5])
            )
            assert len(holder.calls) == 2

    trio.run(main)


def test_a_read_across_blocks_keeps_its_bytes_when_the_first_block_is_reused():
    """A read of two blocks waits for the second while the first is dropped
    (the file became durable here: forget) and its buffer fills again with
    another version's block: the read still returns its own version's bytes."""

    async def main() -> None:
        holder = Holder()
        gate = trio.Event()
        plain_fetch = holder.fetch

        async def fetch(holders, file_id, version, offset, length, into=None):
            if (version, offset) == ("v1", BLOCK):
                await gate.wait()
            return await plain_fetch(holders, file_id, version, offset, length, into)

        reader = RemoteReader(fetch)
        got: list[bytes] = []

        async def across() -> None:
            data = await reader.read(
                ["n1"], "f", "v1", SIZE, BLOCK - 10, BLOCK + 10, sequential=False
            )
            got.append(bytes(data))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(across)
            await trio.testing.wait_all_tasks_blocked()  # block 0 read, block 1 waits
            reader.forget("f")  # block 0 dropped: its buffer back in the pool
            other = await reader.read(["n1"], "f", "v2", SIZE, 0, 100, sequential=False)
            assert bytes(other) == DATA["v2"][:100]  # in the reused buffer
            gate.set()
        assert got == [DATA["v1"][BLOCK - 10 : BLOCK + 10]]

    trio.run(main)


def test_blocks_stay_under_their_memory_bound(monkeypatch):
    monkeypatch.setattr(remoteread, "MAX_BYTES", 2 * BLOCK)

    async def main() -> None:
        holder = Holder()
        reader = RemoteReader(holder.fetch)
        for i in range(6):
            await reader.read(["n1"], "f", "v1", SIZE, i * BLOCK, i * BLOCK + 1, sequential=False)
            assert reader.stats()["block_bytes"] <= 2 * BLOCK
        # Buffers of dropped blocks are reused: every block still reads exactly.
        for i in reversed(range(6)):
            end = min(SIZE, (i + 1) * BLOCK)
            got = await reader.read(["n1"], "f", "v1", SIZE, i * BLOCK, end, sequential=False)
            assert bytes(got) == DATA["v1"][i * BLOCK : end]
        assert len(reader._free) <= 2
        reader.forget("f")
        assert reader.stats()["block_bytes"] == 0

    trio.run(main)
