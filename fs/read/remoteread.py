"""Pipelined reads of a file pending on other nodes (its holders' RAM).

A FUSE read asks for 128 KiB to 1 MiB at a time; one peer round trip per
request leaves the link idle most of the time. So a file pending elsewhere
is read in blocks of BLOCK bytes, each fetched whole from a holder (verified
by its hash there and here, peer/reads/reads.py), and a sequential reader has the
next AHEAD blocks in flight while it consumes the current one. Blocks are
keyed by (file id, version, index): a rewritten file is another version and
never meets the old one's blocks. They are buffers outside the arena,
bounded by MAX_BYTES together (least recently used out) and reused: on this
VM a fresh 4 MiB buffer costs more in first-touch page faults than the
transfer itself. A block whose fetch failed is forgotten, and the reader
that needs it gets the error.

A read returns a view of a block; callers hand it on before their next await
(the FUSE reply), and a buffer goes back to the pool only when its block is
dropped, never while a fetch fills it.

The caller's stop signal (fs/interrupts.py) ends a read's wait for a block,
whether it fetches the block itself or waits for another task's fetch: a
hung holder would hold it for up to ``peers.timeout``. A fetch so ended
leaves its block ABANDONED (the transport returns only once nothing receives
into the buffer any more), and whoever waited for it fetches it again.
"""

from __future__ import annotations

import enum
import errno
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import trio
from ckptfs.fs.interrupts import Interrupted, interruptible

# (holders, file_id, version, offset, length, buffer) -> verified bytes, received
# into the buffer; OSError if none serves.
Fetch = Callable[[list[str], str, str, int, int, bytearray | None], Awaitable[bytes | memoryview]]
Key = tuple[str, str, int]

BLOCK = 4 << 20
AHEAD = 4  # blocks in flight ahead of a sequential reader
MAX_BYTES = 64 << 20


class WriterMovedOn(OSError):
    """Raised by a fetch: no holder served the range, and one of them said
    that its content of the file moved past the version asked for (its
    writer is changing it in place). That version is gone for good, by its
    writer's doing: not a loss."""


class BlockState(enum.Enum):
    FETCHING = "fetching"  # a fetch fills it (or is about to)
    READY = "ready"  # data holds the verified bytes
    FAILED = "failed"  # error says why; forgotten, so the next reader fetches again
    ABANDONED = "abandoned"  # its fetch was cancelled; forgotten, its waiters fetch it


@dataclass(eq=False)
class Block:
    done: trio.Event = field(default_factory=trio.Event)  # set when no longer FETCHING
    state: BlockState = BlockState.FETCHING
    data: bytes | memoryview = b""
    error: OSError | None = None
    buffer: bytearray | None = None


