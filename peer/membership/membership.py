"""Liveness of the other nodes: heartbeats, dead/alive decisions, callbacks.

One ``Membership`` per daemon. For every other node in ``peers.nodes`` it
keeps one authenticated connection (a ``PeerClient`` owned by ``run()``),
sends a ``heartbeat`` request every ``peers.heartbeat`` seconds and tracks the
answers. The other side answers through ``handle_heartbeat``, which the daemon
routes the ``heartbeat`` request type to in ``transport.serve``'s handler.

Each peer is ``unknown`` (not heard from since start), ``alive`` or ``dead``:

* alive: a heartbeat of ours was answered. Only answers to our own requests
  count: a node that can dial us but cannot be reached by us can neither
  receive mirrors nor serve reads, so it is not alive for us.
* dead: ``peers.timeout`` seconds passed without an answer (counted from the
  last answer, or from ``run()``'s start for a peer never heard from). A
  refused TCP connect does not declare death sooner: a daemon restart is
  quick and its cache survives it, so a takeover would be wasted work.

``on_alive(name)`` and ``on_dead(name)`` are called on each change into that
state (also unknown -> dead, for a peer that never answered);
``on_restarted(name)`` when a peer answers as a new process (another
incarnation), whether or not it was missed in between. They run inside
the membership's task and must not block: start a task or send on a channel
for any work that waits. An exception in a callback is logged and ignored.

Nothing here waits without a bound: a connect, including the TLS and auth
handshakes, and each heartbeat request are bounded by ``peers.timeout``; a
failed connect is retried with exponential backoff (with jitter, capped at
``peers.timeout``), cut short when the peer's own heartbeat reaches us so a
restarted node is seen again at once. After a failed heartbeat the
connection is closed and a fresh one dialled, so a stalled peer never
collects a queue of abandoned requests. A node with a different cluster hash
is refused by the handshake (both sides log it) and never becomes alive.

The heartbeat connection carries only heartbeats (and other small control
requests via ``connection()``): a bulk transfer queued ahead of a heartbeat on
the same connection would delay it and make a busy peer look dead.
"""

from __future__ import annotations

import enum
import logging
import random
import secrets
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import trio
from ckptfs.peer.config import Address, PeersConfig
from ckptfs.peer.transport.auth import one_line
from ckptfs.peer.transport.client import PeerConnection
from ckptfs.peer.transport.identity import source_address
from ckptfs.peer.transport.limits import DEFAULT_LIMITS, Limits
from ckptfs.peer.transport.transport import PeerClient, Request, Response
from ckptfs.peer.transport.wire import PeerError

log = logging.getLogger("ckptfs.peer.membership")

HEARTBEAT = "heartbeat"  # the request type handle_heartbeat answers
MIN_BACKOFF = 0.01  # seconds

Callback = Callable[[str], object]


class Status(enum.Enum):
    UNKNOWN = "unknown"
    ALIVE = "alive"
    DEAD = "dead"


@dataclass(eq=False)
class PeerState:
    """What this node knows about one other node. Times are trio.current_time()
    unless named wall."""

    name: str
    address: Address
    status: Status = Status.UNKNOWN
    since: float = 0.0  # when status last changed
    last_answer: float | None = None
    last_heartbeat_wall: float | None = None  # time.time() of the last answer
    last_heard: float | None = None  # the peer's last heartbeat to us
    failures: int = 0  # consecutive failed connects or heartbeats
    last_error: str | None = None
    rtt: float | None = None
    incarnation: str | None = None  # changes when the peer's daemon restarts
    connection: PeerConnection | None = None
    wake: trio.Event = field(default_factory=trio.Event)

    @property
    def alive(self) -> bool:
        return self.status is Status.ALIVE

    def usable_connection(self) -> PeerConnection | None:
        conn = self.connection
        return conn if conn is not None and not conn.closed else None


class _Backoff:
    """Delays for reconnect attempts: doubling from `low` to `high`, +-20 % jitter
    so that nodes that lost the same peer do not redial it in lockstep."""

    def __init__(self, low: float, high: float) -> None:
        self.low, self.high = low, high
        self.current = low

    def next(self) -> float:
        delay = self.current
        self.current = min(self.current * 2, self.high)
        return delay * random.uniform(0.8, 1.2)

    def reset(self) -> None:
        self.current = self.low


