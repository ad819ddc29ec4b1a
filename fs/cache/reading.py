"""Reads of a cached file: from its pages in RAM, its chunks in the store
(through frames and read-ahead), or, for a file pending on other nodes,
from its holders. A part of :class:`ckptfs.fs.cache.cache.Cache`."""

from __future__ import annotations

import errno
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from ckptfs.fs.cache.transitions import move
from ckptfs.fs.content.cachedfile import CachedFile
from ckptfs.fs.content.state import FileRole, FileState
from ckptfs.fs.interrupts import Interrupted
from ckptfs.fs.read.remoteread import WriterMovedOn
from ckptfs.fs.store.manifest import Chunk

if TYPE_CHECKING:
    pass
from ckptfs.fs.cache.errors import FileLost, HoldersFailed

log = logging.getLogger("ckptfs.cache")

# (holders, file_id, version, offset, length) -> verified bytes; OSError if none serves.
# (holders, file_id, version, offset, length, buffer to receive into or None)
# -> verified bytes; OSError if no holder serves them.
PeerFetch = Callable[
    [list[str], str, str, int, int, bytearray | None], Awaitable[bytes | memoryview]
]


def _bytes_here(f: CachedFile) -> bool:
    """Whether ``f``'s bytes may be in this node's RAM or store frames at
    all: not once it is lost, nor for a file pending on another node (its
    bytes come from its holders)."""
    return not f.lost and f.role is not FileRole.REMOTE


class Reading:
    """Reads of a cached file: from its pages in RAM, its chunks in the store (see the module)."""

    # ----- reading ------------------------------------------------------------
    async def read(
        self,
        f: CachedFile,
        off: int,
        size: int,
        *,
        view_ok: bool = False,
        into: bytearray | None = None,
    ) -> bytes | memoryview:
        """Bytes of ``f``; ``view_ok`` and ``into``: see RangeReader.read."""
        if f.lost:
            raise FileLost(f"{f.path}: bytes lost ({f.lost_reason or 'no holder'})")
        if self.gone(f):
            # Nothing that reads a file lets it go (fs/namespace/inodes.py):
            # a read here would serve released pages as zeros.
            raise OSError(errno.ESTALE, f"{f.path}: this version is gone; open the name again")
        self._touch(f)
        end = min(off + size, f.size)
        if end <= off:
            return b""
        if f.role is FileRole.REMOTE:
            # Pending elsewhere, or such a version retired here (a newer one
            # was loaded, or it was removed) while handles still read it: its
            # bytes are only on its holders, never in this node's RAM or chunks.
            return await self._read_remote(f, off, end)
        # Before this read waits for its own chunk, so the next ones overlap it.
        self.readahead.observe(f, off, end)
        return await self.reader.read(f, off, end, view_ok=view_ok, into=into)

    def read_now(self, f: CachedFile, off: int, size: int) -> list[memoryview] | bytes | None:
        """Bytes of ``f`` as views of the arena, if none needs a wait; None if
        one does (``read`` then waits for it)."""
        if not _bytes_here(f) or self.gone(f):
            return None  # (read says why)
        end = min(off + size, f.size)
        views = self.reader.read_now(f, off, end, frames_ok=True) if end > off else []
        if views is None:
            return None
        self._touch(f)
        if not views:
            return b""
        self.readahead.observe(f, off, end)
        return views

    def copy_in_ram(self, f: CachedFile, off: int, end: int) -> bytes | None:
        """A copy of bytes [off, end) of ``f`` if every one is in RAM (or a
        hole) now, else None. Not a read: no read pattern is observed."""
        if not _bytes_here(f):
            return None
        views = self.reader.read_now(f, off, min(end, f.size), frames_ok=False)
        return None if views is None else b"".join(views)

    async def read_held(
        self,
        file_id: str,
        version: str,
        off: int,
        size: int,
        *,
        into: bytearray | None = None,
        writer: str | None = None,
    ) -> bytes | memoryview | None:
        """Bytes of exactly that version if this node holds it (for a peer, or
        for a mirror read here; ``writer``: see held_version); None if not. A
        read that waits for a chunk resolves the rest of its range again
        afterwards, from whatever the file holds then: if it changed
        meanwhile (a rewrite, a fork, a mirrored page), the bytes would mix
        versions, so it is read again from the version's current holder, or
        refused."""
        for _attempt in range(3):
            f = self.held_version(file_id, version, writer)
            if f is None:
                return None
            gen = f.content_gen
            data = await self.read(f, off, size, into=into)
            if self.held_version(file_id, version, writer) is f and f.content_gen == gen:
                return data
        return None

    async def _read_remote(self, f: CachedFile, off: int, end: int) -> bytes | memoryview:
        """Bytes of a file pending on other nodes, from a holder (verified there
        and here by hash). HoldersFailed if no holder serves them."""
        assert self.peer_fetch is not None
        version = f.version
        writer = f.holders[0] if f.holders else ""
        held = self.held_version(f.file_id, version, writer)
        if held is not None and held is not f:
            data = await self.read_held(f.file_id, version, off, end - off, writer=writer)
            if data is not None:  # mirrored here, from its writer
                return data
        sequential = f.read_pattern.observe(off, end) is not None
        try:
            return await self.remote.read(
                list(f.holders), f.file_id, version, f.size, off, end, sequential=sequential
            )
        except Interrupted:
            raise  # the caller's stop signal, not a holder's failure
        except WriterMovedOn as exc:
            raise HoldersFailed(f.path, version, str(exc), moved_on=True) from None
        except OSError as exc:
            raise HoldersFailed(f.path, version, str(exc)) from None

    def declare_lost(self, f: CachedFile, failed: HoldersFailed) -> FileLost:
        """``f`` is still pending elsewhere at the version no holder served:
        LOST here, EIO with the reason, until its manifest changes or a
        holder is back (load). The error to raise."""
        if (
            f.state is FileState.PENDING
            and f.role is FileRole.REMOTE
            and f.version == failed.version
        ):
            move(f, FileState.LOST)
            f.lost_reason = f"not durable yet and no holder served it: {failed.reason}"
            self._notify(f)
            log.error("%s is lost here: %s", f.path, f.lost_reason)
        return FileLost(f"{f.path}: {failed.reason}")

    @property
    def peer_fetch(self) -> PeerFetch | None:
        return self._peer_fetch

    @peer_fetch.setter
    def peer_fetch(self, fetch: PeerFetch | None) -> None:
        self._peer_fetch = fetch
        self.remote.fetch = fetch or self._no_peers

    @staticmethod
    async def _no_peers(*args: object) -> bytes:
        raise OSError(errno.EHOSTUNREACH, "no peers to read a file pending elsewhere from")

    async def chunk_bytes(self, chunk: Chunk, start: int, count: int, what: str) -> bytes:
        """Verified bytes of a stored chunk, through a frame when there is room."""
        return await self.reader.chunk_bytes(chunk, start, count, what)
