"""The listening side: ``serve`` accepts connections, admits them through
the handshake (admission.py, auth.py, identity.py) and serves each
authenticated one (serverconn.py), within the bounds on each peer node.
Every connection runs in its own task whose failure is logged in one line
and closes only that connection.

Authenticated peers are bounded too, per peer node over all its
connections: at most ``max_connections_per_peer`` connections (a new one
closes its oldest), and at most ``max_buffered_per_peer`` bytes of request
payloads received into buffers (not placed by the placer) and of reply
buffers taken by handlers through ``Request.budget``: a request whose
payload would go over it is not read until others are done (TCP
backpressure). Per connection, up to REQUEST_POOL_BYTES (serverconn.py) of
buffers are kept for reuse besides.
"""

from __future__ import annotations

import logging
import ssl
from dataclasses import dataclass, field
from functools import partial
from typing import Protocol

import trio
from ckptfs.peer.transport import auth
from ckptfs.peer.transport.admission import Entrant, HandshakeGate, RefusalLog
from ckptfs.peer.transport.auth import AuthError, one_line
from ckptfs.peer.transport.channel import Channel, tls_handshake
from ckptfs.peer.transport.limits import DEFAULT_LIMITS, Limits, PeerBudget
from ckptfs.peer.transport.messages import Handler, Placer
from ckptfs.peer.transport.serverconn import ServerConnection

log = logging.getLogger("ckptfs.peer")

REFUSAL_LOGS_PER_SECOND = 50


class IdentityCheck(Protocol):
    """Refuses a claimed node name (identity.NodeIdentities)."""

    async def check(self, name: str, source: str) -> None: ...


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


@dataclass(eq=False)
class _PeerLoad:
    """What one authenticated peer node holds on this server."""

    budget: PeerBudget
    connections: list[ServerConnection] = field(default_factory=list)  # oldest first


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
        self.gate = HandshakeGate(limits)
        self.peers: dict[str, _PeerLoad] = {}
        self.refused = RefusalLog(REFUSAL_LOGS_PER_SECOND)

    async def handle(self, stream: trio.SocketStream) -> None:
        address = _address(stream)
        channel: Channel | None = None
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

    async def _serve_peer(self, channel: Channel, peer: str) -> None:
        load = self.peers.get(peer)
        if load is None:
            load = self.peers[peer] = _PeerLoad(PeerBudget(self.limits.max_buffered_per_peer))
        conn = ServerConnection(
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

    async def _admit(self, stream: trio.SocketStream, address: str) -> tuple[Channel, str] | None:
        ip = str(_peer_host_port(stream)[0])
        entrant = self.gate.enter(ip, address, stream.socket)
        wrapped: trio.abc.Stream = stream
        admitted: tuple[Channel, str] | None = None
        try:
            # Until the HELLO: hello_timeout; then handshake_timeout from the start.
            with entrant.scope:
                await trio.lowlevel.wait_readable(stream.socket)
                entrant.spoke = True
                if self.ssl_context is not None:
                    wrapped = trio.SSLStream(stream, self.ssl_context, server_side=True)
                    await tls_handshake(wrapped, address)
                channel = Channel(wrapped, self.limits, address)
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

    def _too_slow(self, entrant: Entrant) -> str:
        if entrant.scope.deadline < entrant.started + self.limits.handshake_timeout:
            return f"handshake timed out: no HELLO within {self.limits.hello_timeout:g}s"
        return f"handshake timed out after {self.limits.handshake_timeout:g}s"

    async def _hello(self, entrant: Entrant, node: str) -> None:
        """The client's HELLO claims ``node``: refuse it unless it may be that
        node, then give it one of that node's handshake slots."""
        if self.identity is not None:
            await self.identity.check(node, entrant.ip)
        self.gate.promote(entrant, node)
        entrant.scope.deadline = entrant.started + self.limits.handshake_timeout


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