class Membership:
    """Heartbeats to every peer of `config`; see the module docstring.

    `ssl_context` is the client side of TLS (config.ssl_contexts()[1]), `limits`
    those of the transport. Use as ``await nursery.start(membership.run)``.
    """

    def __init__(
        self,
        config: PeersConfig,
        *,
        ssl_context: ssl.SSLContext | None = None,
        limits: Limits = DEFAULT_LIMITS,
        on_alive: Callback | None = None,
        on_dead: Callback | None = None,
        on_restarted: Callback | None = None,
    ) -> None:
        self.config = config
        self.node = config.node
        self.incarnation = secrets.token_hex(8)
        self._ssl_context = ssl_context
        self._limits = limits
        self._on_alive = on_alive
        self._on_dead = on_dead
        self._on_restarted = on_restarted
        self._peers = {name: PeerState(name, config.nodes[name]) for name in config.peers}
        self._changed = trio.Event()  # set and replaced on every status change
        self._started: float | None = None
        self._backoff = (max(MIN_BACKOFF, config.heartbeat / 4), config.timeout)

    # ------------------------------------------------------------ queries

    def is_alive(self, name: str) -> bool:
        """True for this node and for peers whose heartbeats are answered."""
        if name == self.node:
            return True
        peer = self._peers.get(name)
        return peer is not None and peer.alive

    def alive_nodes(self) -> list[str]:
        """This node and every alive peer, in the configured order (for
        rendezvous hashing over the live nodes)."""
        return [name for name in self.config.nodes if self.is_alive(name)]

    def peer(self, name: str) -> PeerState:
        """The state of peer `name` (KeyError if it is not a peer)."""
        return self._peers[name]

    def connection(self, name: str) -> PeerConnection | None:
        """The open heartbeat connection to an alive peer, for small control
        requests only (see the module docstring); None if there is none."""
        peer = self._peers.get(name)
        return peer.usable_connection() if peer is not None and peer.alive else None

    async def wait_until(self, name: str, *, alive: bool, timeout: float) -> bool:
        """Wait up to `timeout` seconds for peer `name` to be (not) alive;
        True if it is."""
        with trio.move_on_after(timeout):
            while self.is_alive(name) != alive:
                await self._changed.wait()
        return self.is_alive(name) == alive

    def stats(self) -> dict[str, Any]:
        """JSON-able state for ``ckptfs stat``: ``peers[]`` has at least
        name, address and alive."""
        wall = time.time()
        return {
            "node": self.node,
            "incarnation": self.incarnation,
            "cluster": self.config.cluster_hash,
            "buddy": self.config.buddy,
            "heartbeat": self.config.heartbeat,
            "timeout": self.config.timeout,
            "peers": [self._peer_stats(peer, wall) for peer in self._peers.values()],
        }

    def _peer_stats(self, peer: PeerState, wall: float) -> dict[str, Any]:
        last = peer.last_heartbeat_wall
        return {
            "name": peer.name,
            "address": str(peer.address),
            "alive": peer.alive,
            "state": peer.status.value,
            "buddy": peer.name == self.config.buddy,
            "last_heartbeat": last,
            "last_heartbeat_age": None if last is None else round(max(0.0, wall - last), 3),
            "rtt_ms": None if peer.rtt is None else round(peer.rtt * 1000, 3),
            "failures": peer.failures,
            "last_error": peer.last_error,
            "incarnation": peer.incarnation,
        }

    # ------------------------------------------------------------ serving

    async def handle_heartbeat(self, peer: str, request: Request) -> Response:
        """The transport handler for ``heartbeat`` requests from `peer`."""
        state = self._peers.get(peer)
        if state is None:
            # Same cluster hash but not a peer: this node itself under another
            # process, or a bug. Answer, but with an error it will log.
            return Response.fail(f"{peer!r} is not a peer of {self.node!r}")
        state.last_heard = trio.current_time()
        if not state.alive:
            state.wake.set()  # it is up: redial now rather than after the backoff
        return Response(
            meta={"node": self.node, "incarnation": self.incarnation, "time": time.time()}
        )

    # ------------------------------------------------------------ running

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Heartbeat every peer until cancelled."""
        if self._started is not None:
            raise RuntimeError("Membership.run() is already running or has run")
        self._started = trio.current_time()
        for peer in self._peers.values():
            peer.since = self._started
        client = PeerClient(
            node=self.node,
            secret=self.config.secret,
            cluster_hash=self.config.cluster_hash,
            ssl_context=self._ssl_context,
            limits=self._limits,
            local_address=source_address(self.config),
        )
        async with client, trio.open_nursery() as nursery:
            for peer in self._peers.values():
                nursery.start_soon(self._peer_loop, client, peer)
            nursery.start_soon(self._watchdog)
            task_status.started()

    async def _peer_loop(self, client: PeerClient, peer: PeerState) -> None:
        backoff = _Backoff(*self._backoff)
        while True:
            began = trio.current_time()
            try:
                if peer.usable_connection() is None:
                    if not await self._connect(client, peer):
                        await self._pause(peer, backoff.next())
                        continue
                    backoff.reset()
                await self._beat(peer)
            except Exception as exc:  # a bug must not end the heartbeats of every peer
                log.exception("heartbeat to peer %r failed unexpectedly", peer.name)
                self._failed(peer, f"internal error: {exc!r}")
                await self._pause(peer, backoff.next())
                continue
            await self._pause(peer, began + self.config.heartbeat - trio.current_time())

    async def _connect(self, client: PeerClient, peer: PeerState) -> bool:
        host, port = peer.address
        try:
            peer.connection = await client.connect(
                host, port, expect_node=peer.name, timeout=self.config.timeout
            )
        except PeerError as exc:  # unreachable, timed out, refused (auth, cluster hash)
            self._failed(peer, str(exc))
            return False
        log.debug("connected to peer %r at %s", peer.name, peer.address)
        return True

    async def _beat(self, peer: PeerState) -> None:
        conn = peer.usable_connection()
        assert conn is not None
        sent = trio.current_time()
        meta = {"node": self.node, "incarnation": self.incarnation}
        try:
            response = await conn.request(HEARTBEAT, meta, timeout=self.config.timeout)
            response.check()
        except PeerError as exc:
            await self._drop(peer)
            self._failed(peer, str(exc))
            return
        self._answered(peer, trio.current_time() - sent, response.meta)

    async def _drop(self, peer: PeerState) -> None:
        conn, peer.connection = peer.connection, None
        if conn is not None:
            with trio.move_on_after(self.config.timeout):
                await conn.aclose()

    async def _pause(self, peer: PeerState, seconds: float) -> None:
        with trio.move_on_after(max(0.0, seconds)):
            await peer.wake.wait()
        if peer.wake.is_set():
            peer.wake = trio.Event()

    async def _watchdog(self) -> None:
        """Declare dead every peer whose last answer is `timeout` old."""
        assert self._started is not None
        while True:
            now = trio.current_time()
            wake_at = now + self.config.heartbeat  # look again at least this often
            for peer in self._peers.values():
                if peer.status is Status.DEAD:
                    continue
                since = self._started if peer.last_answer is None else peer.last_answer
                deadline = since + self.config.timeout
                if now >= deadline:
                    self._set_status(peer, Status.DEAD)
                else:
                    wake_at = min(wake_at, deadline)
            await trio.sleep_until(wake_at)

    # ------------------------------------------------------------ state changes

    def _answered(self, peer: PeerState, rtt: float, meta: dict[str, Any]) -> None:
        peer.last_answer = trio.current_time()
        peer.last_heartbeat_wall = time.time()
        peer.rtt = rtt
        peer.failures = 0
        peer.last_error = None
        incarnation = meta.get("incarnation")
        restarted = False
        if isinstance(incarnation, str):
            if peer.incarnation is not None and incarnation != peer.incarnation:
                log.info("peer %r restarted (new incarnation %s)", peer.name, one_line(incarnation))
                restarted = True
            peer.incarnation = one_line(incarnation, 64)
        if not peer.alive:
            self._set_status(peer, Status.ALIVE)
        elif restarted and self._on_alive is not None:
            # Back before it was missed: what it held in RAM is gone all the same.
            try:
                self._on_alive(peer.name)
            except Exception:
                log.exception("alive callback for restarted peer %r failed", peer.name)
        if restarted and self._on_restarted is not None:
            try:
                self._on_restarted(peer.name)
            except Exception:
                log.exception("restarted callback for peer %r failed", peer.name)

    def _failed(self, peer: PeerState, error: str) -> None:
        peer.failures += 1
        error = one_line(error)
        # One line per streak of the same error, not one per retry.
        level = logging.DEBUG if error == peer.last_error else logging.INFO
        log.log(level, "heartbeat to peer %r at %s failed: %s", peer.name, peer.address, error)
        peer.last_error = error

    def _set_status(self, peer: PeerState, status: Status) -> None:
        now = trio.current_time()
        previous, peer.status, peer.since = peer.status, status, now
        if status is Status.DEAD:
            since = self._started if peer.last_answer is None else peer.last_answer
            assert since is not None
            # A peer never heard from is usually one that starts later than
            # this node: worth a line, not an operator's attention.
            log.log(
                logging.INFO if previous is Status.UNKNOWN else logging.WARNING,
                "peer %r at %s is dead: no answer for %.1fs (last error: %s)",
                peer.name,
                peer.address,
                now - since,
                peer.last_error or "none",
            )
        else:
            log.info("peer %r at %s is alive (was %s)", peer.name, peer.address, previous.value)
        self._changed.set()
        self._changed = trio.Event()
        callback = self._on_dead if status is Status.DEAD else self._on_alive
        if callback is not None:
            try:
                callback(peer.name)
            except Exception:
                log.exception("%s callback for peer %r failed", status.value, peer.name)
