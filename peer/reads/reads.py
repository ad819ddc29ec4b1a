"""Peer reads: bytes of a file that only its holders have (pending elsewhere).

A file closed on node A is published as a pending manifest naming A (and,
with mirroring, its buddy) as holders before any chunk is in the backing
store. Node B that opens it asks a holder for each range it reads. The
holder serves a range only of exactly the version asked for (a newer or
older version there is refused, never substituted) and sends the range's
hash; the reader checks the bytes against it, so a corrupted transfer is an
error, never wrong bytes. Holders are tried in turn; when none answers, the
read fails with a reason naming them.

A read names the version's writer (the first holder its manifest names): a
holder serves a buddy's mirror only if that writer sent it, so one node
cannot have another's reader take its bytes for a third node's file. A
holder serves only the nodes of its cluster (the transport's identity
check); they are trusted to apply users' permissions to what they read, as
NFS clients are (docs/SECURITY.md). Reply buffers count against the peer's
buffer budget (limits.PeerBudget).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from typing import Any

import trio
import xxhash
from ckptfs.fs.read.remoteread import WriterMovedOn
from ckptfs.peer.transport.dialer import Dialer
from ckptfs.peer.transport.transport import PeerClient, Request, Response
from ckptfs.peer.transport.wire import PeerError

log = logging.getLogger("ckptfs.peer.reads")

READ = "read"  # the request type
MOVED_ON = "moved_on"  # in a refusal's meta: the holder's content moved past that version
MAX_READ = 8 << 20  # bytes per request: bounded by the transport's payload limit

# (file_id, version, offset, length, buffer to copy into or None, writer)
# -> the bytes, or None if not held here (a mirror: only one the writer sent).
LocalRead = Callable[
    [str, str, int, int, bytearray | None, str], Awaitable[bytes | memoryview | None]
]
# file_id -> whether this node's content of that file is being changed (see
# Cache.changing): a version it refused it will never serve again.
Changing = Callable[[str], bool]
# Reply buffers kept for reuse: a fresh multi-MiB buffer per range costs more
# in first-touch page faults (on this VM) than copying the range into it.
POOL_BYTES = 32 << 20


class PeerReadError(OSError):
    """No holder could serve the range."""


class HolderMovedOn(PeerReadError, WriterMovedOn):
    """No holder served the range, and one of them answered that its content
    of the file has moved past that version (its writer is changing it):
    the version is gone for good, which is not a loss."""


def range_hash(data: bytes | memoryview) -> str:
    return xxhash.xxh3_128_hexdigest(data)


class ReadServer:
    """Answers ``read`` requests from the local cache."""

    def __init__(self, local_read: LocalRead, changing: Changing | None = None) -> None:
        self.local_read = local_read
        self.changing = changing or (lambda _file_id: False)
        self.ranges_served = 0
        self.bytes_served = 0
        self._pool: dict[int, list[bytearray]] = {}  # free reply buffers by size
        self._pooled = 0

    def _take(self, length: int) -> bytearray:
        free = self._pool.get(length)
        if free:
            self._pooled -= length
            return free.pop()
        return bytearray(length)

    def _give_back(self, buffer: bytearray) -> None:
        if self._pooled + len(buffer) <= POOL_BYTES:
            self._pool.setdefault(len(buffer), []).append(buffer)
            self._pooled += len(buffer)

    async def handle(self, peer: str, request: Request) -> Response:
        meta = request.meta
        try:
            file_id, version = str(meta["file_id"]), str(meta["version"])
            offset, length = int(meta["offset"]), int(meta["length"])
            writer = meta["writer"]
        except (KeyError, TypeError, ValueError):
            return Response.fail("malformed read request")
        if not isinstance(writer, str) or not writer:
            return Response.fail("malformed read request: no writer")
        if offset < 0 or not 0 <= length <= MAX_READ:
            return Response.fail(f"read of {length} bytes at {offset} is out of bounds")
        budget = request.budget
        if budget is not None:
            await budget.acquire(length)
        buffer = self._take(length)

        def done() -> None:
            self._give_back(buffer)
            if budget is not None:
                budget.release(length)

        try:
            data = await self.local_read(file_id, version, offset, length, buffer, writer)
        except OSError as exc:
            done()
            return Response.fail(f"cannot read {file_id}@{version}: {exc}")
        except BaseException:
            done()
            raise
        if data is None:
            done()
            if self.changing(file_id):
                return Response.fail(
                    f"{file_id}@{version} is not held here: its writer here is changing it",
                    meta={MOVED_ON: True},
                )
            return Response.fail(f"{file_id}@{version} is not held here")
        self.ranges_served += 1
        self.bytes_served += len(data)
        return Response(
            meta={"hash": range_hash(data), "length": len(data)},
            payload=data,
            release=done,  # once the reply is sent
        )


class _Refused(PeerError):
    """A holder's error answer to a read (``moved_on``: see MOVED_ON)."""

    def __init__(self, error: str, *, moved_on: bool) -> None:
        super().__init__(error)
        self.moved_on = moved_on


