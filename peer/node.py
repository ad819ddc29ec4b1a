"""This daemon's place in the cluster: the peer server and the membership.

Owns what runs for ``peers`` in the daemon: one authenticated server on
``peers.listen`` whose requests are routed by type, and the heartbeat
membership. Features (mirroring, peer reads, takeover) add their request
types to ``routes`` and hook ``Membership``'s callbacks.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

import trio

from .config import PeersConfig, ssl_contexts
from .membership import HEARTBEAT, Membership
from .transport import Request, Response, serve

log = logging.getLogger("ckptfs.peer.node")

Route = Callable[[str, Request], Awaitable[Response]]


class PeerNode:
    def __init__(self, config: PeersConfig) -> None:
        self.config = config
        contexts = ssl_contexts(config)
        self._server_tls, client_tls = contexts if contexts else (None, None)
        self.membership = Membership(
            config, ssl_context=client_tls, on_alive=self._alive, on_dead=self._dead
        )
        self.routes: dict[str, Route] = {HEARTBEAT: self.membership.handle_heartbeat}
        self.port: int | None = None

    async def handle(self, peer: str, request: Request) -> Response:
        route = self.routes.get(request.type)
        if route is None:
            return Response.fail(f"unknown request type {request.type!r}")
        return await route(peer, request)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve peers and track them until cancelled; started once listening."""
        listen = self.config.listen
        async with trio.open_nursery() as nursery:
            try:
                listeners = await nursery.start(
                    partial(
                        serve,
                        listen.host,
                        listen.port,
                        node=self.config.node,
                        secret=self.config.secret,
                        cluster_hash=self.config.cluster_hash,
                        handler=self.handle,
                        ssl_context=self._server_tls,
                    )
                )
            except OSError as exc:
                raise OSError(
                    exc.errno, f"cannot listen for peers on {listen}: {exc.strerror}"
                ) from None
            self.port = listeners[0].socket.getsockname()[1]
            await nursery.start(self.membership.run)
            log.info(
                "peer server on %s (node %s, buddy %s, %d peer(s))",
                listen,
                self.config.node,
                self.config.buddy,
                len(self.config.peers),
            )
            task_status.started()

    def _alive(self, name: str) -> None:
        log.debug("peer %s alive (membership logs the change)", name)

    def _dead(self, name: str) -> None:
        # Takeover of the files it wrote hooks in here (issue 12); the
        # membership has already logged the death.
        log.debug("peer %s dead", name)

    def stats(self) -> list[dict[str, Any]]:
        return list(self.membership.stats()["peers"])
