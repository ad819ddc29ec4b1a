"""Connections of one's own to peers, dialed on demand.

Bulk transfers (peer reads, representative fetches, mirrored pages) each use
connections of their own, so they never delay heartbeats or each other. A
peer is dialed by one task at a time (the others wait for that dial), and a
connection that failed is dropped so that the next use dials afresh.
"""

from __future__ import annotations

from collections.abc import Callable

import trio
from ckptfs.peer.transport.client import PeerClient, PeerConnection


class Dialer:
    def __init__(self, addresses: dict[str, tuple[str, int]], *, timeout: float) -> None:
        self.addresses = addresses
        self.timeout = timeout
        self._connections: dict[str, PeerConnection] = {}
        self._dialing: dict[str, trio.Lock] = {}

    async def connection(
        self,
        client: PeerClient,
        name: str,
        *,
        before_dial: Callable[[], None] = lambda: None,
    ) -> PeerConnection:
        """The open connection to ``name``, dialed if there is none.
        ``before_dial`` may raise to refuse dialing (e.g. the peer failed
        while this task waited for another's dial)."""
        lock = self._dialing.setdefault(name, trio.Lock())
        async with lock:
            conn = self._connections.get(name)
            if conn is not None and not conn.closed:
                return conn
            before_dial()
            host, port = self.addresses[name]
            conn = await client.connect(host, port, expect_node=name, timeout=self.timeout)
            self._connections[name] = conn
            return conn

    async def forget(self, name: str) -> None:
        """Drop the connection to ``name`` after a failure."""
        conn = self._connections.pop(name, None)
        if conn is not None:
            with trio.move_on_after(self.timeout):
                await conn.aclose()
