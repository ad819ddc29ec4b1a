"""The dialing side: PeerClient dials and authenticates peers, PeerConnection
carries many requests at once over one connection (ids, the request slots,
timeouts, CANCEL of a request given up on, late responses dropped), and
``connect`` gives one connection for an ``async with``."""

from __future__ import annotations

import logging
import ssl
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from types import TracebackType
from typing import Any

import trio
from ckptfs.peer.transport import auth
from ckptfs.peer.transport.auth import one_line
from ckptfs.peer.transport.channel import Channel, tls_handshake
from ckptfs.peer.transport.errors import ConnectionClosed, PeerTimeout, PeerUnreachable
from ckptfs.peer.transport.limits import DEFAULT_LIMITS, Limits
from ckptfs.peer.transport.messages import (
    EMPTY,
    FileRanges,
    Response,
    outgoing,
    parse_response,
    request_envelope,
)
from ckptfs.peer.transport.wire import Buffer, FrameType, Header, PeerError, ProtocolError

log = logging.getLogger("ckptfs.peer")

DEFAULT_CONNECT_TIMEOUT = 10.0


def _writable(into: Buffer) -> memoryview:
    view = memoryview(into)
    if view.readonly:
        raise ValueError("into must be a writable buffer")
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


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
        channel: Channel,
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
        envelope = request_envelope(type, meta)
        view, length, files = outgoing(payload, payload_file)
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
            response_meta, error = parse_response(meta)
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
                    await tls_handshake(stream, where)
                channel = Channel(stream, self.limits, where)
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
