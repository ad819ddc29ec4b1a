"""Content-addressed chunks under ``<backing>/.ckptfs/chunks/``.

All methods block (they touch the backing store); callers run them in worker
threads. Chunks are immutable, so two writers racing on the same hash are
harmless: both rename identical bytes into place. Every read is verified
against the chunk's name; a mismatch raises :class:`ChunkCorrupt`.
"""

from __future__ import annotations

import errno
import os
import secrets
from collections.abc import Sequence
from pathlib import Path

import xxhash

CKPTFS_DIR = ".ckptfs"
Buffer = bytes | bytearray | memoryview
STREAM_PIECE = 1 << 20  # bounce buffer of a streamed (verified range) read
# O_DIRECT reads need file offsets, lengths and buffers aligned to the device's
# block size; a page is a multiple of every block size in use.
DIRECT_ALIGN = 4096


class ChunkCorrupt(OSError):
    """A chunk is missing, short, or its bytes do not match its hash."""


def chunk_hash(data: Buffer) -> str:
    """The xxh3-128 hex digest that names a chunk (releases the GIL above 64 KiB)."""
    return xxhash.xxh3_128_hexdigest(data)


def pieces_hash(pieces: Sequence[Buffer]) -> str:
    """The chunk hash of the concatenation of ``pieces``, without concatenating."""
    if len(pieces) == 1:
        return chunk_hash(pieces[0])
    h = xxhash.xxh3_128()
    for piece in pieces:
        h.update(piece)
    return h.hexdigest()


