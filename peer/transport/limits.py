"""The transport's bounds: Limits (deadlines, sizes, counts; see transport.py,
server.py and admission.py for what each bounds) and PeerBudget, the bytes of
buffers one peer node's requests may hold at once on a server."""

from __future__ import annotations

from dataclasses import dataclass

import trio
from ckptfs.peer.transport import auth, wire

MiB = 1024 * 1024


@dataclass(frozen=True)
class Limits:
    max_payload: int = wire.DEFAULT_MAX_PAYLOAD
    handshake_timeout: float = auth.HANDSHAKE_TIMEOUT
    frame_timeout: float = 10.0
    min_rate: float = 1.0 * MiB  # bytes/s a payload must at least move at
    request_timeout: float = 30.0
    max_concurrent_requests: int = 32  # per connection
    # The handshake (see admission.py).
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
