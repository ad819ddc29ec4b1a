"""Representative fetch: a durable chunk that several nodes want is read from
the backing store once, by one node, and served from that node's RAM.

Who: the chunk's representative is chosen by rendezvous (highest-random-weight)
hashing of the chunk's hash over the live nodes, this node included. Every
node that sees the same live set picks the same node without talking, the
chunks of a file spread evenly over the nodes, and when a node dies only the
chunks it represented move to another node.

The wire: request type ``chunk`` with meta ``{"hash", "length", "offset",
"count"}`` (the chunk's name and size, and the byte range wanted); the
response's payload is those bytes. A node fills a frame piece by piece, one
request per arena slot (at most ``MAX_PIECE`` bytes, far under the transport's
payload limit), all pieces in flight at once, each received straight into its
slot.

Once across nodes: the representative serves every piece from a frame of its
own frame cache (fs/read/frames.py), got through ``FrameCache.acquire``, so all
requests for one chunk (other nodes', and its own readers' and read-ahead's)
share one read from the store and one copy in RAM. A representative never
forwards a request: what it is asked for, it reads from the store itself (the
frame fill sees it runs for a peer and skips this hook), so two nodes whose
views of the live set differ cannot send a request around in a circle.

Verification: the whole chunk is hashed in the asking node's slots after the
last piece arrived; the chunk's name is its xxh3-128, so wrong bytes are a
mismatch. Any failure (refused, connection lost, no answer within
``peers.timeout``, a mismatch) is one INFO line, and the node reads the chunk
from the backing store itself, as a single node would; the frame stays
LOADING throughout, so nobody reads the slots before they are verified. The
caller's stop signal (fs/interrupts.py) ends a fetch for its own READ at once,
as it ends a read from the store: the READ gets EINTR, and whoever waited for
the same frame reads it again.
"""

from __future__ import annotations

import contextvars
import logging
import re
import time
from collections.abc import Callable, Sequence
from typing import Any

import trio
import xxhash
from ckptfs.fs.interrupts import Interrupted, interruptible
from ckptfs.fs.read.frames import FrameCache
from ckptfs.fs.store.chunkstore import pieces_hash
from ckptfs.fs.store.manifest import Chunk
from ckptfs.peer.transport.dialer import Dialer
from ckptfs.peer.transport.errors import RemoteError
from ckptfs.peer.transport.transport import PeerClient, Request, Response
from ckptfs.peer.transport.wire import PeerError

log = logging.getLogger("ckptfs.peer.represent")

CHUNK = "chunk"  # the request type
MAX_PIECE = 8 << 20  # bytes per request, as peer reads (reads.MAX_READ): under the payload limit
MAX_CHUNK = 256 << 20  # the largest chunk_size a mount accepts (fs/config.py)
HASH_THREADS = 2  # hashing of fetched chunks at once (xxhash releases the GIL)
_DIGEST = re.compile(r"[0-9a-f]{32}")

# Set while a frame is filled for a peer's request: that fill reads the store
# and never asks another node (see the module docstring).
_serving_peer: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "ckptfs_serving_peer", default=False
)


class RepresentativeError(OSError):
    """The representative did not deliver the chunk's verified bytes."""


def weight(node: str, digest: str) -> int:
    """The rendezvous weight of ``node`` for chunk ``digest``."""
    return xxhash.xxh3_64_intdigest(f"{node}\0{digest}".encode())


def representative(digest: str, nodes: Sequence[str]) -> str:
    """The node among ``nodes`` (non-empty) that reads chunk ``digest`` for all."""
    return max(nodes, key=lambda node: (weight(node, digest), node))


def pieces(length: int, size: int) -> list[tuple[int, int]]:
    """(offset, count) of the requests for a chunk of ``length``, one per slot of ``size``."""
    return [(off, min(size, length - off)) for off in range(0, length, size)]


