"""Representative fetch in one process: the rendezvous choice, and a node
filling frames from a representative over a real loopback connection (one
store read for many requests, verified, a mismatch falls back to the store).

The mounted, four-daemon version is tests/cluster/test_peers_restore.py.
"""

from __future__ import annotations

import logging
import os
import threading
from functools import partial
from pathlib import Path

import pytest
import trio
from ckptfs.fs.content.arena import Arena
from ckptfs.fs.read.frames import FrameCache, FrameState
from ckptfs.fs.store.blocking import BackingIO
from ckptfs.fs.store.chunkstore import ChunkStore, chunk_hash
from ckptfs.fs.store.manifest import Chunk
from ckptfs.peer.reads.represent import ChunkServer, RepresentativeFetch, _parse, representative
from ckptfs.peer.transport.transport import PeerClient, Request, Response, serve
from waits import run_bounded

SECRET = b"test-secret-0123456789abcdef"
CLUSTER = "cluster-rep"
MiB = 1 << 20


def digests(n: int) -> list[str]:
    return [chunk_hash(i.to_bytes(8, "little")) for i in range(n)]


def test_rendezvous_is_stable_spread_and_moves_only_the_dead_nodes_chunks() -> None:
    nodes = ["n1", "n2", "n3", "n4"]
    chosen = {d: representative(d, nodes) for d in digests(4000)}
    assert chosen == {d: representative(d, list(reversed(nodes))) for d in chosen}
    shares = [sum(1 for r in chosen.values() if r == n) / len(chosen) for n in nodes]
    assert all(0.2 < s < 0.3 for s in shares), shares
    without = {d: representative(d, ["n1", "n2", "n4"]) for d in chosen}
    moved = [d for d in chosen if without[d] != chosen[d]]
    assert moved and all(chosen[d] == "n3" for d in moved)
    assert all(without[d] != "n3" for d in chosen)


@pytest.mark.parametrize(
    "meta",
    [
        {"hash": "x" * 32, "length": 10, "offset": 0, "count": 10},
        {"hash": "a" * 32, "length": 0, "offset": 0, "count": 1},
        {"hash": "a" * 32, "length": 10, "offset": 5, "count": 6},
        {"hash": "a" * 32, "length": 300 * MiB, "offset": 0, "count": 1},
        {"hash": "a" * 32, "length": 64 * MiB, "offset": 0, "count": 9 * MiB},
        {"hash": "a" * 32, "length": "ten", "offset": 0, "count": 1},
    ],
)
def test_malformed_or_unbounded_chunk_requests_are_refused(meta: dict) -> None:
    with pytest.raises(ValueError):
        _parse(meta)


class Side:
    """One node's frame cache over its own arena and backing directory."""

    def __init__(self, root: Path, name: str) -> None:
        (root / name).mkdir()
        self.arena = Arena(root / name / "arena", 16 * MiB)
        self.store = ChunkStore(root / name / "backing")
        self.frames = FrameCache(self.arena, self.store, BackingIO(10.0))

    async def read(self, chunk: Chunk) -> bytes:
        frame = await self.frames.acquire(chunk, "ckpt.pt", self.arena.alloc)
        assert frame is not None
        return self.frames.copy(frame, 0, chunk.length)