class RemoteReader:
    def __init__(self, fetch: Fetch, nursery: trio.Nursery | None = None) -> None:
        self.fetch = fetch
        self.nursery = nursery  # for read-ahead fetches; without one, none are started
        self._blocks: OrderedDict[Key, Block] = OrderedDict()
        self._bytes = 0
        self._free: list[bytearray] = []  # buffers of dropped blocks, for reuse
        self.blocks_fetched = 0
        self.blocks_ahead = 0

    async def read(
        self,
        holders: list[str],
        file_id: str,
        version: str,
        size: int,
        off: int,
        end: int,
        *,
        sequential: bool,
    ) -> bytes | memoryview:
        """Bytes [off, end) of that version (``end`` clipped to ``size`` by the
        caller); within one block, a view of it (blocks are never changed).
        Across blocks, a copy; the bytes of the blocks before are copied
        before this read waits for a block, since those may be dropped and
        their buffers filled again meanwhile."""
        first, last = off // BLOCK, (end - 1) // BLOCK
        if sequential and self.nursery is not None:
            top = min(last + AHEAD, (size - 1) // BLOCK)
            for i in range(last + 1, top + 1):
                self._start(holders, file_id, version, size, i, ahead=True)
        parts: list[bytes | memoryview] = []
        for i in range(first, last + 1):
            key = (file_id, version, i)
            block = self._blocks.get(key)
            if block is not None and block.done.is_set():  # READY (others leave the table)
                self._blocks.move_to_end(key)
            else:
                if parts:
                    # While this block is awaited, the ones before may be
                    # dropped and their buffers filled again for another.
                    parts = [b"".join(parts)]
                block = await self._settled(holders, file_id, version, size, i)
            if block.state is BlockState.FAILED:
                assert block.error is not None
                raise block.error
            lo = max(off, i * BLOCK) - i * BLOCK
            hi = min(end, (i + 1) * BLOCK) - i * BLOCK
            parts.append(memoryview(block.data)[lo:hi])
        return parts[0] if len(parts) == 1 else b"".join(parts)

    async def _settled(
        self, holders: list[str], file_id: str, version: str, size: int, i: int
    ) -> Block:
        """Block ``i``, READY or FAILED: fetched here if nobody fetches it,
        else waited for (and fetched here if that fetch was abandoned)."""
        key = (file_id, version, i)
        while True:
            block = self._blocks.get(key)
            with interruptible(f"read of file {file_id} from the nodes holding it"):
                if block is None:
                    block = self._start(holders, file_id, version, size, i, ahead=False)
                    await self._fill(block, holders, file_id, version, size, i)
                else:
                    self._blocks.move_to_end(key)
                    await block.done.wait()
            if block.state is not BlockState.ABANDONED:
                return block

    def _start(
        self, holders: list[str], file_id: str, version: str, size: int, i: int, *, ahead: bool
    ) -> Block:
        key = (file_id, version, i)
        block = self._blocks.get(key)
        if block is not None:
            return block
        block = Block()
        if ahead:
            assert self.nursery is not None
            # Before the block is in the table: a closed nursery raises here,
            # and a block nobody fills would hold its readers for ever.
            self.nursery.start_soon(self._fill, block, holders, file_id, version, size, i)
            self.blocks_ahead += 1
        self._blocks[key] = block
        return block

    async def _fill(
        self, block: Block, holders: list[str], file_id: str, version: str, size: int, i: int
    ) -> None:
        if block.done.is_set():
            return
        start = i * BLOCK
        try:
            block.buffer = self._free.pop() if self._free else bytearray(BLOCK)
            block.data = await self.fetch(
                list(holders), file_id, version, start, min(BLOCK, size - start), block.buffer
            )
        except (trio.Cancelled, Interrupted):
            # Its reader's caller was interrupted, or the mount ends. The fetch
            # has returned, so nothing writes into the buffer; the block goes,
            # and whoever waited for it fetches it again.
            self._end_unfilled(block, BlockState.ABANDONED, file_id, version, i)
            raise
        except OSError as exc:
            block.error = exc
            self._end_unfilled(block, BlockState.FAILED, file_id, version, i)
        except Exception as exc:  # a bug: its readers get EIO, not a retry each
            block.error = OSError(errno.EIO, f"fetch of {file_id} failed: {exc!r}")
            self._end_unfilled(block, BlockState.FAILED, file_id, version, i)
            raise
        else:
            block.state = BlockState.READY
            self.blocks_fetched += 1
            if self._blocks.get((file_id, version, i)) is block:  # not forgotten meanwhile
                self._bytes += len(block.data)
                self._trim()
        finally:
            block.done.set()

    def _end_unfilled(
        self, block: Block, state: BlockState, file_id: str, version: str, i: int
    ) -> None:
        """A fetch that brought no bytes: the block leaves the table (the next
        reader fetches again) and its buffer, which nothing writes into any
        more, goes back to the pool."""
        block.state = state
        if self._blocks.get((file_id, version, i)) is block:
            del self._blocks[(file_id, version, i)]
        if block.buffer is not None and len(self._free) < MAX_BYTES // BLOCK:
            self._free.append(block.buffer)
        block.buffer = None

    def _trim(self) -> None:
        while self._bytes > MAX_BYTES and self._blocks:
            key, block = next(iter(self._blocks.items()))
            if not block.done.is_set():
                self._blocks.move_to_end(key)  # in flight: not ours to drop
                if all(not b.done.is_set() for b in self._blocks.values()):
                    return
                continue
            del self._blocks[key]
            self._drop(block)

    def _drop(self, block: Block) -> None:
        self._bytes -= len(block.data)
        if block.buffer is not None and len(self._free) < MAX_BYTES // BLOCK:
            self._free.append(block.buffer)  # done: no fetch writes into it any more
        block.buffer = None

    def forget(self, file_id: str) -> None:
        """Drop the blocks of every version of ``file_id`` (it became durable or went away)."""
        for key in [k for k in self._blocks if k[0] == file_id]:
            block = self._blocks.pop(key)
            if block.done.is_set():
                self._drop(block)  # an unfinished one is left to its fetch, then freed

    def stats(self) -> dict[str, int]:
        return {
            "blocks_fetched": self.blocks_fetched,
            "blocks_ahead": self.blocks_ahead,
            "block_bytes": self._bytes,
        }
