"""The peer protocol against hostile peers, without FUSE: identity (a node
speaks only as itself), the caps on handshakes, connections and buffers, and
mirror requests that claim what is not their sender's.

Servers listen on loopback; nodes that must be told apart use different
loopback addresses (127.0.0.1, 127.0.0.2, ...: all of 127/8 is local).
"""

from __future__ import annotations

import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import trio
from caches import make_cache
from ckptfs.fs.store.manifest import Manifest
from ckptfs.peer.config import Address
from ckptfs.peer.mirror.server import MirrorServer
from ckptfs.peer.mirror.wire import DROP, RENAME
from ckptfs.peer.reads.reads import READ, ReadServer
from ckptfs.peer.transport.auth import AuthError
from ckptfs.peer.transport.client import connect
from ckptfs.peer.transport.errors import ConnectionClosed
from ckptfs.peer.transport.identity import NodeIdentities
from ckptfs.peer.transport.limits import DEFAULT_LIMITS, Limits
from ckptfs.peer.transport.transport import Request, Response, serve
from mirrors import commit_request
from peerwire import CLUSTER, LOGGER, SECRET, RawPeer, echo, run, wait_for_log

MiB = 1 << 20


@asynccontextmanager
async def server_as(
    node: str,
    nodes: dict[str, Address] | None = None,
    *,
    handler: Callable[[str, Request], Awaitable[Response]] = echo,
    limits: Limits = DEFAULT_LIMITS,
) -> AsyncIterator[int]:
    """Node ``node``'s server on 127.0.0.1, with the identity check of
    ``nodes`` (none without); yields its port."""
    identity = None if nodes is None else NodeIdentities(node, nodes)
    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(
            partial(
                serve,
                "127.0.0.1",
                0,
                node=node,
                secret=SECRET,
                cluster_hash=CLUSTER,
                handler=handler,
                limits=limits,
                identity=identity,
            )
        )
        yield listeners[0].socket.getsockname()[1]
        nursery.cancel_scope.cancel()


def dial(port: int, node: str, source: str | None = None, **kw: Any) -> Any:
    return connect(
        "127.0.0.1",
        port,
        node=node,
        expect_node="srv",
        secret=SECRET,
        cluster_hash=CLUSTER,
        local_address=source,
        timeout=5.0,
        **kw,
    )


# ------------------------------------------------------------------ identity


def test_a_node_speaks_only_as_itself(caplog: pytest.LogCaptureFixture) -> None:
    """With the secret, a client may claim only the node configured at the
    address it connects from: not another node, not an unknown one, not the
    server itself."""
    caplog.set_level(logging.INFO, logger=LOGGER)
    nodes = {
        "srv": Address("127.0.0.1", 1),
        "n1": Address("127.0.0.1", 2),
        "n2": Address("127.0.0.2", 3),
    }

    async def main() -> None:
        async with server_as("srv", nodes) as port:
            async with dial(port, "n2", "127.0.0.2") as conn:
                assert (await conn.request("echo", {})).meta["peer"] == "n2"
            async with dial(port, "n1", "127.0.0.1") as conn:
                assert (await conn.request("echo", {})).meta["peer"] == "n1"
            for claim, source, reason in [
                ("n1", "127.0.0.2", "node 'n1' is not accepted from 127.0.0.2"),
                ("n2", "127.0.0.1", "node 'n2' is not accepted from 127.0.0.1"),
                ("n9", "127.0.0.1", "'n9' is not a node of this cluster"),
                ("srv", "127.0.0.1", "claims to be this node"),
            ]:
                with pytest.raises(AuthError) as err:
                    async with dial(port, claim, source):
                        pass
                assert reason in str(err.value)
                await wait_for_log(caplog, "refused peer connection", reason)

    run(main)


def test_a_host_name_is_checked_against_the_addresses_it_resolves_to() -> None:
    async def main() -> None:
        identities = NodeIdentities("srv", {"srv": Address("localhost", 1),
                                            "n1": Address("localhost", 2)})  # fmt: skip
        allowed = await identities.addresses_of("n1")
        assert any(ip.is_loopback for ip in allowed)
        await identities.check("n1", "127.0.0.1")
        await identities.check("n1", "::ffff:127.0.0.1")  # a dual-stack listener's view
        with pytest.raises(AuthError):
            await identities.check("n1", "10.1.2.3")

    trio.run(main)


