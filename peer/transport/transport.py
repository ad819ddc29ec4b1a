"""Authenticated request/response connections between ckptfs nodes.

A node runs one server (``serve``) and dials its peers (``PeerClient`` or
``connect``). A connection starts with optional TLS (``trio.SSLStream``, when
an ``ssl.SSLContext`` is given), then the handshake of auth.py, then carries
frames (wire.py) until either side closes it:

* The client sends REQUEST frames with ids 1, 2, 3, ... (never reused on a
  connection). Meta ``{"type": str, "meta": object}``, payload = the
  request's payload.
* The server answers every REQUEST with exactly one RESPONSE of the same id,
  in any order: ``{"meta": object}`` on success, ``{"meta": object, "error":
  one line}`` on failure (the handler said so, raised, or was cancelled).
* A client that stops waiting for a request (timeout or cancellation) sends
  CANCEL with its id; the server cancels the handler and still answers, with
  an error. The client reads and drops that late response.
* Either side may send ERROR (id 0) with a reason just before it closes the
  connection because of a protocol error.

Concurrency: one connection carries many requests at once. The client keeps
at most ``max_concurrent_requests`` requests unanswered (a request given up
on still counts until its late response arrives), and the server runs at
most that many handlers per connection, each in its own task; a server
reading one more request waits for a handler to finish before it reads the
request's payload (TCP backpressure). Frames are sent whole, one at a time
per connection, in the order their senders took the connection's send lock.

Deadlines: waiting for the next frame is unbounded (idle connections are
fine; heartbeats are requests), but once a frame's first byte has arrived its
header and meta must follow within ``frame_timeout``, and its payload within
``frame_timeout + length / min_rate`` from when its reading starts. Sends of
a frame have the same bound. A frame, once its first byte is sent, is sent
whole even if the request that sent it times out: cutting it short would put
the stream out of step. Requests time out after ``request_timeout`` unless
the caller says otherwise, raising PeerTimeout without harming the other
requests on the connection. A peer that breaks a deadline or the protocol
loses the connection; every request still pending on it fails with
ConnectionClosed, which names the reason.

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

The server survives hostile connections. Before its HELLO a connection
waits in a pool of at most ``max_unauthenticated`` connections, at most
``max_unauthenticated_per_address`` of them from one IP address; a new
connection is always let in, and makes room by closing the oldest silent one
(no byte received; else the oldest) from its address, or from all if the
pool is full. It must send its HELLO (after TLS, if used) within
``hello_timeout``: an honest client sends it at once, so a flood of silent
connections, even from a node's own address, cannot keep one out. The HELLO
names the node the client claims to be; ``identity`` (identity.py) refuses
it unless it comes from that node's address, and the connection then leaves
the pool for the handshake slots of that node (``max_handshakes_per_node``),
which no other address can take, until ``handshake_timeout`` from its
start. Every connection runs in its own task whose failure is logged in one
line and closes only that connection. Refusals are logged at WARNING, at
most 50 lines a second.

Authenticated peers are bounded too, per peer node over all its
connections: at most ``max_connections_per_peer`` connections (a new one
closes its oldest), and at most ``max_buffered_per_peer`` bytes of request
payloads received into buffers (not placed by the placer) and of reply
buffers taken by handlers through ``Request.budget``: a request whose
payload would go over it is not read until others are done (TCP
backpressure). Per connection, up to REQUEST_POOL_BYTES of buffers are kept
for reuse besides.
"""

from __future__ import annotations

import logging
import os
import select
import socket
import ssl
import stat
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from functools import partial
from types import TracebackType
from typing import Any, Protocol

import trio
from ckptfs.peer.transport import auth, wire
from ckptfs.peer.transport.auth import AuthError, one_line
from ckptfs.peer.transport.wire import Buffer, FrameType, Header, PeerError, ProtocolError

log = logging.getLogger("ckptfs.peer")

MiB = 1024 * 1024
RECV_BUFFER = 256 * 1024  # read-ahead; holds the largest header + meta
FILE_CHUNK = MiB  # pread size when sendfile cannot be used (TLS)
SMALL_PAYLOAD = 64 * 1024  # over TLS, payloads this small go in one write with their header
THREAD_SENDFILE = 2 * MiB  # payload files this large are sent from a worker thread
REQUEST_POOL_BYTES = 16 * MiB  # request payload buffers kept per connection for reuse
MAX_REQUEST_TYPE = 128
REFUSAL_LOGS_PER_SECOND = 50
DEFAULT_CONNECT_TIMEOUT = 10.0
EMPTY = memoryview(b"")

PayloadFile = tuple[int, int, int]  # (fd, offset, length)
# One range of a file, or several sent one after another as one payload.
FileRanges = PayloadFile | Sequence[PayloadFile]


class PeerTimeout(PeerError):
    """A request (or a connect) got no answer in time."""


class ConnectionClosed(PeerError):
    """The connection is closed or was lost; the message says why."""


class PeerUnreachable(PeerError):
    """No TCP connection could be made to the peer."""


class RemoteError(PeerError):
    """Raised by Response.check() for an error response."""