class ChunkStore:
    def __init__(self, backing: Path) -> None:
        self.backing = Path(backing)
        self.root = self.backing / CKPTFS_DIR / "chunks"
        # Cleared the first time the filesystem refuses O_DIRECT (EINVAL).
        self.direct_ok = True

    def path_for(self, digest: str) -> Path:
        return self.root / digest[:2] / digest[2:4] / digest

    def exists(self, digest: str) -> bool:
        return self.path_for(digest).exists()

    def touch(self, digest: str) -> bool:
        """Mark an existing chunk as reused now; False if there is none.

        ``ckptfs gc`` only removes chunks whose mtime is older than its grace
        period and re-checks the mtime just before removing, so a writer that
        dedups against an old unreferenced chunk keeps it alive this way.
        """
        try:
            os.utime(self.path_for(digest))
        except FileNotFoundError:
            return False
        return True

    def put(self, digest: str, data: Buffer | Sequence[Buffer]) -> int:
        """Store ``data`` (one buffer or pieces) under ``digest`` unless present.

        Returns the bytes written (0 if the chunk was there already). Pieces
        are written with writev straight from where they are (arena slots).
        """
        pieces: Sequence[Buffer] = (
            [data] if isinstance(data, bytes | bytearray | memoryview) else data
        )
        if self.touch(digest):
            return 0
        final = self.path_for(digest)
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.with_name(f"{digest}.tmp.{secrets.token_hex(4)}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o444)
        total = 0
        try:
            views = [memoryview(p).cast("B") for p in pieces if len(p)]
            while views:
                n = os.writev(fd, views[:1024])
                total += n
                while views and n >= len(views[0]):
                    n -= len(views[0])
                    views.pop(0)
                if views and n:
                    views[0] = views[0][n:]
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            tmp.unlink(missing_ok=True)
            raise
        os.close(fd)
        os.rename(tmp, final)
        # The directory entry must be durable too before a manifest names it.
        dfd = os.open(final.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
        return total

    def _label(self, digest: str, what: str) -> str:
        return f"chunk {digest}" + (f" of {what}" if what else "")

    def _open(self, digest: str, what: str, flags: int = 0) -> int:
        try:
            return os.open(self.path_for(digest), os.O_RDONLY | os.O_CLOEXEC | flags)
        except FileNotFoundError:
            raise ChunkCorrupt(
                f"{self._label(digest, what)} is missing from {self.path_for(digest)}"
            ) from None

    def _check_end(
        self,
        fd: int,
        pos: int,
        h: xxhash.xxh3_128,
        digest: str,
        length: int,
        what: str,
        *,
        probe: bool = True,
    ) -> None:
        """After reading ``length`` bytes: nothing more in the file (``probe``
        reads one more byte to see), and the hash matches."""
        if probe and os.pread(fd, 1, pos):
            raise ChunkCorrupt(
                f"{self._label(digest, what)} is longer than the expected {length} bytes"
            )
        if h.hexdigest() != digest:
            raise ChunkCorrupt(
                f"{self._label(digest, what)} does not match its hash "
                f"(corrupted in {self.path_for(digest)})"
            )

    def get(self, digest: str, length: int, *, what: str = "") -> bytes:
        """Read a chunk and verify it; raise ChunkCorrupt naming ``what``."""
        buf = bytearray(length)
        self.read_into(digest, length, [memoryview(buf)], what=what)
        return bytes(buf)

    def read_into(
        self,
        digest: str,
        length: int,
        targets: Sequence[memoryview],
        *,
        what: str = "",
        direct: bool = False,
    ) -> None:
        """Read a chunk straight into ``targets`` (consecutive pieces), verified.

        The targets hold the chunk's bytes in order from the start of the
        first; together they are at least ``length`` long (bytes past it are
        unspecified). On any error their contents are unspecified and must not
        be used.

        ``direct`` (the caller's promise: the targets start page-aligned and
        have room for ``length`` rounded up to DIRECT_ALIGN) reads with
        O_DIRECT, from the disk into the targets without a second copy in the
        kernel's page cache: that copy costs about 0.4 s of CPU per GiB here,
        and the pages it fills are memory the caller holds already. Where the
        filesystem refuses O_DIRECT, the read is buffered.
        """
        if direct and self.direct_ok:
            try:
                self._read_into(digest, length, targets, what, os.O_DIRECT)
                return
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                self.direct_ok = False  # not on this filesystem: buffered from now on
        self._read_into(digest, length, targets, what, 0)

    def _read_into(
        self, digest: str, length: int, targets: Sequence[memoryview], what: str, flags: int
    ) -> None:
        want = -(-length // DIRECT_ALIGN) * DIRECT_ALIGN if flags else length
        views = _first_bytes(targets, want)
        fd = self._open(digest, what, flags)
        try:
            # One request for the whole chunk, not one per target: the device
            # sees large reads, and a short read only happens at the end.
            pos = 0
            while views:
                n = os.preadv(fd, views, pos)
                if n == 0:
                    break
                pos += n
                views = _skip(views, n)
            if pos < length:
                raise ChunkCorrupt(
                    f"{self._label(digest, what)} has {pos} bytes, expected {length}"
                )
            h = xxhash.xxh3_128()
            for view in _first_bytes(targets, length):
                h.update(view)
            if pos > length or (flags and os.fstat(fd).st_size != length):
                raise ChunkCorrupt(
                    f"{self._label(digest, what)} is longer than the expected {length} bytes"
                )
            self._check_end(fd, pos, h, digest, length, what, probe=not flags)
        finally:
            os.close(fd)

    def read_range(
        self, digest: str, length: int, start: int, count: int, *, what: str = ""
    ) -> bytes:
        """Bytes [start, start+count) of a chunk, after verifying the whole chunk.

        Streams the chunk through a small buffer, keeping only the range asked
        for: memory stays bounded whatever the chunk size (for readers that
        found no room in the cache).
        """
        out = bytearray(count)
        bounce = bytearray(min(STREAM_PIECE, max(1, length)))
        fd = self._open(digest, what)
        try:
            h = xxhash.xxh3_128()
            pos = 0
            while pos < length:
                view = memoryview(bounce)[: min(len(bounce), length - pos)]
                n = os.preadv(fd, [view], pos)
                if n == 0:
                    raise ChunkCorrupt(
                        f"{self._label(digest, what)} has {pos} bytes, expected {length}"
                    )
                piece = view[:n]
                h.update(piece)
                lo, hi = max(pos, start), min(pos + n, start + count)
                if lo < hi:
                    out[lo - start : hi - start] = piece[lo - pos : hi - pos]
                pos += n
            self._check_end(fd, pos, h, digest, length, what)
        finally:
            os.close(fd)
        return bytes(out)


def _first_bytes(targets: Sequence[memoryview], count: int) -> list[memoryview]:
    """The targets cut to their first ``count`` bytes together."""
    views = []
    for target in targets:
        if count <= 0:
            break
        view = memoryview(target).cast("B")
        views.append(view[:count])
        count -= len(views[-1])
    return views


def _skip(views: list[memoryview], n: int) -> list[memoryview]:
    """``views`` without their first ``n`` bytes."""
    while views and n >= len(views[0]):
        n -= len(views[0])
        views = views[1:]
    if views and n:
        views = [views[0][n:], *views[1:]]
    return views
