"""The peer transport from a test's side: the shared secret, a hand-driven
peer that speaks raw frames, and a bounded trio run that closes them all."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import trio
from ckptfs.peer.transport import wire
from ckptfs.peer.transport.transport import Request, Response
from ckptfs.peer.transport.wire import FrameType
from waits import run_bounded

SECRET = b"test-secret-0123456789abcdef"
CLUSTER = "cluster-3f2a9c"
LOGGER = "ckptfs.peer"


def run(fn: Callable[[], Awaitable[None]], timeout: float = 20.0) -> None:
    """``fn`` on a new trio loop, at most ``timeout`` seconds; then every
    RawPeer it opened is closed."""

    async def closing() -> None:
        try:
            await fn()
        finally:
            while RawPeer.opened:
                await trio.aclose_forcefully(RawPeer.opened.pop().stream)

    run_bounded(closing, timeout)


async def echo(peer: str, request: Request) -> Response:
    """A handler answering with the request's type, meta and payload."""
    return Response(
        meta={"peer": peer, "type": request.type, **request.meta}, payload=request.payload
    )


class RawPeer:
    """A hand-driven peer: sends arbitrary bytes, reads frames with wire.py."""

    opened: list[RawPeer] = []  # closed by run() at the end of each test

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.buffer = bytearray()
        RawPeer.opened.append(self)

    @classmethod
    async def open(cls, port: int) -> RawPeer:
        return cls(await trio.open_tcp_stream("127.0.0.1", port))

    async def send(self, data: bytes) -> None:
        await self.stream.send_all(data)

    async def send_frame(
        self, ftype: FrameType, request_id: int, meta: dict[str, Any], payload: bytes = b""
    ) -> None:
        await self.send(wire.encode_frame(ftype, request_id, meta, payload))

    async def _read_exact(self, n: int) -> bytes | None:
        while len(self.buffer) < n:
            try:
                data = await self.stream.receive_some()
            except trio.BrokenResourceError:  # reset: the server closed with unread data
                data = b""
            if not data:
                return None
            self.buffer += data
        out, self.buffer = bytes(self.buffer[:n]), self.buffer[n:]
        return out

    async def receive_frame(self) -> wire.Frame | None:
        head = await self._read_exact(wire.HEADER_SIZE)
        if head is None:
            return None
        header = wire.decode_header(head)
        rest = await self._read_exact(header.meta_len + header.payload_len)
        assert rest is not None, "server cut a frame short"
        return wire.decode_frame(head + rest)

    async def frames_until_closed(self) -> list[wire.Frame]:
        frames = []
        while (frame := await self.receive_frame()) is not None:
            frames.append(frame)
        return frames

    async def send_control(self, ftype: FrameType, meta: dict[str, Any]) -> None:
        await self.send_frame(ftype, 0, meta)

    async def receive_control(self) -> tuple[FrameType, dict[str, Any]]:
        frame = await self.receive_frame()
        assert frame is not None
        return frame.header.type, frame.meta

    async def aclose(self) -> None:
        await self.stream.aclose()


async def wait_for_log(caplog: pytest.LogCaptureFixture, *parts: str) -> str:
    """The first message logged with every one of ``parts`` (the caller bounds the wait)."""
    while True:
        for record in caplog.records:
            message = record.getMessage()
            if all(part in message for part in parts):
                return message
        await trio.sleep(0.01)