# ------------------------------------------------------------------ handshake flood


async def silent_flood(port: int, source: str, count: int, stop: trio.Event) -> int:
    """Keep ``count`` silent connections to ``port`` open from ``source``,
    opening a new one for each the server closes; returns how many were opened."""
    opened = 0

    async def one() -> None:
        nonlocal opened
        while not stop.is_set():
            sock = trio.socket.socket()
            try:
                await sock.bind((source, 0))
                await sock.connect(("127.0.0.1", port))
                opened += 1
                while not stop.is_set():
                    with trio.move_on_after(0.2):
                        if not await sock.recv(1):
                            break  # closed by the server: open another
            except OSError:
                await trio.sleep(0.01)
            finally:
                sock.close()

    async with trio.open_nursery() as nursery:
        for _ in range(count):
            nursery.start_soon(one)
        await stop.wait()
        nursery.cancel_scope.cancel()
    return opened


@pytest.mark.parametrize("flood_from", ["127.0.0.1", "127.0.0.3"])
def test_a_flood_of_silent_connections_keeps_no_node_out(
    flood_from: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Hundreds of silent connections, renewed as they are closed, from one
    address (the node's own, or another): the node still connects, every
    time, at once."""
    caplog.set_level(logging.INFO, logger=LOGGER)
    nodes = {"srv": Address("127.0.0.1", 1), "n1": Address("127.0.0.1", 2)}
    # Silent connections would hold a slot for 5 s: the default handshake deadline.
    limits = Limits(hello_timeout=5.0, handshake_timeout=5.0)

    async def main() -> None:
        async with server_as("srv", nodes, limits=limits) as port:
            stop = trio.Event()
            opened: list[int] = []

            async def flood() -> None:
                opened.append(await silent_flood(port, flood_from, 300, stop))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(flood)
                await wait_for_log(caplog, "connections in the handshake")
                for _ in range(20):
                    with trio.fail_after(2):
                        async with dial(port, "n1", "127.0.0.1") as conn:
                            assert (await conn.request("echo", {})).meta["peer"] == "n1"
                stop.set()
            assert opened[0] > 300  # every slot was taken, and taken again

    run(main, timeout=60)


def test_a_node_past_its_hello_has_slots_no_other_address_can_take() -> None:
    """Connections that claim a node from its address, then stall, take
    only that node's handshake slots: another node still gets in."""
    nodes = {
        "srv": Address("127.0.0.1", 1),
        "n1": Address("127.0.0.1", 2),
        "n2": Address("127.0.0.2", 3),
    }
    limits = Limits(max_handshakes_per_node=2, max_unauthenticated=4)

    async def main() -> None:
        from ckptfs.peer.transport import auth, wire
        from ckptfs.peer.transport.wire import FrameType

        async with server_as("srv", nodes, limits=limits) as port:
            stalled = []
            for _ in range(6):
                raw = await RawPeer.open(port)
                hello = auth.Hello("n1", os.urandom(32), CLUSTER)
                await raw.send(wire.encode_frame(FrameType.HELLO, 0, hello.to_meta()))
                stalled.append(raw)
            async with dial(port, "n2", "127.0.0.2") as conn:
                assert (await conn.request("echo", {})).meta["peer"] == "n2"

    run(main)


# ------------------------------------------------------------------ authenticated caps


def test_connections_per_peer_are_capped_and_the_oldest_go(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    limits = Limits(max_connections_per_peer=3)

    async def main() -> None:
        async with server_as("srv", limits=limits) as port:
            async with trio.open_nursery() as nursery:
                conns = []
                for _ in range(7):
                    conns.append(await nursery_connect(nursery, port))
                await wait_for_log(caplog, "opened more than 3 connections")
                for old in conns[:4]:
                    with pytest.raises(ConnectionClosed):
                        with trio.fail_after(2):
                            while True:  # until the close has reached this side
                                await old.request("echo", {})
                                await trio.sleep(0.01)
                for new in conns[4:]:
                    assert (await new.request("echo", {})).ok
                nursery.cancel_scope.cancel()

    run(main)


async def nursery_connect(nursery: trio.Nursery, port: int) -> Any:
    """A connection as node 'cli' that lives until ``nursery`` is cancelled."""
    ready: list[Any] = []
    got = trio.Event()

    async def hold() -> None:
        async with dial(port, "cli") as conn:
            ready.append(conn)
            got.set()
            await trio.sleep_forever()

    nursery.start_soon(hold)
    await got.wait()
    return ready[0]


def test_buffered_payloads_per_peer_are_capped_over_all_its_connections() -> None:
    """Without a cap, one peer could make the server hold 32 requests of 64
    MiB per connection in buffers at once, on as many connections as it
    likes."""
    limits = Limits(max_buffered_per_peer=4 * MiB)
    held = {"now": 0, "peak": 0}
    go = trio.Event()

    async def slow(peer: str, request: Request) -> Response:
        held["now"] += len(request.payload)
        held["peak"] = max(held["peak"], held["now"])
        await go.wait()
        held["now"] -= len(request.payload)
        return Response(meta={"n": len(request.payload)})

    async def main() -> None:
        async with server_as("srv", handler=slow, limits=limits) as port:
            async with trio.open_nursery() as nursery:
                conns = [await nursery_connect(nursery, port) for _ in range(3)]
                answers = []

                async def send(conn: Any) -> None:
                    response = await conn.request("x", {}, os.urandom(MiB), timeout=20)
                    answers.append(response.meta["n"])

                async with trio.open_nursery() as senders:
                    for conn in conns:
                        for _ in range(8):
                            senders.start_soon(send, conn)
                    await trio.sleep(1.0)  # every request that could be read was
                    assert held["peak"] == 4 * MiB
                    go.set()
                assert answers == [MiB] * 24
                nursery.cancel_scope.cancel()

    run(main, timeout=40)


def test_reply_buffers_of_peer_reads_count_against_the_budget() -> None:
    """Reads ask for no payload but make the server fill a reply buffer each."""
    limits = Limits(max_buffered_per_peer=2 * MiB)
    reading = {"now": 0, "peak": 0}
    go = trio.Event()

    async def local_read(file_id, version, off, n, into, writer):  # type: ignore[no-untyped-def]
        reading["now"] += n
        reading["peak"] = max(reading["peak"], reading["now"])
        await go.wait()
        reading["now"] -= n
        return bytes(n)

    reads = ReadServer(local_read)

    async def main() -> None:
        async with server_as("srv", handler=reads.handle, limits=limits) as port:
            async with dial(port, "cli") as conn:
                meta = {"file_id": "f", "version": "v", "offset": 0, "length": MiB,
                        "writer": "n1"}  # fmt: skip
                async with trio.open_nursery() as nursery:
                    for _ in range(8):
                        nursery.start_soon(partial(conn.request, READ, meta, timeout=20))
                    await trio.sleep(1.0)
                    assert reading["peak"] == 2 * MiB
                    go.set()

    run(main, timeout=40)


# ------------------------------------------------------------------ mirror requests


def buddy_n2(tmp_path: Path, manifests: dict[str, Manifest] | None = None) -> MirrorServer:
    """n2, the buddy of n1 and n3 (buddies {n1: n2, n3: n2}), over a fresh cache."""
    cache = make_cache(tmp_path, "n2")

    async def manifest_at(path: str) -> Manifest | None:
        if manifests is None or path not in manifests:
            raise FileNotFoundError(path)
        return manifests[path]

    return MirrorServer(cache, mirrored_for=("n1", "n3"), timeout=0.2, manifest_at=manifest_at,
                        is_alive=lambda name: True)  # fmt: skip


async def mirror(server: MirrorServer, origin: str, mid: str, m: Manifest, data: bytes) -> Response:
    assert await server.cache.mirror_page(origin, mid, m.file_id, 0, 5, memoryview(data),
                                          timeout=1)  # fmt: skip
    return await server.handle(origin, commit_request(mid, m, {0: (5, len(data))}, floor=5))


def test_a_commit_must_name_its_sender_and_this_buddy_as_holders(tmp_path: Path) -> None:
    async def main() -> None:
        server = buddy_n2(tmp_path)
        cache = server.cache
        data = os.urandom(1000)
        for holders, state in [
            (["n3", "n2"], "pending"),  # another writer's version
            (["n1"], "pending"),
            (["n1", "n2", "n3"], "pending"),
            (["n1", "n2"], "durable"),
        ]:
            m = Manifest("f1", "v1", 1000, 0o644, 1, state, holders)
            response = await mirror(server, "n1", "m1", m, data)
            assert not response.ok and "not ['n1', 'n2']" in str(response.error), holders
            assert cache.held_version("f1", "v1") is None
        # A path outside the mount.
        m = Manifest("f1", "v1", 1000, 0o644, 1, "pending", ["n1", "n2"])
        request = commit_request("m1", m, {0: (5, 1000)}, floor=5)
        body = request.payload.tobytes().replace(b'"a.pt"', b'"../../etc/x"')
        response = await server.handle("n1", Request(request.type, request.meta, memoryview(body)))
        assert not response.ok and "bad path" in str(response.error)
        assert cache.held_version("f1", "v1") is None
        response = await server.handle("n1", Request(RENAME, {"mid": "m1", "path": "/abs"}, b""))
        assert not response.ok and "bad path" in str(response.error)
        # A node this one is not the buddy of.
        response = await server.handle("n4", commit_request("m1", m, {0: (5, 1000)}, floor=5))
        assert not response.ok and "not n4's buddy" in str(response.error)
        # The writer's own commit is taken.
        assert (await mirror(server, "n1", "m1", m, data)).ok
        assert cache.held_version("f1", "v1") is not None

    trio.run(main)


def test_a_mirror_claiming_another_writers_version_is_never_served_nor_taken_over(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """n1 commits bytes under the file id and version of n3's pending file
    (n2 is the buddy of both): a reader of that version, here or on another
    node, never gets them, and when n1 dies they are not flushed as n3's file."""
    caplog.set_level(logging.INFO)
    genuine, forged = os.urandom(1000), os.urandom(1000)
    real = Manifest("fx", "vx", 1000, 0o644, 1, "pending", ["n3", "n2"])

    async def main() -> None:
        server = buddy_n2(tmp_path, {"a.pt": real})  # commit_request's path
        cache = server.cache
        claim = Manifest("fx", "vx", 1000, 0o644, 1, "pending", ["n1", "n2"])
        assert (await mirror(server, "n1", "forged", claim, forged)).ok
        # A reader of n3's version (its manifest names n3 as the writer).
        assert cache.held_version("fx", "vx", "n3") is None
        assert await cache.read_held("fx", "vx", 0, 1000, writer="n3") is None

        async def local_read(file_id, version, off, n, into, writer):  # type: ignore[no-untyped-def]
            return await cache.read_held(file_id, version, off, n, into=into, writer=writer)

        reads = ReadServer(local_read)
        meta = {"file_id": "fx", "version": "vx", "offset": 0, "length": 1000, "writer": "n3"}
        answer = await reads.handle("n4", Request(READ, meta, memoryview(b"")))
        assert not answer.ok and "not held here" in str(answer.error)
        # n3's own mirror is served to its readers, n1's is not.
        assert (await mirror(server, "n3", "genuine", real, genuine)).ok
        answer = await reads.handle("n4", Request(READ, meta, memoryview(b"")))
        assert answer.ok and bytes(answer.payload) == genuine
        assert bytes(await cache.read_held("fx", "vx", 0, 1000, writer="n3")) == genuine
        # n1 cannot drop n3's mirror, nor stop its later pages.
        response = await server.handle("n1", Request(DROP, {"drops": [["genuine", ""]]}, b""))
        assert response.ok and response.meta["dropped"] == 0
        assert cache.held_version("fx", "vx", "n3") is not None
        assert await cache.mirror_page("n3", "genuine", "fx", 1, 6, memoryview(b"z"), timeout=1)
        # n1 dies: its forged mirror is dropped, not flushed as n3's file.
        assert await server.take_over("n1") == 0
        assert "forged" not in cache.mirrors
        assert "its manifest names n3 as its writer" in caplog.text

    trio.run(main)
