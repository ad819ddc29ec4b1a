"""The peer transport over loopback: frames, handshake, requests, hostile peers, TLS.

Every test drives trio.run under a deadline; servers listen on ephemeral ports
of 127.0.0.1 and are cancelled at the end of each test.
"""

from __future__ import annotations

import logging
import os
import shutil
import ssl
import subprocess
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import trio
from ckptfs.peer.transport import auth, wire
from ckptfs.peer.transport.auth import AuthError
from ckptfs.peer.transport.client import PeerConnection, connect
from ckptfs.peer.transport.errors import ConnectionClosed, PeerTimeout, PeerUnreachable, RemoteError
from ckptfs.peer.transport.limits import DEFAULT_LIMITS, Limits
from ckptfs.peer.transport.messages import Placement, Placer
from ckptfs.peer.transport.transport import Request, Response, serve
from ckptfs.peer.transport.wire import FrameType, ProtocolError
from peerwire import CLUSTER, LOGGER, SECRET, RawPeer, echo, run, wait_for_log

MiB = 1024 * 1024
# Short deadlines so that hostile-peer tests finish quickly.
FAST = Limits(handshake_timeout=0.5, frame_timeout=0.5, max_unauthenticated=8)


@asynccontextmanager
async def running_server(
    handler: Callable[[str, Request], Awaitable[Response]] = echo,
    *,
    limits: Limits = DEFAULT_LIMITS,
    ssl_context: ssl.SSLContext | None = None,
    cluster_hash: str = CLUSTER,
    placer: Placer | None = None,
) -> AsyncIterator[int]:
    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(
            partial(
                serve,
                "127.0.0.1",
                0,
                node="srv",
                secret=SECRET,
                cluster_hash=cluster_hash,
                handler=handler,
                ssl_context=ssl_context,
                limits=limits,
                placer=placer,
            )
        )
        yield listeners[0].socket.getsockname()[1]
        nursery.cancel_scope.cancel()


def client(port: int, **overrides: Any) -> Any:
    kwargs: dict[str, Any] = {
        "node": "cli",
        "expect_node": "srv",
        "secret": SECRET,
        "cluster_hash": CLUSTER,
        "timeout": 5.0,
    }
    kwargs.update(overrides)
    return connect("127.0.0.1", port, **kwargs)


async def authenticated_raw(port: int) -> RawPeer:
    raw = await RawPeer.open(port)
    await auth.client_handshake(
        raw, node="raw", expect_node="srv", secret=SECRET, cluster_hash=CLUSTER
    )
    return raw


def header_bytes(ftype: int, request_id: int, meta_len: int, payload_len: int) -> bytes:
    return wire.HEADER.pack(wire.MAGIC, wire.VERSION, ftype, 0, request_id, meta_len, payload_len)


# ------------------------------------------------------------------ frames


def test_frame_round_trip() -> None:
    payload = os.urandom(1000)
    data = wire.encode_frame(FrameType.REQUEST, 7, {"type": "read", "ü": [1, None]}, payload)
    frame = wire.decode_frame(data)
    assert frame.header == wire.Header(FrameType.REQUEST, 7, len(data) - 1028, 1000)
    assert frame.meta == {"type": "read", "ü": [1, None]}
    assert frame.payload == payload
    assert wire.HEADER_SIZE == 28


GOOD_META = b'{"a":1}'
BAD_FRAMES = {
    "magic": b"GET / HTTP/1.1\r\nHost: x\r\n\r\n\r\n",
    "version": wire.HEADER.pack(wire.MAGIC, 9, 1, 0, 0, 2, 0) + b"{}",
    "type": header_bytes(99, 0, 2, 0) + b"{}",
    "flags": wire.HEADER.pack(wire.MAGIC, 1, 1, 1, 0, 2, 0) + b"{}",
    "meta length": header_bytes(1, 0, wire.MAX_META + 1, 0),
    "meta length 0": header_bytes(1, 0, 0, 0),
    "payload length": header_bytes(5, 1, 2, wire.DEFAULT_MAX_PAYLOAD + 1) + b"{}",
    "json": header_bytes(1, 0, 5, 0) + b"{nope",
    "object": header_bytes(1, 0, 7, 0) + b"[1,2,3]",
    "utf-8": header_bytes(1, 0, 8, 0) + b'{"\xff":1}',
    "nan": header_bytes(1, 0, 9, 0) + b'{"a":NaN}',
    "nesting": header_bytes(1, 0, 60000, 0) + b"[" * 60000,
    "truncated header": header_bytes(1, 0, 2, 0)[:20],
    "truncated": header_bytes(5, 1, len(GOOD_META), 100) + GOOD_META + b"x" * 50,
    "trailing": header_bytes(1, 0, 2, 0) + b"{}" + b"extra",
}


