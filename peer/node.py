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
from ckptfs.fs.cache.cache import Cache
from ckptfs.fs.read.frames import FrameCache
from ckptfs.fs.store.manifest import Manifest
from ckptfs.peer.config import PeersConfig, ssl_contexts
from ckptfs.peer.membership.membership import HEARTBEAT, Membership
from ckptfs.peer.mirror.client import MirrorClient
from ckptfs.peer.mirror.server import MirrorServer
from ckptfs.peer.mirror.wire import ROUTES as MIRROR_ROUTES
from ckptfs.peer.reads.reads import READ, LocalRead, PeerFetcher, PeerReadError, ReadServer
from ckptfs.peer.reads.represent import CHUNK, ChunkServer, Representation, RepresentativeFetch
from ckptfs.peer.transport.identity import NodeIdentities, source_address
from ckptfs.peer.transport.transport import PeerClient, Request, Response, serve

log = logging.getLogger("ckptfs.peer.node")

Route = Callable[[str, Request], Awaitable[Response]]


class PeerNode:
    def __init__(
        self,
        config: PeersConfig,
        local_read: LocalRead,
        *,
        cache: Cache,
        manifest_at: Callable[[str], Awaitable[Manifest | None]],
        mirror_writes: bool,
    ) -> None:
        self.config = config
        self.cache = cache
        self.mirror_writes = mirror_writes  # durability buddy: stream our files to the buddy
        contexts = ssl_contexts(config)
        self._server_tls, self._client_tls = contexts if contexts else (None, None)
        self.membership = Membership(
            config,
            ssl_context=self._client_tls,
            on_alive=self._alive,
            on_dead=self._dead,
            on_restarted=self._restarted,
        )
        self.reads = ReadServer(
            local_read, partial(cache.changing, writer_alive=self.membership.is_alive)
        )
        self.fetcher: PeerFetcher | None = None  # once running
        self.mirror_client: MirrorClient | None = None  # once running, with mirror_writes
        self.mirror_server = MirrorServer(
            cache,
            mirrored_for=config.mirrored_for(),
            timeout=config.timeout,
            manifest_at=manifest_at,
            is_alive=self.membership.is_alive,
        )
        self.routes: dict[str, Route] = {
            HEARTBEAT: self.membership.handle_heartbeat,
            READ: self.reads.handle,
            **dict.fromkeys(MIRROR_ROUTES, self.mirror_server.handle),
        }
        self._nursery: trio.Nursery | None = None
        self.port: int | None = None

    async def fetch(
        self,
        holders: list[str],
        file_id: str,
        version: str,
        offset: int,
        length: int,
        into: bytearray | None = None,
    ) -> bytes | memoryview:
        """A verified range of a file pending on other nodes (PeerReadError if
        no holder serves it), received into ``into`` if given."""
        others = [h for h in holders if h != self.config.node]
        if self.fetcher is None or not others:
            raise PeerReadError(f"no other holder of {file_id}@{version} ({', '.join(holders)})")
        # The first holder a pending manifest names is its writer: a buddy
        # serves only a mirror that writer sent it.
        return await self.fetcher.fetch(
            others, file_id, version, offset, length, into, writer=holders[0]
        )

    async def handle(self, peer: str, request: Request) -> Response:
        if peer == self.config.node or peer not in self.config.nodes:
            # The transport's identity check admits only the other nodes.
            return Response.fail(f"{peer!r} is not another node of this cluster")
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
                        placer=self.mirror_server.place,
                        identity=NodeIdentities.of(self.config),
                    )
                )
            except OSError as exc:
                raise OSError(
                    exc.errno, f"cannot listen for peers on {listen}: {exc.strerror}"
                ) from None
            self.port = listeners[0].socket.getsockname()[1]
            # Before the membership runs: a death it sees at once must start
            # a takeover (_dead ignores deaths while there is no nursery).
            self._nursery = nursery
            await nursery.start(self.membership.run)
            client = await nursery.start(self._run_client)
            addresses = {name: (a.host, a.port) for name, a in self.config.nodes.items()}
            self.fetcher = PeerFetcher(
                client, addresses, timeout=self.config.timeout, is_alive=self.membership.is_alive
            )
            if self.mirror_writes:
                self.mirror_client = MirrorClient(
                    self.cache,
                    client,
                    node=self.config.node,
                    buddy=self.config.buddy,
                    address=addresses[self.config.buddy],
                    timeout=self.config.timeout,
                    is_alive=self.membership.is_alive,
                    incarnation=self.membership.incarnation,
                )
                nursery.start_soon(self.mirror_client.run)
            nursery.start_soon(self.mirror_server.sweep)
            log.info(
                "peer server on %s (node %s, buddy %s, %d peer(s))",
                listen,
                self.config.node,
                self.config.buddy,
                len(self.config.peers),
            )
            task_status.started()

    async def _run_client(self, *, task_status: trio.TaskStatus[PeerClient]) -> None:
        async with PeerClient(
            node=self.config.node,
            secret=self.config.secret,
            cluster_hash=self.config.cluster_hash,
            ssl_context=self._client_tls,
            local_address=source_address(self.config),
        ) as client:
            task_status.started(client)
            await trio.sleep_forever()

    def represent(self, frames: FrameCache, alloc: Callable[[], int | None]) -> Representation:
        """Serve ``chunk`` requests from this node's frames, and fill them from
        representatives (peer/reads/represent.py). Single-node mounts never
        call this."""
        config = self.config
        fetch = RepresentativeFetch(
            config.node,
            live_nodes=self.membership.alive_nodes,
            addresses={name: (a.host, a.port) for name, a in config.nodes.items()},
            client=lambda: self.fetcher.client if self.fetcher is not None else None,
            timeout=config.timeout,
        )
        server = ChunkServer(frames, alloc)
        self.routes[CHUNK] = server.handle
        frames.remote = fetch.fill
        return Representation(server, fetch)

    def _alive(self, name: str) -> None:
        log.debug("peer %s alive (membership logs the change)", name)
        if name in self.config.mirrored_for():
            self.mirror_server.restarted(name)
        if name == self.config.buddy and self.mirror_client is not None and self._nursery:
            # It may have restarted with none of our mirrors.
            self._nursery.start_soon(self.mirror_client.resync)

    def _dead(self, name: str) -> None:
        # The membership has already logged the death.
        if name in self.config.mirrored_for() and self._nursery is not None:
            self.mirror_server.take_over_soon(name, self._nursery)

    def _restarted(self, name: str) -> None:
        # Back as a new process before its death was noticed: it may have
        # lost what it committed with its cache, and is never declared dead.
        incarnation = self.membership.peer(name).incarnation
        if name in self.config.mirrored_for() and self._nursery is not None and incarnation:
            self.mirror_server.take_over_soon(name, self._nursery, restarted_as=incarnation)

    def stats(self) -> list[dict[str, Any]]:
        return list(self.membership.stats()["peers"])

    def mirror_stats(self) -> dict[str, Any]:
        return {
            "writer": self.mirror_client.stats() if self.mirror_client else None,
            "buddy_for": list(self.config.mirrored_for()),
            **self.mirror_server.stats(),
        }

    def counters(self) -> dict[str, int]:
        fetched = self.fetcher.stats() if self.fetcher else {}
        return {
            **fetched,
            "ranges_served": self.reads.ranges_served,
            "bytes_served": self.reads.bytes_served,
        }
