"""One authenticated peer's connection on the server: its requests read in
turn, each handled in its own task (at most ``max_concurrent_requests`` at
once), CANCEL honoured, every request answered once; its payloads received
into a placer's views, a pooled buffer or a fresh one, within the peer's
buffer budget (see server.py)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import trio
from ckptfs.peer.transport import auth
from ckptfs.peer.transport.auth import one_line
from ckptfs.peer.transport.channel import Channel
from ckptfs.peer.transport.errors import ConnectionClosed
from ckptfs.peer.transport.limits import Limits, MiB, PeerBudget
from ckptfs.peer.transport.messages import (
    EMPTY,
    Handler,
    Placement,
    Placer,
    Request,
    Response,
    outgoing,
    parse_request,
    response_envelope,
)
from ckptfs.peer.transport.wire import FrameType, PeerError, ProtocolError

log = logging.getLogger("ckptfs.peer")

REQUEST_POOL_BYTES = 16 * MiB  # request payload buffers kept per connection for reuse


class ServerConnection:
    """The requests of one authenticated peer, each handled in its own task."""

    def __init__(
        self,
        channel: Channel,
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
        # Shared by the peer's connections (see server.py).
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
            rtype, rmeta = parse_request(meta)
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
            view, length, files = outgoing(response.payload, response.payload_file)
            envelope = response_envelope(response)
            head = self.channel.encode(FrameType.RESPONSE, request_id, envelope, length)
        except (ValueError, TypeError, OSError) as exc:
            log.warning("unsendable response to peer %s: %s", self.who, one_line(exc))
            error = response_envelope(Response.fail(f"unsendable response: {exc}"))
            head = self.channel.encode(FrameType.RESPONSE, request_id, error, 0)
            view, files = EMPTY, []
        try:
            await self.channel.send_encoded(head, view, files)
        except ConnectionClosed as exc:
            self._fail(str(exc))


def _call_release(release: Callable[[], object], who: str) -> None:
    try:
        release()
    except Exception as exc:
        log.error("response release callback for peer %s failed: %s", who, one_line(repr(exc)))