def chunk_for(rep: str, nodes: list[str]) -> tuple[Chunk, bytes]:
    """A 2.5 MiB chunk (three pieces of a 1 MiB slot) that ``rep`` represents."""
    while True:
        data = os.urandom(2 * MiB + MiB // 2)
        digest = chunk_hash(data)
        if representative(digest, nodes) == rep:
            return Chunk(0, len(data), digest), data


async def with_cluster(tmp_path: Path, test, *, corrupt: bool = False) -> None:
    """``test(srv, cli, fetch)``: node "srv" serves chunks, node "cli" fills
    its frames from it."""
    srv, cli = Side(tmp_path, "srv"), Side(tmp_path, "cli")
    server = ChunkServer(srv.frames, srv.arena.alloc)

    async def handler(peer: str, request: Request) -> Response:
        response = await server.handle(peer, request)
        if corrupt and response.ok and request.meta["offset"] == 0:
            data = bytearray(response.payload)
            data[7] ^= 1
            if response.release is not None:
                response.release()
            return Response(meta=response.meta, payload=bytes(data))
        return response

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(
            partial(
                serve,
                "127.0.0.1",
                0,
                node="srv",
                secret=SECRET,
                cluster_hash=CLUSTER,
                handler=handler,
            )  # fmt: skip
        )
        port = listeners[0].socket.getsockname()[1]
        async with PeerClient(node="cli", secret=SECRET, cluster_hash=CLUSTER) as client:
            fetch = RepresentativeFetch(
                "cli",
                live_nodes=lambda: ["cli", "srv"],
                addresses={"srv": ("127.0.0.1", port)},
                client=lambda: client,
                timeout=5.0,
            )
            cli.frames.remote = fetch.fill
            await test(srv, cli, fetch, server)
        nursery.cancel_scope.cancel()


def test_a_chunk_is_read_once_by_its_representative_for_concurrent_readers(tmp_path) -> None:
    async def test(srv: Side, cli: Side, fetch: RepresentativeFetch, server: ChunkServer) -> None:
        chunk, data = chunk_for("srv", ["cli", "srv"])
        srv.store.put(chunk.hash, data)  # only the representative's store has it
        other = Side(tmp_path, "cli2")
        other.frames.remote = fetch.fill  # a second node asking the same representative
        got: list[bytes] = []
        async with trio.open_nursery() as nursery:
            for side in (cli, cli, other, other):
                nursery.start_soon(lambda s=side: _append(got, s.read(chunk)))
        assert got == [data] * 4
        assert srv.frames.reads == 1  # one store read served every request
        assert cli.frames.reads == other.frames.reads == 0
        assert fetch.chunks_fetched == 2 and fetch.fallbacks == 0
        assert server.chunks_served == 2 and server.bytes_served == 2 * len(data)
        # A chunk this node represents itself is read from its own store.
        own, own_data = chunk_for("cli", ["cli", "srv"])
        cli.store.put(own.hash, own_data)
        assert await cli.read(own) == own_data and cli.frames.reads == 1

    run_bounded(lambda: with_cluster(tmp_path, test))


async def _append(out: list[bytes], coro) -> None:
    out.append(await coro)


def test_bytes_that_do_not_match_the_hash_fall_back_to_the_store(tmp_path, caplog) -> None:
    async def test(srv: Side, cli: Side, fetch: RepresentativeFetch, server: ChunkServer) -> None:
        chunk, data = chunk_for("srv", ["cli", "srv"])
        srv.store.put(chunk.hash, data)
        cli.store.put(chunk.hash, data)
        with caplog.at_level(logging.INFO, logger="ckptfs.peer.represent"):
            assert await cli.read(chunk) == data
        assert fetch.fallbacks == 1 and fetch.chunks_fetched == 0
        assert cli.frames.reads == 1  # read from its own store instead
        assert "do not match the hash" in caplog.text and "representative srv" in caplog.text

    run_bounded(lambda: with_cluster(tmp_path, test, corrupt=True))


def test_a_representative_that_cannot_read_the_chunk_is_a_fallback(tmp_path, caplog) -> None:
    async def test(srv: Side, cli: Side, fetch: RepresentativeFetch, server: ChunkServer) -> None:
        chunk, data = chunk_for("srv", ["cli", "srv"])
        cli.store.put(chunk.hash, data)  # srv's store lacks it: it answers with an error
        with caplog.at_level(logging.INFO, logger="ckptfs.peer.represent"):
            assert await cli.read(chunk) == data
        assert fetch.fallbacks == 1 and server.failures >= 1
        assert "is missing" in caplog.text
        # Not a reason to avoid the node: the next chunk is asked of it again.
        other, other_data = chunk_for("srv", ["cli", "srv"])
        srv.store.put(other.hash, other_data)
        assert await cli.read(other) == other_data and fetch.chunks_fetched == 1

    run_bounded(lambda: with_cluster(tmp_path, test))


def test_a_read_the_asking_node_gave_up_on_serves_its_next_request(tmp_path) -> None:
    """A node that stops waiting for a chunk (its reader's Ctrl-C, or its
    own timeout) sends CANCEL. The representative's store read goes on and
    serves the next request for the chunk, rather than a second read of the
    store (which every other node waiting for that chunk would also pay)."""

    async def test(srv: Side, cli: Side, fetch: RepresentativeFetch, server: ChunkServer) -> None:
        chunk, data = chunk_for("srv", ["cli", "srv"])
        srv.store.put(chunk.hash, data)
        reading, release = threading.Event(), threading.Event()
        store_reads: list[str] = []
        read_into = srv.store.read_into

        def held_read_into(digest: str, *args, **kwargs) -> None:
            store_reads.append(digest)
            reading.set()
            release.wait(10)  # the store is slow: the asking node gives up meanwhile
            read_into(digest, *args, **kwargs)

        srv.store.read_into = held_read_into
        async with trio.open_nursery() as nursery:
            srv.frames.nursery = nursery  # as the cache's background nursery
            gave_up = trio.CancelScope()

            async def first_read() -> None:
                with gave_up:
                    await cli.read(chunk)

            nursery.start_soon(first_read)
            await trio.to_thread.run_sync(reading.wait, 10)
            gave_up.cancel()
            # The CANCEL reaches the representative and ends its handler.
            while (frame := srv.frames.frames.get(chunk.hash)) is not None and (
                frame.state is FrameState.LOADING
            ):
                await trio.sleep(0.01)
            assert gave_up.cancelled_caught
            release.set()
            assert await cli.read(chunk) == data
            assert store_reads == [chunk.hash]  # the one read, gone on for the retry
            assert srv.frames.reads == 1 and cli.frames.reads == 0
            assert fetch.fallbacks == 0 and fetch.chunks_fetched == 1
            nursery.cancel_scope.cancel()

    run_bounded(lambda: with_cluster(tmp_path, test))
