"""The server's bounds before a connection is authenticated: the pool of
connections waiting for their HELLO, the handshake slots of each node claimed,
and the rate limit of the WARNING logged for each refused connection.

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
start. Refusals are logged at WARNING, at most 50 lines a second.
"""

from __future__ import annotations

import logging
import select
import time
from typing import Any

import trio
from ckptfs.peer.transport.auth import AuthError, one_line
from ckptfs.peer.transport.limits import Limits

log = logging.getLogger("ckptfs.peer")


class RefusalLog:
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


class Entrant:
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


class HandshakeGate:
    """The handshake's admission (see the module docstring): the pool of
    connections before their HELLO, by source IP, and the slots of each
    claimed node after it."""

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self.waiting: dict[str, list[Entrant]] = {}  # oldest first
        self.count = 0
        self.shaking: dict[str, int] = {}

    def enter(self, ip: str, address: str, sock: Any) -> Entrant:
        """Admit a new connection, closing another if there is no room."""
        limits = self.limits
        now = trio.current_time()
        entrant = Entrant(
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

    def _evict(self, candidates: list[Entrant], reason: str) -> None:
        victim = next((e for e in candidates if e.silent()), candidates[0])
        victim.evicted = f"{reason}; closed the oldest silent one for a newer one"
        self._forget(victim)
        victim.scope.cancel()

    def promote(self, entrant: Entrant, node: str) -> None:
        """Its HELLO claimed ``node`` (and passed the identity check): move it
        to that node's handshake slots; AuthError if they are all taken."""
        taken = self.shaking.get(node, 0)
        if taken >= self.limits.max_handshakes_per_node:
            raise AuthError(f"already {taken} handshakes of node {node!r} under way")
        self._forget(entrant)
        entrant.node = node
        self.shaking[node] = taken + 1

    def leave(self, entrant: Entrant) -> None:
        node, entrant.node = entrant.node, None
        if node is None:
            self._forget(entrant)
            return
        self.shaking[node] -= 1
        if not self.shaking[node]:
            del self.shaking[node]

    def _forget(self, entrant: Entrant) -> None:
        group = self.waiting.get(entrant.ip)
        if group is not None and entrant in group:
            group.remove(entrant)
            self.count -= 1
            if not group:
                del self.waiting[entrant.ip]