class PeerFetcher:
    """Fetches verified ranges from holders over connections of its own (bulk
    transfers must not delay heartbeats)."""

    def __init__(
        self,
        client: PeerClient,
        addresses: dict[str, tuple[str, int]],
        *,
        timeout: float,
        is_alive: Callable[[str], bool],
    ) -> None:
        self.client = client
        self.addresses = addresses
        self.timeout = timeout
        self.is_alive = is_alive
        self.dialer = Dialer(addresses, timeout=timeout)
        self.ranges_fetched = 0
        self.bytes_fetched = 0
        self.failures = 0

    async def fetch(
        self,
        holders: Sequence[str],
        file_id: str,
        version: str,
        offset: int,
        length: int,
        into: bytearray | None = None,
        *,
        writer: str | None = None,
    ) -> bytes | memoryview:
        """Bytes [offset, offset+length) of that version, from the first holder
        that has them; raises PeerReadError naming every holder tried. A
        range of one request comes back as the received buffer, not a copy:
        ``into`` (at least ``length`` long) if given, so a caller can reuse
        memory it has touched already (fresh pages cost more than the copy).
        ``writer``: the version's writer (default: the first of ``holders``)."""
        if writer is None:
            writer = holders[0] if holders else ""
        piece = partial(self._fetch_piece, holders, file_id, version, writer=writer)
        if into is not None and length <= MAX_READ:
            return await piece(offset, length, into)
        parts: list[memoryview] = []
        got = 0
        while got < length:
            n = min(MAX_READ, length - got)
            part = await piece(offset + got, n)
            if not part:
                break  # past the end of the file there
            parts.append(part)
            got += len(part)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    async def _fetch_piece(
        self,
        holders: Sequence[str],
        file_id: str,
        version: str,
        offset: int,
        length: int,
        into: bytearray | None = None,
        *,
        writer: str,
    ) -> memoryview:
        tried: list[str] = []
        moved_on = False
        # Live holders first; a holder thought dead is still worth one try.
        for name in sorted(holders, key=lambda h: not self.is_alive(h)):
            if name not in self.addresses:
                continue
            try:
                return await self._from(name, file_id, version, offset, length, into, writer)
            except _Refused as exc:
                moved_on = moved_on or exc.moved_on
                self.failures += 1
                tried.append(f"{name}: {exc}")  # an answer: the connection is fine
            except (PeerError, OSError, trio.TooSlowError) as exc:
                self.failures += 1
                tried.append(f"{name}: {exc}")
                await self.dialer.forget(name)
        reason = "; ".join(tried) or f"no reachable holder among {', '.join(holders) or 'none'}"
        failure = HolderMovedOn if moved_on else PeerReadError
        raise failure(f"no holder served {file_id}@{version} at {offset}: {reason}")

    async def _from(
        self,
        name: str,
        file_id: str,
        version: str,
        offset: int,
        length: int,
        into: bytearray | None,
        writer: str,
    ) -> memoryview:
        conn = await self.dialer.connection(self.client, name)
        meta: dict[str, Any] = {
            "file_id": file_id,
            "version": version,
            "offset": offset,
            "length": length,
            "writer": writer,
        }
        response = await conn.request(READ, meta, into=into, timeout=self.timeout)
        if response.error is not None:
            raise _Refused(response.error, moved_on=response.meta.get(MOVED_ON) is True)
        data = response.payload  # a buffer of its own, received once: no copy
        if len(data) != response.meta.get("length") or range_hash(data) != response.meta.get(
            "hash"
        ):
            raise PeerReadError(f"range from {name} does not match its hash")
        if len(data) > length:
            raise PeerReadError(f"{name} sent {len(data)} bytes for a {length}-byte range")
        self.ranges_fetched += 1
        self.bytes_fetched += len(data)
        return data

    def stats(self) -> dict[str, int]:
        return {
            "ranges_fetched": self.ranges_fetched,
            "bytes_fetched": self.bytes_fetched,
            "failures": self.failures,
        }