class ChunkServer:
    """Answers ``chunk`` requests from this node's frame cache."""

    def __init__(self, frames: FrameCache, alloc: Callable[[], int | None]) -> None:
        self.frames = frames
        self.alloc = alloc
        self.chunks_served = 0  # requests for a chunk's first piece: one per chunk fetch
        self.pieces_served = 0
        self.bytes_served = 0
        self.failures = 0

    async def handle(self, peer: str, request: Request) -> Response:
        try:
            chunk, offset, count = _parse(request.meta)
        except ValueError as exc:
            return Response.fail(f"malformed chunk request: {exc}")
        what = f"a request from {peer}"
        token = _serving_peer.set(True)
        try:
            frame = await self.frames.acquire(chunk, what, self.alloc)
            if frame is None:
                # No room for a frame (memory full of bytes not yet durable):
                # streaming the chunk once per piece would read it several
                # times; the asking node reads it from the store once instead.
                self.failures += 1
                return Response.fail(f"no room in the cache of this node for chunk {chunk.hash}")
            data, release = self._payload(frame.slots, offset, count)
        except OSError as exc:
            self.failures += 1
            return Response.fail(f"cannot read chunk {chunk.hash}: {exc}")
        finally:
            _serving_peer.reset(token)
        self.pieces_served += 1
        self.chunks_served += offset == 0
        self.bytes_served += count
        return Response(meta={"length": count}, payload=data, release=release)

    def _payload(
        self, slots: list[int], offset: int, count: int
    ) -> tuple[bytes | memoryview, Callable[[], None] | None]:
        """The range as a view of its slot, pinned until the response is sent
        (an eviction meanwhile defers reusing the slot); a copy if it spans slots."""
        arena = self.frames.arena
        index, start = divmod(offset, arena.slot_size)
        if start + count > arena.slot_size:
            pos, parts = offset, []
            while pos < offset + count:
                i, o = divmod(pos, arena.slot_size)
                n = min(arena.slot_size - o, offset + count - pos)
                parts.append(arena.slot_view(slots[i], o, n))
                pos += n
            return b"".join(parts), None
        slot = slots[index]
        arena.pin(slot)
        return arena.slot_view(slot, start, count), lambda: arena.unpin(slot)


def _parse(meta: dict[str, Any]) -> tuple[Chunk, int, int]:
    digest = meta.get("hash")
    if not isinstance(digest, str) or not _DIGEST.fullmatch(digest):
        raise ValueError("hash must be 32 lowercase hex digits")
    values = [meta.get(key) for key in ("length", "offset", "count")]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise ValueError("length, offset and count must be integers")
    length, offset, count = values
    if not 0 < length <= MAX_CHUNK:
        raise ValueError(f"chunk length {length} outside 1..{MAX_CHUNK}")
    if offset < 0 or not 0 < count <= MAX_PIECE or offset + count > length:
        raise ValueError(f"range {offset}+{count} outside the chunk or over {MAX_PIECE} bytes")
    return Chunk(0, length, digest), offset, count


