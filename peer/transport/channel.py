"""Frames over one stream (a TCP socket, or TLS over one): reading a frame's
header, meta and payload within their deadlines, sending whole frames one at
a time, and the TLS handshake that may come first.

Copies: on a plain TCP socket a received payload is read by ``recv_into``
straight into its final buffer (the caller's ``into`` buffer, the views a
server's ``placer`` gives for a request, or else a pooled bytearray); only
the first bytes of a payload that arrived with its header pass through the
256 KiB read-ahead buffer. Headers and payloads go out together
with ``sendmsg``, and a ``payload_file=(fd, offset, length)`` (or a list of
such ranges) goes out with ``os.sendfile``, from a worker thread once the
ranges add up to THREAD_SENDFILE, so that the copy does not hold up the
event loop. Over TLS the ssl module needs its own buffers: payloads are
copied in and out of them, and files are read with pread in 1 MiB pieces.
"""

from __future__ import annotations

import os
import select
import socket
import ssl
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import trio
from ckptfs.peer.transport import wire
from ckptfs.peer.transport.auth import AuthError, one_line
from ckptfs.peer.transport.errors import ConnectionClosed
from ckptfs.peer.transport.limits import Limits, MiB
from ckptfs.peer.transport.messages import EMPTY, PayloadFile
from ckptfs.peer.transport.wire import Buffer, FrameType, Header, ProtocolError

RECV_BUFFER = 256 * 1024  # read-ahead; holds the largest header + meta
FILE_CHUNK = MiB  # pread size when sendfile cannot be used (TLS)
SMALL_PAYLOAD = 64 * 1024  # over TLS, payloads this small go in one write with their header
THREAD_SENDFILE = 2 * MiB  # payload files this large are sent from a worker thread


def _describe(exc: BaseException) -> str:
    cause = exc.__cause__ or exc.__context__
    text = str(exc) or type(exc).__name__
    if isinstance(exc, trio.BrokenResourceError) and cause is not None:
        text = f"{text}: {cause}"  # trio wraps the OSError/SSLError that says what happened
    return one_line(text)