@dataclass(frozen=True)
class Limits:
    max_payload: int = wire.DEFAULT_MAX_PAYLOAD
    handshake_timeout: float = auth.HANDSHAKE_TIMEOUT
    frame_timeout: float = 10.0
    min_rate: float = 1.0 * MiB  # bytes/s a payload must at least move at
    request_timeout: float = 30.0
    max_concurrent_requests: int = 32  # per connection
    # The handshake (see the module docstring).
    hello_timeout: float = 2.0  # from accept: TLS and the client's HELLO
    max_unauthenticated: int = 64  # per server, before their HELLO
    max_unauthenticated_per_address: int = 16
    max_handshakes_per_node: int = 4  # after their HELLO, per node claimed
    # Authenticated peers, per peer node over all its connections.
    max_connections_per_peer: int = 8
    max_buffered_per_peer: int = 256 * MiB

    def transfer_time(self, nbytes: int) -> float:
        return self.frame_timeout + nbytes / self.min_rate


DEFAULT_LIMITS = Limits()


class IdentityCheck(Protocol):
    """Refuses a claimed node name (identity.NodeIdentities)."""

    async def check(self, name: str, source: str) -> None: ...


class PeerBudget:
    """Bytes of buffers the requests of one peer node may hold at once,
    over all its connections. A request larger than the whole budget waits
    until it would be alone in it."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self.peak = 0
        self._freed = trio.Event()

    async def acquire(self, nbytes: int) -> None:
        while self.used and self.used + nbytes > self.limit:
            await self._freed.wait()
        self.used += nbytes
        self.peak = max(self.peak, self.used)

    def release(self, nbytes: int) -> None:
        if nbytes:
            self.used -= nbytes
            self._freed.set()
            self._freed = trio.Event()


@dataclass(slots=True)
class Placement:
    """Where a request's payload is received instead of a pooled buffer (a
    server's ``placer`` decides, from the request's type and meta, before the
    payload is read): ``views`` are filled in order, and their lengths add up
    to the payload's. The handler finds it as ``Request.placement`` and may
    take what was received; ``release`` is called once the request is done
    (or its payload never arrived) and frees whatever was not taken.
    ``owner`` is the placer's own record of it, for the handler."""

    views: list[memoryview]
    release: Callable[[], object]
    owner: object = None


@dataclass(slots=True)
class Request:
    type: str
    meta: dict[str, Any]
    payload: memoryview
    id: int = 0
    placement: Placement | None = None  # then the payload is in its views, not `payload`
    # The peer's buffer budget: a handler that buffers a reply takes its bytes
    # from it and gives them back once the reply is sent (None: unbounded).
    budget: PeerBudget | None = None


@dataclass(slots=True)
class Response:
    """A handler's answer; on the client, what came back.

    ``payload_file`` sends (fd, offset, length) of a regular file instead of
    ``payload`` (or several such ranges, one after another); ``release``
    (server side) is called once the response has been sent or abandoned,
    e.g. to close that fd or unpin cache pages. Received payloads are always
    memoryviews.
    """

    meta: dict[str, Any] = field(default_factory=dict)
    payload: Buffer = b""
    error: str | None = None
    payload_file: FileRanges | None = None
    release: Callable[[], object] | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @classmethod
    def fail(cls, error: str, meta: dict[str, Any] | None = None) -> Response:
        return cls(meta=meta or {}, error=one_line(error) or "error")

    def check(self) -> Response:
        """Self, or RemoteError if this is an error response."""
        if self.error is not None:
            raise RemoteError(self.error)
        return self


Handler = Callable[[str, Request], Awaitable[Response]]
# (peer node, request type, request meta, payload size) -> where to receive it, or None.
Placer = Callable[[str, str, dict[str, Any], int], Placement | None]


# ---------------------------------------------------------------- envelopes


def _request_envelope(rtype: str, meta: dict[str, Any] | None) -> dict[str, Any]:
    if not isinstance(rtype, str) or not 0 < len(rtype) <= MAX_REQUEST_TYPE:
        raise ValueError(f"request type must be a string of 1..{MAX_REQUEST_TYPE} characters")
    return {"type": rtype, "meta": {} if meta is None else meta}