@pytest.mark.parametrize("kind", sorted(BAD_FRAMES))
def test_bad_frames_raise_one_line_protocol_errors(kind: str) -> None:
    with pytest.raises(ProtocolError) as info:
        wire.decode_frame(BAD_FRAMES[kind])
    assert "\n" not in str(info.value) and str(info.value)


def test_encoding_refuses_what_a_peer_would_refuse() -> None:
    with pytest.raises(ValueError, match="over the limit"):
        wire.encode_head(FrameType.HELLO, 0, {"x": "y" * wire.MAX_META}, 0)
    with pytest.raises(ValueError, match="JSON"):
        wire.encode_head(FrameType.HELLO, 0, {"x": object()}, 0)
    with pytest.raises(ValueError, match="JSON"):
        wire.encode_head(FrameType.HELLO, 0, {"x": float("nan")}, 0)
    with pytest.raises(ValueError, match="payload"):
        wire.encode_head(FrameType.REQUEST, 1, {}, 11, max_payload=10)
    with pytest.raises(ValueError, match="at least 16"):
        auth.check_secret(b"short")


# ------------------------------------------------------------------ requests


def test_round_trip_of_payload_sizes() -> None:
    async def main() -> None:
        async with running_server() as port, client(port) as conn:
            assert conn.peer_node == "srv"
            for size in (0, 1024, 8 * MiB):
                data = os.urandom(size)
                response = await conn.request("echo", {"size": size}, data)
                assert response.ok and response.error is None
                assert response.meta == {"peer": "cli", "type": "echo", "size": size}
                assert isinstance(response.payload, memoryview)
                assert len(response.payload) == size and response.payload == data

    run(main)


def test_into_receives_in_place_and_too_small_fails_only_that_request() -> None:
    async def main() -> None:
        async with running_server() as port, client(port) as conn:
            data = os.urandom(3 * MiB + 5)
            buffer = bytearray(4 * MiB)
            response = await conn.request("echo", {}, data, into=memoryview(buffer))
            assert response.payload.obj is buffer  # a slice of our buffer, no copy
            assert len(response.payload) == len(data) and buffer[: len(data)] == data

            with pytest.raises(ProtocolError, match="does not fit"):
                await conn.request("echo", {}, data, into=bytearray(MiB))
            response = await conn.request("echo", {"again": 1}, b"abc", into=buffer)
            assert bytes(response.payload) == b"abc" and not conn.closed

    run(main)