class Channel:
    """Frames over one stream: the read side (one reader task) and the send lock."""

    def __init__(self, stream: trio.abc.Stream, limits: Limits, peer: str) -> None:
        self.stream = stream
        self.limits = limits
        self.peer = peer
        # Plain TCP: use the socket directly for recv_into/sendmsg/sendfile.
        self._sock = stream.socket if isinstance(stream, trio.SocketStream) else None
        self._buf = bytearray(RECV_BUFFER)
        self._view = memoryview(self._buf)
        self._start = 0  # unread bytes are _buf[_start:_end]
        self._end = 0
        self._payload_left = 0
        self._send_lock = trio.Lock()
        self.broken: str | None = None

    # -- receiving

    async def _recv_into(self, view: memoryview) -> int:
        try:
            if self._sock is not None:
                return await self._sock.recv_into(view)
            data = await self.stream.receive_some(len(view))
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            if isinstance(exc.__cause__, ssl.SSLEOFError):
                # TLS closed without close_notify: our frames carry their own
                # lengths, so this is an ordinary EOF (truncation is still caught).
                return 0
            raise ConnectionClosed(self.broken or f"connection lost: {_describe(exc)}") from exc
        view[: len(data)] = data
        return len(data)

    async def _fill(self, n: int) -> bool:
        """Have at least `n` unread bytes buffered; False if the stream ended first
        at a frame boundary."""
        while self._end - self._start < n:
            if len(self._buf) - self._start < n:
                kept = self._end - self._start
                self._view[:kept] = self._view[self._start : self._end]
                self._start, self._end = 0, kept
            got = await self._recv_into(self._view[self._end :])
            if got == 0:
                if self._start == self._end:
                    return False
                raise ProtocolError("truncated frame: the stream ended inside a frame header")
            self._end += got
        return True

    @contextmanager
    def _deadline(self, seconds: float, what: str) -> Iterator[None]:
        with trio.move_on_after(seconds) as scope:
            yield
        if scope.cancelled_caught:
            # Only the receive side is out of step: an ERROR frame can still go out.
            raise ProtocolError(f"peer stalled: {what} not received within {seconds:.3g}s")

    async def next_frame(self) -> tuple[Header, dict[str, Any]] | None:
        """The next frame's header and meta (its payload is read next), or None
        if the peer closed the connection between frames."""
        if self._payload_left:
            raise RuntimeError("the previous frame's payload was not consumed")
        if self._start == self._end:
            self._start = self._end = 0
        if not await self._fill(1):
            return None
        with self._deadline(self.limits.frame_timeout, "frame header"):
            await self._fill(wire.HEADER_SIZE)
            head = self._view[self._start : self._start + wire.HEADER_SIZE]
            # Checked before waiting for the rest: the lengths may be absurd.
            header = wire.decode_header(head, max_payload=self.limits.max_payload)
            await self._fill(wire.HEADER_SIZE + header.meta_len)
        meta_start = self._start + wire.HEADER_SIZE
        self._start = meta_start + header.meta_len
        meta = wire.decode_meta(self._view[meta_start : self._start])
        self._payload_left = header.payload_len
        return header, meta

    def _take_buffered(self, dest: memoryview) -> int:
        n = min(self._end - self._start, len(dest))
        dest[:n] = self._view[self._start : self._start + n]
        self._start += n
        return n

    async def read_payload_into(self, dest: memoryview) -> None:
        """Receive the current frame's payload, exactly len(dest) bytes, into dest."""
        await self.read_payload_into_views([dest])

    async def read_payload_into_views(self, dests: Sequence[memoryview]) -> None:
        """Receive the current frame's payload into ``dests``, one after
        another; their lengths must add up to the payload's."""
        total = sum(len(dest) for dest in dests)
        if total != self._payload_left:
            raise RuntimeError(f"payload is {self._payload_left} bytes, not {total}")
        with self._deadline(self.limits.transfer_time(total), "payload"):
            for dest in dests:
                pos = self._take_buffered(dest)
                while pos < len(dest):
                    got = await self._recv_into(dest[pos:])
                    if got == 0:
                        raise ProtocolError("truncated frame: the stream ended inside a payload")
                    pos += got
        self._payload_left = 0

    @property
    def payload_left(self) -> int:
        """Bytes of the current frame's payload not received yet."""
        return self._payload_left

    async def read_payload(self) -> memoryview:
        if not self._payload_left:
            return EMPTY
        # bytearray(n) of a large n is fresh zero pages from mmap: no memset cost.
        view = memoryview(bytearray(self._payload_left))
        await self.read_payload_into(view)
        return view

    async def skip_payload(self) -> None:
        with self._deadline(self.limits.transfer_time(self._payload_left), "payload"):
            while self._payload_left:
                if self._start == self._end:
                    got = await self._recv_into(self._view)
                    if got == 0:
                        raise ProtocolError("truncated frame: the stream ended inside a payload")
                    self._start, self._end = 0, got
                taken = min(self._end - self._start, self._payload_left)
                self._start += taken
                self._payload_left -= taken

    # -- sending

    def encode(
        self, ftype: FrameType, request_id: int, meta: dict[str, Any], payload_len: int
    ) -> bytes:
        return wire.encode_head(
            ftype, request_id, meta, payload_len, max_payload=self.limits.max_payload
        )

    async def send_encoded(
        self, head: bytes, payload: memoryview = EMPTY, files: Sequence[PayloadFile] = ()
    ) -> None:
        """Send one frame whole; ConnectionClosed (and the stream is closed) if not."""
        length = sum(r[2] for r in files) if files else len(payload)
        async with self._send_lock:
            if self.broken is not None:
                raise ConnectionClosed(self.broken)
            sent = False
            # Shielded: once begun, a frame is finished or the connection is lost.
            deadline = trio.current_time() + self.limits.transfer_time(length)
            with trio.CancelScope(shield=True, deadline=deadline):
                try:
                    await self._send_parts(head, payload, files)
                    sent = True
                except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
                    self.broken = self.broken or f"send failed: {_describe(exc)}"
                finally:
                    if not sent:
                        self.broken = self.broken or "peer stopped reading: frame not sent in time"
                        self._hard_close()
            if not sent:
                raise ConnectionClosed(self.broken)

    async def _send_parts(
        self, head: bytes, payload: memoryview, files: Sequence[PayloadFile]
    ) -> None:
        if self._sock is not None:
            await self._sendmsg_all([memoryview(head), payload] if len(payload) else [head])
            if sum(length for _fd, _off, length in files) >= THREAD_SENDFILE:
                # The copy into socket buffers (and, over loopback, the
                # receiver's TCP processing) costs about 0.6 s per GiB; in a
                # worker thread it runs beside the FUSE requests on the loop.
                time_left = trio.current_effective_deadline() - trio.current_time()
                # Its own fd: the socket may be closed meanwhile (the fd number
                # then reused elsewhere); closing also shuts it down, which
                # stops the thread (_stop_sender).
                out = os.dup(self._sock.fileno())
                try:
                    await trio.to_thread.run_sync(_sendfile_blocking, out, list(files), time_left)
                finally:
                    os.close(out)
                return
            for payload_file in files:
                await self._sendfile(*payload_file)
        elif not files and len(payload) <= SMALL_PAYLOAD:
            await self.stream.send_all(head + payload)
        else:
            await self.stream.send_all(head)
            for payload_file in files:
                await self._pread_send(*payload_file)
            if not files:
                await self.stream.send_all(payload)

    async def _sendmsg_all(self, parts: list[Buffer]) -> None:
        assert self._sock is not None
        views = [memoryview(p) for p in parts]
        while views:
            sent = await self._sock.sendmsg(views)
            while sent and views:
                if sent >= len(views[0]):
                    sent -= len(views.pop(0))
                else:
                    views[0] = views[0][sent:]
                    sent = 0

    async def _sendfile(self, fd: int, offset: int, length: int) -> None:
        assert self._sock is not None
        out = self._sock.fileno()
        while length:
            try:
                sent = os.sendfile(out, fd, offset, length)
            except BlockingIOError:
                await trio.lowlevel.wait_writable(self._sock)
                continue
            if sent == 0:
                raise OSError(f"payload file ended {length} bytes early")
            offset += sent
            length -= sent
            # A fast reader may never make the socket block: let other tasks run.
            await trio.lowlevel.cancel_shielded_checkpoint()

    async def _pread_send(self, fd: int, offset: int, length: int) -> None:
        chunk = memoryview(bytearray(min(length, FILE_CHUNK)))
        while length:
            got = os.preadv(fd, [chunk[: min(length, len(chunk))]], offset)
            if got == 0:
                raise OSError(f"payload file ended {length} bytes early")
            await self.stream.send_all(chunk[:got])
            offset += got
            length -= got

    # -- the handshake's view (auth.ControlChannel)

    async def send_control(self, ftype: FrameType, meta: dict[str, Any]) -> None:
        await self.send_encoded(self.encode(ftype, 0, meta, 0))

    async def receive_control(self) -> tuple[FrameType, dict[str, Any]]:
        got = await self.next_frame()
        if got is None:
            raise ConnectionClosed("the peer closed the connection")
        header, meta = got
        if header.request_id or header.payload_len:
            raise ProtocolError(f"{header.type.name} frame not allowed in the handshake")
        return header.type, meta

    # -- closing

    def _stop_sender(self) -> None:
        """Shut the socket down, so that a sendfile in a worker thread (on its
        own duplicate of the fd) stops at once instead of at its deadline."""
        if self._sock is not None:
            try:
                self._sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # not connected any more

    def _hard_close(self) -> None:
        """Close the socket now (no await), waking any task blocked on it."""
        self._stop_sender()
        stream = self.stream
        while isinstance(stream, trio.SSLStream):
            stream = stream.transport_stream
        if isinstance(stream, trio.SocketStream):
            stream.socket.close()

    async def aclose(self, reason: str = "closed") -> None:
        self.broken = self.broken or reason
        self._stop_sender()
        await trio.aclose_forcefully(self.stream)


async def tls_handshake(stream: trio.SSLStream[Any], where: str) -> None:
    try:
        await stream.do_handshake()
    except (trio.BrokenResourceError, OSError) as exc:
        raise AuthError(f"TLS handshake with {where} failed: {_describe(exc)}") from exc


def _sendfile_blocking(out: int, files: list[PayloadFile], time_left: float) -> None:
    """sendfile every range to the non-blocking socket ``out``, waiting for
    room with poll; TimeoutError once ``time_left`` seconds are spent."""
    deadline = time.monotonic() + time_left
    poller = select.poll()
    poller.register(out, select.POLLOUT)
    for fd, offset, length in files:
        while length:
            try:
                sent = os.sendfile(out, fd, offset, length)
            except BlockingIOError:
                wait = deadline - time.monotonic()
                if wait <= 0:
                    raise TimeoutError(f"{length} bytes of a payload not sent in time") from None
                poller.poll(min(wait, 1.0) * 1000)
                continue
            if sent == 0:
                raise OSError(f"payload file ended {length} bytes early")
            offset += sent
            length -= sent