def _parse_request(meta: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    rtype, inner = meta.get("type"), meta.get("meta", {})
    if not isinstance(rtype, str) or not 0 < len(rtype) <= MAX_REQUEST_TYPE:
        raise ProtocolError("REQUEST without a valid type")
    if not isinstance(inner, dict):
        raise ProtocolError("REQUEST meta is not an object")
    return rtype, inner


def _response_envelope(response: Response) -> dict[str, Any]:
    envelope: dict[str, Any] = {"meta": response.meta}
    if response.error is not None:
        envelope["error"] = one_line(response.error) or "error"
    return envelope


def _parse_response(meta: dict[str, Any]) -> tuple[dict[str, Any], str | None]:
    inner, error = meta.get("meta", {}), meta.get("error")
    if not isinstance(inner, dict):
        raise ProtocolError("RESPONSE meta is not an object")
    if error is not None and not isinstance(error, str):
        raise ProtocolError("RESPONSE error is not a string")
    return inner, None if error is None else one_line(error) or "error"


def _outgoing(
    payload: Buffer, payload_file: FileRanges | None
) -> tuple[memoryview, int, list[PayloadFile]]:
    """The payload as bytes to send, the frame's payload length, and the file
    ranges to send instead of bytes."""
    view = memoryview(payload).cast("B")
    if payload_file is None:
        return view, len(view), []
    if len(view):
        raise ValueError("give payload or payload_file, not both")
    ranges = [payload_file] if isinstance(payload_file[0], int) else list(payload_file)
    total = 0
    for fd, offset, length in ranges:  # type: ignore[misc]
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError("payload_file must be a regular file")
        if offset < 0 or length < 0 or offset + length > st.st_size:
            raise ValueError(f"payload_file range {offset}+{length} is outside the file")
        total += length
    return view, total, ranges  # type: ignore[return-value]


def _writable(into: Buffer) -> memoryview:
    view = memoryview(into)
    if view.readonly:
        raise ValueError("into must be a writable buffer")
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def _describe(exc: BaseException) -> str:
    cause = exc.__cause__ or exc.__context__
    text = str(exc) or type(exc).__name__
    if isinstance(exc, trio.BrokenResourceError) and cause is not None:
        text = f"{text}: {cause}"  # trio wraps the OSError/SSLError that says what happened
    return one_line(text)


def _address(stream: trio.abc.Stream) -> str:
    host, port = _peer_host_port(stream)
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _peer_host_port(stream: trio.abc.Stream) -> tuple[str, int | str]:
    while isinstance(stream, trio.SSLStream):
        stream = stream.transport_stream
    if not isinstance(stream, trio.SocketStream):
        return "?", "?"
    try:
        host, port = stream.socket.getpeername()[:2]
    except (OSError, ValueError):
        return "?", "?"
    return host, port


# ---------------------------------------------------------------- channel


class _Channel:
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


# ---------------------------------------------------------------- client


class _Pending:
    __slots__ = ("into", "done", "response", "error", "receiving", "abandoned", "has_slot")

    def __init__(self, into: memoryview | None) -> None:
        self.into = into
        self.done = trio.Event()
        self.response: Response | None = None
        self.error: PeerError | None = None
        self.receiving = False  # the receive task is writing into `into` right now
        self.abandoned = False  # the caller gave up; a late response is dropped
        self.has_slot = False


class PeerConnection:
    """One authenticated connection to a peer, carrying concurrent requests."""

    def __init__(
        self,
        channel: _Channel,
        peer_node: str,
        nursery: trio.Nursery,
        limits: Limits,
        on_close: Callable[[PeerConnection], None] | None = None,
    ) -> None:
        self.peer_node = peer_node
        self.address = channel.peer
        self._channel = channel
        self._nursery = nursery
        self._limits = limits
        self._on_close = on_close
        self._pending: dict[int, _Pending] = {}
        self._next_id = 1
        self._slots = trio.Semaphore(limits.max_concurrent_requests)
        self._rx_scope = trio.CancelScope()
        self._rx_done = trio.Event()
        self.close_reason: str | None = None

    @property
    def closed(self) -> bool:
        return self.close_reason is not None

    async def __aenter__(self) -> PeerConnection:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def request(
        self,
        type: str,
        meta: dict[str, Any] | None = None,
        payload: Buffer = b"",
        *,
        payload_file: FileRanges | None = None,
        into: Buffer | None = None,
        timeout: float | None = None,
    ) -> Response:
        """Send a request and wait for its response.

        `payload_file` = (fd, offset, length) sends that range of a regular file
        (sendfile on plain TCP), or a list of such ranges one after another.
        With `into`, the response payload is received straight into that
        buffer and Response.payload is the filled slice; a
        larger payload fails this request with ProtocolError. `timeout`
        (default Limits.request_timeout) covers the whole request.
        """
        envelope = _request_envelope(type, meta)
        view, length, files = _outgoing(payload, payload_file)
        request_id = self._next_id
        head = self._channel.encode(FrameType.REQUEST, request_id, envelope, length)
        self._next_id += 1
        pending = _Pending(None if into is None else _writable(into))
        timeout = self._limits.request_timeout if timeout is None else timeout
        self._raise_if_closed()
        sent = False
        try:
            with trio.move_on_after(timeout):
                await self._slots.acquire()
                pending.has_slot = True
                self._pending[request_id] = pending
                await self._channel.send_encoded(head, view, files)
                sent = True
                await pending.done.wait()
        except ConnectionClosed as exc:
            self._close(str(exc))
        finally:
            if not pending.done.is_set():
                await self._abandon(request_id, pending, sent)
        if pending.error is not None:
            raise pending.error
        if pending.response is None:
            raise PeerTimeout(
                f"{type!r} request to {self.peer_node!r} timed out after {timeout:g}s"
            )
        return pending.response

    async def _abandon(self, request_id: int, pending: _Pending, sent: bool) -> None:
        """The caller stops waiting (timeout, cancellation, failure)."""
        if pending.receiving:
            # The receive task is writing into the caller's buffer. Wait until it
            # has stopped (its payload deadline bounds this), so that the buffer
            # is the caller's again the moment request() returns.
            with trio.CancelScope(shield=True):
                await pending.done.wait()
            return
        if not sent or self.closed:
            self._settle(request_id, pending, None)
            return
        # The server will still answer: keep the id (and its slot) until it does.
        pending.into = None
        pending.abandoned = True
        self._nursery.start_soon(self._send_cancel, request_id)

    async def _send_cancel(self, request_id: int) -> None:
        if self.closed:
            return
        try:
            head = self._channel.encode(FrameType.CANCEL, request_id, {}, 0)
            await self._channel.send_encoded(head)
        except ConnectionClosed as exc:
            self._close(str(exc))

    def _settle(
        self,
        request_id: int,
        pending: _Pending,
        response: Response | None,
        error: PeerError | None = None,
    ) -> None:
        if self._pending.get(request_id) is pending:
            del self._pending[request_id]
        if pending.has_slot:
            pending.has_slot = False
            self._slots.release()
        if not pending.done.is_set():
            pending.response, pending.error = response, error
            pending.done.set()

    def _raise_if_closed(self) -> None:
        if self.close_reason is not None:
            raise ConnectionClosed(self._closed_message())

    def _closed_message(self) -> str:
        return f"connection to {self.peer_node!r} closed: {self.close_reason}"

    def _close(self, reason: str, *, local: bool = False, final: bool = False) -> None:
        """Mark closed, fail pending requests, stop the receive task."""
        if self.close_reason is None:
            self.close_reason = reason
            if local:
                log.debug("closed connection to peer %r (%s)", self.peer_node, self.address)
            else:
                log.warning(
                    "lost connection to peer %r (%s): %s", self.peer_node, self.address, reason
                )
            if self._on_close is not None:
                self._on_close(self)
        for request_id, pending in list(self._pending.items()):
            # One being received into is failed by the receive task itself, once
            # it has stopped writing into the caller's buffer (final=True).
            if final or not pending.receiving:
                self._settle(request_id, pending, None, ConnectionClosed(self._closed_message()))
        self._rx_scope.cancel()

    async def aclose(self) -> None:
        """Close the connection; pending requests fail with ConnectionClosed."""
        self._close("closed by this node", local=True)
        await self._channel.aclose()
        await self._rx_done.wait()

    async def _run(self) -> None:
        reason = "closed by this node"
        local = True  # cancelled (this node shutting down) unless we learn otherwise
        try:
            with self._rx_scope:
                reason = await self._receive_loop()
                local = False
        except PeerError as exc:
            reason, local = str(exc), False
        except Exception as exc:  # a bug here must not take the client's nursery down
            log.exception("receive task for peer %r failed", self.peer_node)
            reason, local = f"internal error: {exc!r}", False
        finally:
            self._close(one_line(reason), local=local, final=True)
            with trio.CancelScope(shield=True):
                await self._channel.aclose()
            self._rx_done.set()

    async def _receive_loop(self) -> str:
        while True:
            got = await self._channel.next_frame()
            if got is None:
                return "the peer closed the connection"
            header, meta = got
            if header.type is FrameType.ERROR and header.request_id == 0:
                return f"the peer closed the connection: {one_line(meta.get('error'))}"
            if header.type is not FrameType.RESPONSE:
                raise ProtocolError(f"unexpected {header.type.name} frame from the server")
            pending = self._pending.get(header.request_id)
            if pending is None:
                raise ProtocolError(f"RESPONSE to unknown request id {header.request_id}")
            response_meta, error = _parse_response(meta)
            try:
                payload = await self._receive_payload(header, pending)
            except _DoesNotFit as exc:
                self._settle(header.request_id, pending, None, ProtocolError(str(exc)))
                continue
            response = Response(meta=response_meta, payload=payload, error=error)
            self._settle(header.request_id, pending, response)

    async def _receive_payload(self, header: Header, pending: _Pending) -> memoryview:
        size = header.payload_len
        if pending.into is None:
            if pending.abandoned:
                await self._channel.skip_payload()
                return EMPTY
            return await self._channel.read_payload()
        if size > len(pending.into):
            await self._channel.skip_payload()
            raise _DoesNotFit(
                f"response payload of {size} bytes does not fit the {len(pending.into)}-byte buffer"
            )
        view = pending.into[:size]
        pending.receiving = True
        try:
            await self._channel.read_payload_into(view)
        finally:
            pending.receiving = False
        return view


class _DoesNotFit(Exception):
    pass


class PeerClient:
    """Dials peers as `node`; owns the receive tasks of its connections.

    async with PeerClient(node="n1", secret=key, cluster_hash=h) as client:
        conn = await client.connect("10.0.0.2", 7070, expect_node="n2")
        response = await conn.request("read", {"file": ...}, into=buffer)
    """

    def __init__(
        self,
        *,
        node: str,
        secret: bytes,
        cluster_hash: str,
        ssl_context: ssl.SSLContext | None = None,
        limits: Limits = DEFAULT_LIMITS,
        local_address: str | None = None,
    ) -> None:
        self.node = auth.check_node_name(node)
        self.cluster_hash = auth.check_cluster_hash(cluster_hash)
        self._secret = auth.check_secret(secret)
        self._ssl_context = ssl_context
        self.limits = limits
        # The IP address connections are made from: servers accept this node
        # only from its configured address (identity.py).
        self.local_address = local_address
        self._stack: AsyncExitStack | None = None
        self._nursery: trio.Nursery | None = None
        self.connections: set[PeerConnection] = set()

    async def __aenter__(self) -> PeerClient:
        stack = AsyncExitStack()
        self._nursery = await stack.enter_async_context(trio.open_nursery())
        self._stack = stack
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        assert self._stack is not None and self._nursery is not None
        for conn in list(self.connections):
            conn._close("client shut down", local=True)
        self._nursery.cancel_scope.cancel()  # also pending CANCEL sends
        stack, self._stack, self._nursery = self._stack, None, None
        # The tasks in our nursery never raise; an error of the body is passed
        # on as it is, not wrapped in an ExceptionGroup by the nursery.
        await stack.__aexit__(None, None, None)
        return None

    async def connect(
        self,
        host: str,
        port: int,
        *,
        expect_node: str,
        timeout: float = DEFAULT_CONNECT_TIMEOUT,
        server_hostname: str | None = None,
    ) -> PeerConnection:
        """Dial, (TLS,) authenticate; the server must turn out to be `expect_node`.

        Raises PeerUnreachable, PeerTimeout (`timeout` covers all of it) or
        AuthError. `server_hostname` (default `host`) is what TLS checks the
        server's certificate against.
        """
        if self._nursery is None:
            raise RuntimeError("PeerClient.connect() outside 'async with PeerClient(...)'")
        expect_node = auth.check_node_name(expect_node)
        where = f"{host}:{port}"
        stream: trio.abc.Stream | None = None
        try:
            with trio.fail_after(timeout):
                stream = await _dial(host, port, where, self.local_address)
                if self._ssl_context is not None:
                    stream = trio.SSLStream(
                        stream, self._ssl_context, server_hostname=server_hostname or host
                    )
                    await _tls_handshake(stream, where)
                channel = _Channel(stream, self.limits, where)
                peer = await auth.client_handshake(
                    channel,
                    node=self.node,
                    expect_node=expect_node,
                    secret=self._secret,
                    cluster_hash=self.cluster_hash,
                    timeout=self.limits.handshake_timeout,
                )
        except BaseException as exc:
            if stream is not None:
                await trio.aclose_forcefully(stream)
            if isinstance(exc, trio.TooSlowError):
                raise PeerTimeout(
                    f"connecting to {expect_node!r} at {where} timed out after {timeout:g}s"
                ) from None
            raise
        conn = PeerConnection(channel, peer, self._nursery, self.limits, self.connections.discard)
        self.connections.add(conn)
        self._nursery.start_soon(conn._run)
        return conn


async def _dial(
    host: str, port: int, where: str, local_address: str | None = None
) -> trio.SocketStream:
    try:
        return await trio.open_tcp_stream(host, port, local_address=local_address)
    except OSError as exc:
        source = "" if local_address is None else f" from {local_address}"
        raise PeerUnreachable(f"cannot connect to {where}{source}: {one_line(exc)}") from exc


async def _tls_handshake(stream: trio.SSLStream[Any], where: str) -> None:
    try:
        await stream.do_handshake()
    except (trio.BrokenResourceError, OSError) as exc:
        raise AuthError(f"TLS handshake with {where} failed: {_describe(exc)}") from exc


@asynccontextmanager
async def connect(
    host: str,
    port: int,
    *,
    node: str,
    expect_node: str,
    secret: bytes,
    cluster_hash: str,
    ssl_context: ssl.SSLContext | None = None,
    timeout: float = DEFAULT_CONNECT_TIMEOUT,
    limits: Limits = DEFAULT_LIMITS,
    local_address: str | None = None,
) -> AsyncIterator[PeerConnection]:
    """One connection for the body of an ``async with``; closed at its end."""
    client = PeerClient(
        node=node,
        secret=secret,
        cluster_hash=cluster_hash,
        ssl_context=ssl_context,
        limits=limits,
        local_address=local_address,
    )
    async with client:
        conn = await client.connect(host, port, expect_node=expect_node, timeout=timeout)
        try:
            yield conn
        finally:
            await conn.aclose()


# ---------------------------------------------------------------- server


class _RefusalLog:
    """One WARNING per refused connection, but at most `per_second` a second."""

    def __init__(self, per_second: int) -> None:
        self.per_second = per_second
        self.window = float("-inf")
        self.count = 0
        self.suppressed = 0

    def __call__(self, address: str, reason: str) -> None:
        now = time.monotonic()
        if now - self.window >= 1.0:
            if self.suppressed:
                log.warning("%d more refused peer connections were not logged", self.suppressed)
            self.window, self.count, self.suppressed = now, 0, 0
        self.count += 1
        if self.count <= self.per_second:
            log.warning("refused peer connection from %s: %s", address, one_line(reason))
        else:
            self.suppressed += 1


class _Entrant:
    """A connection in the handshake, and the scope that bounds it."""

    __slots__ = ("ip", "address", "sock", "started", "scope", "spoke", "node", "evicted")

    def __init__(self, ip: str, address: str, sock: Any, started: float, deadline: float) -> None:
        self.ip = ip
        self.address = address
        self.sock = sock
        self.started = started
        self.scope = trio.CancelScope(deadline=deadline)
        self.spoke = False  # a first byte has arrived
        self.node: str | None = None  # the node its HELLO claimed, once admitted to its slots
        self.evicted: str | None = None  # why it was closed to make room

    def silent(self) -> bool:
        """Whether nothing has come from it yet (nor is waiting to be read)."""
        if self.spoke or self.sock is None:
            return False
        try:
            poller = select.poll()
            poller.register(self.sock.fileno(), select.POLLIN)
            return not poller.poll(0)
        except (OSError, ValueError):
            return False


class _HandshakeGate:
    """The handshake's admission (see the module docstring): the pool of
    connections before their HELLO, by source IP, and the slots of each
    claimed node after it."""

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self.waiting: dict[str, list[_Entrant]] = {}  # oldest first
        self.count = 0
        self.shaking: dict[str, int] = {}

    def enter(self, ip: str, address: str, sock: Any) -> _Entrant:
        """Admit a new connection, closing another if there is no room."""
        limits = self.limits
        now = trio.current_time()
        entrant = _Entrant(
            ip, address, sock, now, now + min(limits.hello_timeout, limits.handshake_timeout)
        )
        same = self.waiting.setdefault(ip, [])
        if len(same) >= limits.max_unauthenticated_per_address:
            self._evict(same, f"already {len(same)} connections in the handshake from {ip}")
        elif self.count >= limits.max_unauthenticated:
            everyone = sorted(
                (e for group in self.waiting.values() for e in group), key=lambda e: e.started
            )
            self._evict(everyone, f"already {self.count} connections in the handshake")
        self.waiting.setdefault(ip, []).append(entrant)
        self.count += 1
        return entrant

    def _evict(self, candidates: list[_Entrant], reason: str) -> None:
        victim = next((e for e in candidates if e.silent()), candidates[0])
        victim.evicted = f"{reason}; closed the oldest silent one for a newer one"
        self._forget(victim)
        victim.scope.cancel()

    def promote(self, entrant: _Entrant, node: str) -> None:
        """Its HELLO claimed ``node`` (and passed the identity check): move it
        to that node's handshake slots; AuthError if they are all taken."""
        taken = self.shaking.get(node, 0)
        if taken >= self.limits.max_handshakes_per_node:
            raise AuthError(f"already {taken} handshakes of node {node!r} under way")
        self._forget(entrant)
        entrant.node = node
        self.shaking[node] = taken + 1

    def leave(self, entrant: _Entrant) -> None:
        node, entrant.node = entrant.node, None
        if node is None:
            self._forget(entrant)
            return
        self.shaking[node] -= 1
        if not self.shaking[node]:
            del self.shaking[node]

    def _forget(self, entrant: _Entrant) -> None:
        group = self.waiting.get(entrant.ip)
        if group is not None and entrant in group:
            group.remove(entrant)
            self.count -= 1
            if not group:
                del self.waiting[entrant.ip]


@dataclass(eq=False)
class _PeerLoad:
    """What one authenticated peer node holds on this server."""

    budget: PeerBudget
    connections: list[_ServerConnection] = field(default_factory=list)  # oldest first


class _Server:
    def __init__(
        self,
        node: str,
        secret: bytes,
        cluster_hash: str,
        handler: Handler,
        ssl_context: ssl.SSLContext | None,
        limits: Limits,
        placer: Placer | None = None,
        identity: IdentityCheck | None = None,
    ) -> None:
        self.node = auth.check_node_name(node)
        self.secret = auth.check_secret(secret)
        self.cluster_hash = auth.check_cluster_hash(cluster_hash)
        self.handler = handler
        self.placer = placer
        self.ssl_context = ssl_context
        self.limits = limits
        self.identity = identity
        self.gate = _HandshakeGate(limits)
        self.peers: dict[str, _PeerLoad] = {}
        self.refused = _RefusalLog(REFUSAL_LOGS_PER_SECOND)

    async def handle(self, stream: trio.SocketStream) -> None:
        address = _address(stream)
        channel: _Channel | None = None
        try:
            admitted = await self._admit(stream, address)
            if admitted is not None:
                channel, peer = admitted
                await self._serve_peer(channel, peer)
        except Exception as exc:  # a bug in one connection must not stop the server
            log.error("peer connection from %s failed: %s", address, one_line(repr(exc)))
            log.debug("traceback", exc_info=True)
        finally:
            await trio.aclose_forcefully(channel.stream if channel is not None else stream)

    async def _serve_peer(self, channel: _Channel, peer: str) -> None:
        load = self.peers.get(peer)
        if load is None:
            load = self.peers[peer] = _PeerLoad(PeerBudget(self.limits.max_buffered_per_peer))
        conn = _ServerConnection(
            channel, peer, self.handler, self.limits, self.placer, budget=load.budget
        )
        limit = self.limits.max_connections_per_peer
        while len(load.connections) >= limit:
            # Only that node (or one at its address) can have opened them:
            # its own oldest go, e.g. left half-open by a crash of its host.
            oldest = load.connections.pop(0)
            oldest.evict(f"closed: peer {peer!r} opened more than {limit} connections")
        load.connections.append(conn)
        try:
            await conn.run()
        finally:
            if conn in load.connections:
                load.connections.remove(conn)
            if not load.connections and self.peers.get(peer) is load:
                del self.peers[peer]

    async def _admit(self, stream: trio.SocketStream, address: str) -> tuple[_Channel, str] | None:
        ip = str(_peer_host_port(stream)[0])
        entrant = self.gate.enter(ip, address, stream.socket)
        wrapped: trio.abc.Stream = stream
        admitted: tuple[_Channel, str] | None = None
        try:
            # Until the HELLO: hello_timeout; then handshake_timeout from the start.
            with entrant.scope:
                await trio.lowlevel.wait_readable(stream.socket)
                entrant.spoke = True
                if self.ssl_context is not None:
                    wrapped = trio.SSLStream(stream, self.ssl_context, server_side=True)
                    await _tls_handshake(wrapped, address)
                channel = _Channel(wrapped, self.limits, address)
                peer = await auth.server_handshake(
                    channel,
                    node=self.node,
                    secret=self.secret,
                    cluster_hash=self.cluster_hash,
                    timeout=self.limits.handshake_timeout,
                    on_hello=partial(self._hello, entrant),
                )
                admitted = channel, peer
        except AuthError as exc:
            self.refused(address, str(exc))
        finally:
            self.gate.leave(entrant)
        if admitted is not None:
            return admitted
        if entrant.scope.cancelled_caught:
            self.refused(address, entrant.evicted or self._too_slow(entrant))
        if wrapped is not stream:
            await trio.aclose_forcefully(wrapped)
        return None

    def _too_slow(self, entrant: _Entrant) -> str:
        if entrant.scope.deadline < entrant.started + self.limits.handshake_timeout:
            return f"handshake timed out: no HELLO within {self.limits.hello_timeout:g}s"
        return f"handshake timed out after {self.limits.handshake_timeout:g}s"

    async def _hello(self, entrant: _Entrant, node: str) -> None:
        """The client's HELLO claims ``node``: refuse it unless it may be that
        node, then give it one of that node's handshake slots."""
        if self.identity is not None:
            await self.identity.check(node, entrant.ip)
        self.gate.promote(entrant, node)
        entrant.scope.deadline = entrant.started + self.limits.handshake_timeout


class _ServerConnection:
    """The requests of one authenticated peer, each handled in its own task."""

    def __init__(
        self,
        channel: _Channel,
        peer_node: str,
        handler: Handler,
        limits: Limits,
        placer: Placer | None = None,
        *,
        budget: PeerBudget | None = None,
    ) -> None:
        self.channel = channel
        self.peer_node = peer_node
        self.handler = handler
        self.placer = placer
        # Shared by the peer's connections (see the module docstring).
        self.budget = budget if budget is not None else PeerBudget(limits.max_buffered_per_peer)
        self.who = f"{peer_node!r} ({channel.peer})"
        self._slots = trio.Semaphore(limits.max_concurrent_requests)
        self._active: dict[int, trio.CancelScope] = {}
        self._failure: str | None = None
        self._cancel_all = trio.CancelScope()
        # Request payload buffers, reused once their handler is done: on a VM
        # a fresh MiB-sized buffer per request (a mirrored page) costs more in
        # first-touch page faults than receiving into it. Handlers must not
        # keep a request's payload past their return.
        self._free: dict[int, list[bytearray]] = {}
        self._pooled = 0

    async def run(self) -> None:
        log.info("peer %s connected", self.who)
        reason: str | None = None
        with self._cancel_all:
            async with trio.open_nursery() as nursery:
                try:
                    await self._receive_loop(nursery)
                except ProtocolError as exc:
                    reason = str(exc)
                    await self._tell_peer(reason)
                except PeerError as exc:
                    reason = str(exc)
                nursery.cancel_scope.cancel()  # handlers whose answers can no longer go out
        reason = self._failure or reason
        if reason is None:
            log.info("peer %s disconnected", self.who)
        else:
            log.warning("dropped connection from peer %s: %s", self.who, one_line(reason))

    def _fail(self, reason: str) -> None:
        if self._failure is None:
            self._failure = reason
        self._cancel_all.cancel()

    def evict(self, reason: str) -> None:
        """Close this connection (its handlers are cancelled), logging ``reason``."""
        self._fail(reason)

    async def _tell_peer(self, reason: str) -> None:
        with trio.move_on_after(auth.REFUSE_SEND_TIMEOUT):
            try:
                await self.channel.send_control(FrameType.ERROR, {"error": one_line(reason)})
            except PeerError:
                pass

    async def _receive_loop(self, nursery: trio.Nursery) -> None:
        while True:
            got = await self.channel.next_frame()
            if got is None:
                return
            header, meta = got
            request_id = header.request_id
            if header.type is FrameType.ERROR and request_id == 0:
                raise ConnectionClosed(f"closed by the peer: {one_line(meta.get('error'))}")
            if header.type is FrameType.CANCEL and request_id and not header.payload_len:
                scope = self._active.get(request_id)
                if scope is not None:  # else it has finished already: nothing to do
                    scope.cancel()
                continue
            if header.type is not FrameType.REQUEST or request_id == 0:
                raise ProtocolError(f"unexpected {header.type.name} frame (id {request_id})")
            if request_id in self._active:
                raise ProtocolError(f"request id {request_id} is already in flight")
            rtype, rmeta = _parse_request(meta)
            # At the limit, stop reading (TCP backpressure) until a handler ends.
            await self._slots.acquire()
            size = self.channel.payload_left
            placement = self._place(rtype, rmeta, size)
            budgeted = 0
            if placement is None and size:
                try:
                    # Over the peer's budget, stop reading until its other requests are done.
                    await self.budget.acquire(size)
                except BaseException:
                    self._slots.release()
                    raise
                budgeted = size
            buffer = None if placement is not None else self._take(size)
            payload = EMPTY
            try:
                if placement is not None:
                    await self.channel.read_payload_into_views(placement.views)
                elif buffer is not None:
                    await self.channel.read_payload_into(memoryview(buffer))
                    payload = memoryview(buffer)
                else:
                    payload = await self.channel.read_payload()
            except BaseException:
                self._slots.release()
                self.budget.release(budgeted)
                if placement is not None:
                    _call_release(placement.release, self.who)
                raise
            scope = trio.CancelScope()
            self._active[request_id] = scope
            request = Request(rtype, rmeta, payload, request_id, placement, self.budget)
            nursery.start_soon(self._serve, request, scope, buffer, budgeted)

    def _place(self, rtype: str, meta: dict[str, Any], size: int) -> Placement | None:
        """Where the placer wants this payload; None (a pooled buffer) if it
        has no say, or fails."""
        if self.placer is None or not size:
            return None
        try:
            placement = self.placer(self.peer_node, rtype, meta, size)
        except Exception as exc:
            log.error("payload placer failed for peer %s: %s", self.who, one_line(repr(exc)))
            return None
        if placement is not None and sum(len(v) for v in placement.views) != size:
            log.error("payload placer for %r gave room for the wrong size", rtype)
            _call_release(placement.release, self.who)
            return None
        return placement

    def _take(self, size: int) -> bytearray | None:
        if not size:
            return None
        free = self._free.get(size)
        if free:
            self._pooled -= size
            return free.pop()
        return bytearray(size)

    def _give_back(self, buffer: bytearray | None) -> None:
        if buffer is not None and self._pooled + len(buffer) <= REQUEST_POOL_BYTES:
            self._free.setdefault(len(buffer), []).append(buffer)
            self._pooled += len(buffer)

    def _finish(self, request_id: int) -> None:
        if self._active.pop(request_id, None) is not None:
            self._slots.release()

    async def _serve(
        self,
        request: Request,
        scope: trio.CancelScope,
        buffer: bytearray | None = None,
        budgeted: int = 0,
    ) -> None:
        response: Response | None = None
        try:
            with scope:
                response = await self._call_handler(request)
            if response is None:
                response = Response.fail("cancelled by the client")
            # Free the slot before answering: the client reuses it on the answer.
            self._finish(request.id)
            await self._send_response(request.id, response)
        finally:
            self._finish(request.id)
            if response is not None and response.release is not None:
                _call_release(response.release, self.who)
            request.payload = EMPTY  # whoever still holds the request must not see reuse
            self._give_back(buffer)
            self.budget.release(budgeted)
            if request.placement is not None:
                _call_release(request.placement.release, self.who)
                request.placement = None

    async def _call_handler(self, request: Request) -> Response:
        try:
            response = await self.handler(self.peer_node, request)
        except Exception as exc:
            message = one_line(f"{type(exc).__name__}: {exc}")
            log.warning("%r handler failed for peer %s: %s", request.type, self.who, message)
            log.debug("handler traceback", exc_info=True)
            return Response.fail(message)
        if not isinstance(response, Response):
            return Response.fail(f"handler returned {type(response).__name__}, not a Response")
        return response

    async def _send_response(self, request_id: int, response: Response) -> None:
        try:
            view, length, files = _outgoing(response.payload, response.payload_file)
            envelope = _response_envelope(response)
            head = self.channel.encode(FrameType.RESPONSE, request_id, envelope, length)
        except (ValueError, TypeError, OSError) as exc:
            log.warning("unsendable response to peer %s: %s", self.who, one_line(exc))
            error = _response_envelope(Response.fail(f"unsendable response: {exc}"))
            head = self.channel.encode(FrameType.RESPONSE, request_id, error, 0)
            view, files = EMPTY, []
        try:
            await self.channel.send_encoded(head, view, files)
        except ConnectionClosed as exc:
            self._fail(str(exc))


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


def _call_release(release: Callable[[], object], who: str) -> None:
    try:
        release()
    except Exception as exc:
        log.error("response release callback for peer %s failed: %s", who, one_line(repr(exc)))


async def serve(
    listen_host: str | None,
    port: int,
    *,
    node: str,
    secret: bytes,
    cluster_hash: str,
    handler: Handler,
    ssl_context: ssl.SSLContext | None = None,
    limits: Limits = DEFAULT_LIMITS,
    placer: Placer | None = None,
    identity: IdentityCheck | None = None,
    task_status: trio.TaskStatus[list[trio.SocketListener]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Accept peers on (listen_host, port) until cancelled; `handler` answers
    requests, and `placer` (if given) may say where a request's payload is
    received (see Placement). `identity` (identity.NodeIdentities) refuses a
    node name claimed from the wrong address; without it any name is taken.

    Use ``listeners = await nursery.start(partial(serve, ...))``: the started
    value is the list of trio.SocketListener (port 0 picks a free port).
    """
    server = _Server(node, secret, cluster_hash, handler, ssl_context, limits, placer, identity)
    listeners = await trio.open_tcp_listeners(port, host=listen_host)
    await trio.serve_listeners(server.handle, listeners, task_status=task_status)
