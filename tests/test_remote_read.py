"""Pipelined reads of a file pending on other nodes (fs/remoteread.py), without sockets."""

from __future__ import annotations

import random

import trio
import trio.testing
from ckptfs.fs import remoteread
from ckptfs.fs.remoteread import BLOCK, RemoteReader

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