class RepresentativeFetch:
    """This node's side: fill a frame from the chunk's representative, if that
    is another live node (the hook FrameCache calls before reading the store)."""

    def __init__(
        self,
        node: str,
        *,
        live_nodes: Callable[[], list[str]],
        addresses: dict[str, tuple[str, int]],
        client: Callable[[], PeerClient | None],
        timeout: float,
    ) -> None:
        self.node = node
        self.live_nodes = live_nodes
        self.addresses = addresses
        self.client = client  # None until the peer node runs
        self.timeout = timeout
        self.hash_limiter = trio.CapacityLimiter(HASH_THREADS)
        self.dialer = Dialer(addresses, timeout=timeout)
        # A node that just failed us is skipped for one timeout, so that a hung
        # one costs one timeout, not one per chunk, until membership notices.
        self._suspect: dict[str, float] = {}
        self.chunks_fetched = 0
        self.bytes_fetched = 0
        self.fallbacks = 0

    def choose(self, digest: str) -> str:
        return representative(digest, self.live_nodes() or [self.node])

    async def fill(self, chunk: Chunk, views: list[memoryview], what: str) -> bool:
        """Fill ``views`` (the frame's whole slots, in order) with the chunk's
        verified bytes from its representative: True if done; False if this
        node must read the store itself (it is the representative, serves a
        peer, or the representative failed: then logged and counted).
        Raises Interrupted if its caller's stop signal ended the wait.

        Returns or raises only once nothing writes into ``views`` any more."""
        if _serving_peer.get():
            return False
        rep = self.choose(chunk.hash)
        if rep == self.node:
            return False
        client = self.client()
        if client is None or rep not in self.addresses:
            return False
        if self._suspect.get(rep, 0.0) > time.monotonic():
            self.fallbacks += 1
            return False
        try:
            # The caller's Ctrl-C ends the wait (a hung representative would
            # hold it for up to peers.timeout): the pieces in flight are
            # cancelled, and the transport gives their slots back only once
            # nothing receives into them any more (a piece being received
            # then ends within the transport's payload deadline).
            with interruptible(f"read chunk of {what} from {rep}"):
                await self._fetch(client, rep, chunk, views)
            got = await trio.to_thread.run_sync(
                pieces_hash, _first_bytes(views, chunk.length), limiter=self.hash_limiter
            )
            if got != chunk.hash:
                raise RepresentativeError(f"the bytes from {rep} do not match the hash")
        except Interrupted:
            raise  # no fault of the representative's, and no read of the store either
        except (PeerError, OSError) as exc:
            self.fallbacks += 1
            unreachable = not isinstance(exc, RepresentativeError | RemoteError)
            if unreachable:
                # Lost, refused or silent: skip it for one timeout (then try
                # again), and dial afresh.
                self._suspect[rep] = time.monotonic() + self.timeout
                await self.dialer.forget(rep)
            log.info(
                "chunk %s of %s: representative %s failed (%s); reading it from the backing "
                "store%s",
                chunk.hash,
                what,
                rep,
                exc,
                f" (and {rep}'s other chunks for {self.timeout:g}s)" if unreachable else "",
            )
            return False
        self._suspect.pop(rep, None)
        self.chunks_fetched += 1
        self.bytes_fetched += chunk.length
        return True

    async def _fetch(
        self, client: PeerClient, rep: str, chunk: Chunk, views: list[memoryview]
    ) -> None:
        """Every piece of the chunk from ``rep``, at once, each into its slot."""
        # A connection of its own per peer: bulk transfers must not delay
        # heartbeats (membership) or peer reads of pending files.
        conn = await self.dialer.connection(client, rep)
        size = len(views[0])
        failure: list[BaseException] = []

        async def piece(index: int, offset: int, count: int) -> None:
            meta = {"hash": chunk.hash, "length": chunk.length, "offset": offset, "count": count}
            try:
                into = views[index][:count]
                response = (
                    await conn.request(CHUNK, meta, into=into, timeout=self.timeout)
                ).check()
                if len(response.payload) != count:
                    raise RepresentativeError(
                        f"{rep} sent {len(response.payload)} bytes for {count} at {offset}"
                    )
            except (PeerError, OSError) as exc:
                if not failure:
                    failure.append(exc)
                nursery.cancel_scope.cancel()

        async with trio.open_nursery() as nursery:
            for index, (offset, count) in enumerate(pieces(chunk.length, min(size, MAX_PIECE))):
                nursery.start_soon(piece, index, offset, count)
        if failure:
            raise failure[0]


def _first_bytes(views: list[memoryview], count: int) -> list[memoryview]:
    out = []
    for view in views:
        if count <= 0:
            break
        out.append(view[:count])
        count -= len(out[-1])
    return out


class Representation:
    """Both sides together, as the daemon wires them when peers are configured."""

    def __init__(self, server: ChunkServer, fetch: RepresentativeFetch) -> None:
        self.server = server
        self.fetch = fetch

    def counters(self) -> dict[str, int]:
        f, s = self.fetch, self.server
        return {
            "chunks_fetched": f.chunks_fetched,
            "bytes_fetched": f.bytes_fetched,
            "fallbacks": f.fallbacks,
            "chunks_served": s.chunks_served,
            "bytes_served": s.bytes_served,
            "serve_failures": s.failures,
        }