def test_payload_from_file_goes_out_by_sendfile(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real_sendfile = os.sendfile

    def counting_sendfile(out_fd: int, in_fd: int, offset: int, count: int) -> int:
        calls.append(count)
        return real_sendfile(out_fd, in_fd, offset, count)

    monkeypatch.setattr(os, "sendfile", counting_sendfile)
    data = os.urandom(5 * MiB)
    released = []

    with tempfile.TemporaryFile() as f:
        f.write(data)
        f.flush()
        fd = f.fileno()

        async def handler(peer: str, request: Request) -> Response:
            if request.type == "get":
                offset, length = request.meta["offset"], request.meta["length"]
                return Response(
                    payload_file=(fd, offset, length), release=lambda: released.append(1)
                )
            return await echo(peer, request)

        async def main() -> None:
            async with running_server(handler) as port, client(port) as conn:
                response = await conn.request("echo", {}, payload_file=(fd, 1000, 4 * MiB))
                assert response.payload == data[1000 : 1000 + 4 * MiB]
                response = await conn.request("get", {"offset": 7, "length": 3 * MiB})
                assert response.payload == data[7 : 7 + 3 * MiB]
                response = await conn.request("get", {"offset": 5 * MiB - 1, "length": 2})
                assert not response.ok and "outside the file" in (response.error or "")
                with pytest.raises(ValueError, match="outside the file"):
                    await conn.request("echo", {}, payload_file=(fd, 0, 6 * MiB))
                assert (await conn.request("echo", {}, b"still fine")).payload == b"still fine"
                # Several ranges, one payload: small ones on the loop, a large
                # total from a worker thread.
                for ranges in (
                    [(fd, 10, 100), (fd, 0, 5)],
                    [(fd, 3 * MiB, MiB), (fd, 17, 2 * MiB), (fd, 5 * MiB - 9, 9)],
                ):
                    response = await conn.request("echo", {}, payload_file=ranges)
                    assert response.payload == b"".join(data[o : o + n] for _, o, n in ranges)
                with pytest.raises(ValueError, match="outside the file"):
                    await conn.request("echo", {}, payload_file=[(fd, 0, 1), (fd, 5 * MiB, 1)])

        run(main)
    assert calls and sum(calls) >= 10 * MiB
    assert released == [1, 1]  # also for the response that could not be sent


def test_32_concurrent_requests_complete_out_of_order() -> None:
    n = 32
    gates = [trio.Event() for _ in range(n)]
    started: list[int] = []
    all_started = trio.Event()

    async def handler(peer: str, request: Request) -> Response:
        i = request.meta["i"]
        started.append(i)
        if len(started) == n:
            all_started.set()
        await gates[i].wait()
        return Response(meta={"i": i}, payload=bytes([i]) * (1000 + i))

    async def main() -> None:
        finished: list[int] = []
        done = [trio.Event() for _ in range(n)]

        async def one(conn: PeerConnection, i: int) -> None:
            response = await conn.request("wait", {"i": i}, os.urandom(100))
            assert response.meta == {"i": i} and response.payload == bytes([i]) * (1000 + i)
            finished.append(i)
            done[i].set()

        async with running_server(handler) as port, client(port) as conn:
            async with trio.open_nursery() as nursery:
                for i in range(n):
                    nursery.start_soon(one, conn, i)
                await all_started.wait()
                for i in reversed(range(n)):  # the last request is answered first
                    gates[i].set()
                    await done[i].wait()
        assert finished == list(reversed(range(n)))

    run(main)


def test_in_flight_requests_are_bounded_per_connection() -> None:
    active = 0
    peak = 0

    async def handler(peer: str, request: Request) -> Response:
        nonlocal active, peak
        active += 1
        peak = max(peak, active)
        await trio.sleep(0.02)
        active -= 1
        return Response(meta=request.meta)

    limits = Limits(max_concurrent_requests=4)

    async def main() -> None:
        async with running_server(handler, limits=limits) as port:
            async with client(port, limits=limits) as conn, trio.open_nursery() as nursery:
                for i in range(20):
                    nursery.start_soon(conn.request, "x", {"i": i})
        assert peak == 4

    run(main)


def test_handler_exception_becomes_an_error_response(caplog: pytest.LogCaptureFixture) -> None:
    async def handler(peer: str, request: Request) -> Response:
        if request.type == "raise":
            raise KeyError("no such\nfile")
        if request.type == "refuse":
            return Response.fail("not here", {"code": 44})
        return await echo(peer, request)

    async def main() -> None:
        async with running_server(handler) as port, client(port) as conn:
            response = await conn.request("raise", {})
            assert not response.ok and response.error == "KeyError: 'no such\\nfile'"
            with pytest.raises(RemoteError, match="KeyError"):
                response.check()
            response = await conn.request("refuse", {})
            assert response.error == "not here" and response.meta == {"code": 44}
            assert (await conn.request("echo", {}, b"ok")).check().payload == b"ok"

    caplog.set_level(logging.WARNING, logger=LOGGER)
    run(main)
    assert any("'raise' handler failed" in r.getMessage() for r in caplog.records)


def test_request_timeout_cancels_the_handler_and_spares_the_others() -> None:
    cancelled = trio.Event()

    async def handler(peer: str, request: Request) -> Response:
        if request.type == "hang":
            try:
                await trio.sleep_forever()
            finally:
                cancelled.set()
        if request.type == "late":  # ignores cancellation, answers after the timeout
            with trio.CancelScope(shield=True):
                await trio.sleep(0.3)
            return Response(payload=b"L" * 1000)
        await trio.sleep(0.1)
        return await echo(peer, request)

    async def main() -> None:
        async with running_server(handler) as port, client(port) as conn:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(conn.request, "slow-but-fine", {})
                with pytest.raises(PeerTimeout, match="'hang' request to 'srv' timed out"):
                    await conn.request("hang", {}, timeout=0.2)
            await cancelled.wait()  # the CANCEL frame reached the server

            buffer = bytearray(4096)
            with pytest.raises(PeerTimeout):
                await conn.request("late", {}, into=buffer, timeout=0.1)
            await trio.sleep(0.5)  # the late answer arrives and is dropped
            assert buffer == bytes(4096)
            assert (await conn.request("echo", {}, b"x")).payload == b"x"
            assert not conn.closed

    run(main)


def test_a_timeout_while_receiving_into_the_buffer_waits_for_the_buffer() -> None:
    """request() never returns while the transport may still write into `into`."""
    payload = os.urandom(MiB)

    async def half_then_rest(listener: trio.SocketListener) -> None:
        raw = RawPeer(await listener.accept())
        await auth.server_handshake(raw, node="srv", secret=SECRET, cluster_hash=CLUSTER)
        request = await raw.receive_frame()
        assert request is not None
        frame = wire.encode_frame(FrameType.RESPONSE, request.header.request_id, {}, payload)
        await raw.send(frame[: len(frame) // 2])
        await trio.sleep(0.5)  # well past the request's timeout
        await raw.send(frame[len(frame) // 2 :])
        await raw.frames_until_closed()

    async def main() -> None:
        (listener,) = await trio.open_tcp_listeners(0, host="127.0.0.1")
        async with listener, trio.open_nursery() as nursery:
            nursery.start_soon(half_then_rest, listener)
            async with client(listener.socket.getsockname()[1]) as conn:
                buffer = bytearray(2 * MiB)
                start = trio.current_time()
                response = await conn.request("x", {}, into=buffer, timeout=0.2)
                # The payload had begun to arrive: it was waited for, and it is whole.
                assert trio.current_time() - start >= 0.45
                assert response.payload == payload and buffer[MiB:] == bytes(MiB)

    run(main)


class Places:
    """A placer that receives "place" payloads into three buffers of its own."""

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.buffers: list[bytearray] = []
        self.released = 0

    def __call__(self, peer: str, rtype: str, meta: dict[str, Any], size: int) -> Placement | None:
        if rtype != "place":
            return None
        if self.fail:
            raise RuntimeError("placer bug")
        cuts = [0, size // 3, size // 2, size]
        self.buffers = [bytearray(b - a) for a, b in zip(cuts[:-1], cuts[1:], strict=True)]
        return Placement([memoryview(b) for b in self.buffers], self.release, self.buffers)

    def release(self) -> None:
        self.released += 1


async def placed(peer: str, request: Request) -> Response:
    if request.placement is None:
        return Response(meta={"placed": False}, payload=bytes(request.payload))
    assert not request.payload
    buffers: Any = request.placement.owner
    return Response(meta={"placed": True}, payload=b"".join(buffers))


def test_a_placer_receives_payloads_where_it_says_and_releases_them_once() -> None:
    payload = os.urandom(3 * MiB + 7)

    async def main() -> None:
        places = Places()
        async with running_server(placed, placer=places) as port, client(port) as conn:
            response = await conn.request("place", {}, payload)
            assert response.meta["placed"] and response.payload == payload
            assert b"".join(places.buffers) == payload and places.released == 1
            # Not its type, or no payload: the usual buffer.
            response = await conn.request("other", {}, payload)
            assert not response.meta["placed"] and response.payload == payload
            response = await conn.request("place", {})
            assert not response.meta["placed"] and places.released == 1

    run(main)


def test_a_payload_cut_short_releases_its_placement(caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> None:
        places = Places()
        async with running_server(placed, limits=FAST, placer=places) as port:
            raw = await authenticated_raw(port)
            frame = wire.encode_frame(
                FrameType.REQUEST, 1, {"type": "place", "meta": {}}, os.urandom(MiB)
            )
            await raw.send(frame[: len(frame) // 2])
            await raw.frames_until_closed()  # dropped once the payload stalls
            with trio.fail_after(5):
                while not places.released:
                    await trio.sleep(0.01)
            assert places.released == 1

    run(main)


def test_a_failing_placer_leaves_the_payload_in_a_buffer(caplog: pytest.LogCaptureFixture) -> None:
    payload = os.urandom(MiB)

    async def main() -> None:
        places = Places(fail=True)
        async with running_server(placed, placer=places) as port, client(port) as conn:
            response = await conn.request("place", {}, payload)
            assert not response.meta["placed"] and response.payload == payload
        assert "payload placer failed" in caplog.text and "placer bug" in caplog.text

    run(main)


def test_payload_limits_are_checked_before_sending() -> None:
    async def main() -> None:
        async with running_server() as port, client(port, limits=Limits(max_payload=1000)) as c:
            with pytest.raises(ValueError, match="over the limit"):
                await c.request("echo", {}, b"x" * 1001)
            with pytest.raises(ValueError, match="JSON"):
                await c.request("echo", {"x": {1, 2}})
            assert (await c.request("echo", {}, b"x" * 1000)).payload == b"x" * 1000

    run(main)


def test_closing_fails_pending_requests() -> None:
    async def handler(peer: str, request: Request) -> Response:
        await trio.sleep_forever()
        raise AssertionError

    async def main() -> None:
        async with running_server(handler) as port, client(port) as conn:
            async with trio.open_nursery() as nursery:

                async def close_soon() -> None:
                    await trio.sleep(0.1)
                    await conn.aclose()

                nursery.start_soon(close_soon)
                with pytest.raises(ConnectionClosed, match="'srv' closed: closed by this node"):
                    await conn.request("hang", {})
            with pytest.raises(ConnectionClosed):
                await conn.request("echo", {})

    run(main)


def test_server_gone_fails_pending_requests() -> None:
    async def handler(peer: str, request: Request) -> Response:
        await trio.sleep_forever()
        raise AssertionError

    server_scope = trio.CancelScope()

    async def server(task_status: trio.TaskStatus[list[trio.SocketListener]]) -> None:
        with server_scope:
            await serve(
                "127.0.0.1",
                0,
                node="srv",
                secret=SECRET,
                cluster_hash=CLUSTER,
                handler=handler,
                task_status=task_status,
            )

    async def stop_server() -> None:
        await trio.sleep(0.1)
        server_scope.cancel()  # the server and its connections go away

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            listeners = await nursery.start(server)
            async with client(listeners[0].socket.getsockname()[1]) as conn:
                nursery.start_soon(stop_server)
                with pytest.raises(ConnectionClosed, match="'srv' closed: the peer closed"):
                    await conn.request("hang", {})
                assert conn.closed

    run(main)


# ------------------------------------------------------------------ handshake


class MemoryEnd:
    """One end of an in-memory control channel that records what crosses it."""

    def __init__(self, send: Any, receive: Any, record: list[bytes]) -> None:
        self.send, self.receive, self.record = send, receive, record

    async def send_control(self, ftype: FrameType, meta: dict[str, Any]) -> None:
        self.record.append(wire.encode_frame(ftype, 0, meta))
        await self.send.send((ftype, meta))

    async def receive_control(self) -> tuple[FrameType, dict[str, Any]]:
        result: tuple[FrameType, dict[str, Any]] = await self.receive.receive()
        return result


def test_handshake_proves_both_sides_without_sending_the_secret() -> None:
    record: list[bytes] = []
    to_server, from_client = trio.open_memory_channel[Any](10)
    to_client, from_server = trio.open_memory_channel[Any](10)
    names: dict[str, str] = {}

    async def side(name: str, handshake: Awaitable[str]) -> None:
        names[name] = await handshake

    async def main() -> None:
        client_end = MemoryEnd(to_server, from_server, record)
        server_end = MemoryEnd(to_client, from_client, record)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(
                side,
                "client",
                auth.client_handshake(
                    client_end, node="a", expect_node="b", secret=SECRET, cluster_hash=CLUSTER
                ),
            )
            nursery.start_soon(
                side,
                "server",
                auth.server_handshake(server_end, node="b", secret=SECRET, cluster_hash=CLUSTER),
            )

    run(main)
    assert names == {"client": "b", "server": "a"}
    types = [wire.decode_frame(f).header.type for f in record]
    assert types == [
        FrameType.HELLO,  # client
        FrameType.HELLO,  # server
        FrameType.PROOF,  # client
        FrameType.PROOF,  # server
        FrameType.READY,  # client
    ]
    wire_bytes = b"".join(record)
    assert SECRET not in wire_bytes and SECRET.hex().encode() not in wire_bytes
    # Proofs are bound to the role: the client's proof is not the server's.
    proofs = [wire.decode_frame(f).meta["proof"] for f in record[2:4]]
    assert proofs[0] != proofs[1]


def test_wrong_secret_is_refused(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)

    async def main() -> None:
        async with running_server() as port:
            with pytest.raises(AuthError, match="refused: authentication failed"):
                async with client(port, secret=b"another-secret-of-enough-length"):
                    pass
            await wait_for_log(caplog, "refused peer connection", "'cli'", "cluster secret")

    run(main)


def test_client_without_the_secret_is_refused(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)

    async def main() -> None:
        async with running_server() as port:
            raw = await RawPeer.open(port)
            await raw.send_control(
                FrameType.HELLO, {"node": "mallory", "nonce": "ab" * 32, "cluster": CLUSTER}
            )
            ftype, hello = await raw.receive_control()
            assert ftype is FrameType.HELLO and hello["node"] == "srv"
            await raw.send_control(FrameType.PROOF, {"proof": os.urandom(32).hex()})
            frames = await raw.frames_until_closed()
            assert [f.header.type for f in frames] == [FrameType.ERROR]
            assert frames[0].meta == {"error": "authentication failed"}
            await wait_for_log(caplog, "refused peer connection", "'mallory'", "failed to prove")

    run(main)


def test_wrong_expected_node_is_refused(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)

    async def main() -> None:
        async with running_server() as port:
            with pytest.raises(AuthError, match="reached node 'srv', expected 'other'"):
                async with client(port, expect_node="other"):
                    pass
            await wait_for_log(caplog, "refused peer connection", "wrong node")

    run(main)


def test_cluster_hash_mismatch_is_refused_by_both_sides(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)

    async def main() -> None:
        async with running_server() as port:
            with pytest.raises(AuthError, match="cluster hash mismatch"):
                async with client(port, cluster_hash="cluster-0000"):
                    pass
            client_line = await wait_for_log(caplog, "refusing peer connection", "mismatch")
            assert "cluster-0000" in client_line and CLUSTER in client_line
            server_line = await wait_for_log(caplog, "refused peer connection", "mismatch")
            assert "cluster-0000" in server_line and CLUSTER in server_line

        # A faulty client that says READY despite the mismatch: the server checks too.
        async with running_server() as port:
            raw = await RawPeer.open(port)
            mine = auth.Hello("raw", os.urandom(32), "cluster-0000")
            await raw.send_control(FrameType.HELLO, mine.to_meta())
            ftype, meta = await raw.receive_control()
            theirs = auth.Hello(meta["node"], bytes.fromhex(meta["nonce"]), meta["cluster"])
            proof = auth.make_proof(SECRET, b"client", mine, theirs)
            await raw.send_control(FrameType.PROOF, {"proof": proof.hex()})
            ftype, meta = await raw.receive_control()
            assert ftype is FrameType.PROOF
            await raw.send_control(FrameType.READY, {})
            frames = await raw.frames_until_closed()
            assert [f.header.type for f in frames] == [FrameType.ERROR]
            assert "cluster hash mismatch" in frames[0].meta["error"]

    run(main)


def test_unreachable_and_config_errors() -> None:
    async def main() -> None:
        async with running_server() as port:
            pass  # the port is free again now
        with pytest.raises(PeerUnreachable, match="cannot connect"):
            async with client(port):
                pass
        with pytest.raises(ValueError, match="node name"):
            async with client(port, node=""):
                pass

    run(main)


# ------------------------------------------------------------------ hostile peers


PRE_AUTH_JUNK = {
    "junk": (b"GET / HTTP/1.1\r\nHost: peer\r\n\r\n", "bad magic"),
    "oversized header": (header_bytes(1, 0, 1 << 30, 0), "meta length"),
    "oversized payload": (header_bytes(1, 0, 2, 1 << 40) + b"{}", "payload length"),
    "truncated": (header_bytes(1, 0, 100, 0) + b'{"node":', "truncated"),
    "wrong frame": (wire.encode_frame(FrameType.REQUEST, 1, {"type": "x"}), "frame not allowed"),
}


@pytest.mark.parametrize("kind", sorted(PRE_AUTH_JUNK))
def test_junk_before_the_handshake_is_refused(kind: str, caplog: pytest.LogCaptureFixture) -> None:
    data, reason = PRE_AUTH_JUNK[kind]
    caplog.set_level(logging.INFO, logger=LOGGER)

    async def main() -> None:
        async with running_server(limits=FAST) as port:
            raw = await RawPeer.open(port)
            await raw.send(data)
            if kind == "truncated":
                await raw.stream.send_eof()
            frames = await raw.frames_until_closed()
            assert [f.header.type for f in frames] == [FrameType.ERROR]
            line = await wait_for_log(caplog, "refused peer connection", reason)
            assert "\n" not in line

    run(main)


POST_AUTH_JUNK = {
    "junk": (b"\x00" * 64, "bad magic"),
    "oversized header": (header_bytes(5, 1, wire.MAX_META + 1, 0), "meta length"),
    "oversized payload": (header_bytes(5, 1, 2, (64 << 20) + 1) + b"{}", "payload length"),
    "truncated": (header_bytes(5, 1, 20, 0) + b'{"type":', "truncated"),
    "request id 0": (wire.encode_frame(FrameType.REQUEST, 0, {"type": "x"}), "unexpected"),
    "no type": (wire.encode_frame(FrameType.REQUEST, 1, {"meta": {}}), "valid type"),
    "handshake frame": (wire.encode_frame(FrameType.HELLO, 0, {}), "unexpected HELLO"),
}


@pytest.mark.parametrize("kind", sorted(POST_AUTH_JUNK))
def test_bad_frames_after_the_handshake_drop_only_that_connection(
    kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    data, reason = POST_AUTH_JUNK[kind]
    caplog.set_level(logging.INFO, logger=LOGGER)

    async def main() -> None:
        async with running_server(limits=FAST) as port, client(port) as good:
            raw = await authenticated_raw(port)
            await raw.send(data)
            if kind == "truncated":
                await raw.stream.send_eof()
            frames = await raw.frames_until_closed()
            assert [f.header.type for f in frames] == [FrameType.ERROR]
            assert reason in frames[0].meta["error"]
            await wait_for_log(caplog, "dropped connection from peer 'raw'", reason)
            assert (await good.request("echo", {}, b"alive")).payload == b"alive"

    run(main)


@pytest.mark.parametrize("stop_after", ["half header", "meta", "payload"])
def test_slow_sender_is_dropped_at_the_deadline(
    stop_after: str, caplog: pytest.LogCaptureFixture
) -> None:
    # Before the handshake only HELLO is accepted, and it has no payload: a big meta.
    hello = wire.encode_frame(FrameType.HELLO, 0, {"node": "x" * 20000})
    request = wire.encode_frame(FrameType.REQUEST, 1, {"type": "x"}, b"p" * 10000)
    cut = {"half header": 14, "meta": wire.HEADER_SIZE + 5, "payload": len(request) - 5000}
    caplog.set_level(logging.INFO, logger=LOGGER)

    async def main() -> None:
        async with running_server(limits=FAST) as port, client(port) as good:
            for frame in (hello, request):
                if frame is hello:
                    raw = await RawPeer.open(port)
                else:
                    raw = await authenticated_raw(port)
                await raw.send(frame[: cut[stop_after]])  # ... and then nothing
                with trio.fail_after(3):
                    frames = await raw.frames_until_closed()
                if frame is request:  # authenticated: told why
                    assert [f.header.type for f in frames] == [FrameType.ERROR]
                    assert "stalled" in frames[0].meta["error"]
                else:  # a stranger is just hung up on
                    assert frames == []
                await raw.aclose()
            await wait_for_log(caplog, "refused peer connection", "timed out")
            await wait_for_log(caplog, "dropped connection from peer 'raw'", "peer stalled")
            assert (await good.request("echo", {}, b"alive")).payload == b"alive"

    run(main)


def test_server_survives_300_bad_connections(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    behaviours = [data for data, _ in PRE_AUTH_JUNK.values()] + [b"", b"\x00"]

    async def main() -> None:
        async with running_server(limits=FAST) as port:
            for i in range(300):
                raw = await RawPeer.open(port)
                try:
                    await raw.send(behaviours[i % len(behaviours)])
                except trio.BrokenResourceError:
                    pass  # the server was quicker to hang up
                if i % 3 == 0:  # sometimes wait for the server to hang up, sometimes not
                    await raw.stream.send_eof()
                    await raw.frames_until_closed()
                await raw.aclose()

            # Refusal lines are limited to 50 a second; then the number left out is logged.
            await trio.sleep(1.1)
            # Idle connections beyond the unauthenticated limit are closed at once...
            idle = [await RawPeer.open(port) for _ in range(FAST.max_unauthenticated + 4)]
            await wait_for_log(caplog, "more refused peer connections were not logged")
            await wait_for_log(caplog, "already 8 connections in the handshake")
            # ... and the others when their handshake deadline passes.
            for raw in idle:
                await raw.frames_until_closed()
                await raw.aclose()

            async with client(port) as conn:
                data = os.urandom(MiB)
                assert (await conn.request("echo", {}, data)).payload == data
        assert sum("refused peer connection" in r.getMessage() for r in caplog.records) >= 50

    run(main, timeout=40)


# ------------------------------------------------------------------ TLS


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("openssl is not installed")
    d = tmp_path_factory.mktemp("tls")
    cert, key = d / "cert.pem", d / "key.pem"
    subprocess.run(
        [openssl, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1"]
        + ["-nodes", "-keyout", str(key), "-out", str(cert), "-days", "1"]
        + ["-subj", "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"],
        check=True,
        capture_output=True,
        timeout=30,
    )
    return cert, key


def test_tls_round_trip(tls_files: tuple[Path, Path], caplog: pytest.LogCaptureFixture) -> None:
    cert, key = tls_files
    server_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_context.load_cert_chain(cert, key)
    client_context = ssl.create_default_context(cafile=str(cert))
    caplog.set_level(logging.INFO, logger=LOGGER)
    data = os.urandom(8 * MiB)

    async def main() -> None:
        places = Places()
        async with running_server(placed, ssl_context=server_context, placer=places) as port:
            async with client(port, ssl_context=client_context) as conn:
                # A placed payload: read out of the ssl module's buffers into its views.
                response = await conn.request("place", {}, data[: 3 * MiB + 1])
                assert response.meta["placed"] and response.payload == data[: 3 * MiB + 1]
                assert places.released == 1
                for size in (0, 1024, 8 * MiB):
                    response = await conn.request("echo", {"size": size}, data[:size])
                    assert response.payload == data[:size]
                buffer = bytearray(2 * MiB)
                response = await conn.request("echo", {}, data[: 2 * MiB], into=buffer)
                assert response.payload.obj is buffer and buffer == data[: 2 * MiB]
                with tempfile.TemporaryFile() as f:  # pread fallback: no sendfile over TLS
                    f.write(data)
                    f.flush()
                    response = await conn.request("echo", {}, payload_file=(f.fileno(), 3, MiB))
                    assert response.payload == data[3 : 3 + MiB]
            # Closing without a TLS close_notify is an ordinary disconnect.
            await wait_for_log(caplog, "peer 'cli'", "disconnected")
            # A client without TLS is refused.
            with pytest.raises(AuthError):
                async with client(port, timeout=2):
                    pass
            await wait_for_log(caplog, "refused peer connection", "TLS handshake")

    run(main)
