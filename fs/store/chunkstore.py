"""Content-addressed chunks under ``<backing>/.ckptfs/chunks/``.

All methods block (they touch the backing store); callers run them in worker
threads. Chunks are immutable, so two writers racing on the same hash are
harmless: both rename identical bytes into place. Every read is verified
against the chunk's name; a mismatch raises :class:`ChunkCorrupt`.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import secrets
import threading
from collections.abc import Sequence
from pathlib import Path

import xxhash
from ckptfs.fs.store.beneath import open_beneath, private_dir, via_fd
from ckptfs.fs.store.storedirs import CHUNKS, CKPTFS_DIR, StoreDirs

Buffer = bytes | bytearray | memoryview
STREAM_PIECE = 1 << 20  # bounce buffer of a streamed (verified range) read
# O_DIRECT reads and writes need file offsets, lengths and buffers aligned to
# the device's block size; a page is a multiple of every block size in use.
DIRECT_ALIGN = 4096
# An O_DIRECT chunk write gathers pieces that are not page-aligned (most
# chunks of a torch.save archive start mid-page) into a bounce buffer of this
# size, reused: fresh memory is slow to fault in on a VM.
BOUNCE_SIZE = 4 << 20
MAX_IDLE_BOUNCES = 8  # bounce buffers kept for reuse (one per concurrent put)
IOV_MAX = 1024


class ChunkCorrupt(OSError):
    """A chunk is missing, short, or its bytes do not match its hash."""


DIGEST_LEN = 32  # xxh3-128 in hex
_HEX = frozenset("0123456789abcdef")


def is_digest(value: object) -> bool:
    """Whether ``value`` is a chunk name: 32 lowercase hex digits. A digest
    comes from a manifest, which users can write: anything else must never
    become part of a path."""
    return isinstance(value, str) and len(value) == DIGEST_LEN and _HEX.issuperset(value)


def check_digest(digest: str) -> str:
    if not is_digest(digest):
        raise ChunkCorrupt(errno.EINVAL, f"not a chunk name: {digest!r}")
    return digest


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


class Bounce:
    """A page-aligned anonymous mapping, faulted in once and then reused."""

    def __init__(self, size: int) -> None:
        self.size = size
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
        self._map = mmap.mmap(-1, size, flags=flags)
        self.view = memoryview(self._map)
        self.address = _address(self.view)

    def fill_from(self, at: int, source: memoryview) -> int:
        """Copy as much of ``source`` as fits from offset ``at``; return how much."""
        n = min(len(source), self.size - at)
        src = _address(source)
        if src is not None and self.address is not None:
            ctypes.memmove(self.address + at, src, n)  # without the GIL
        else:
            self.view[at : at + n] = source[:n]
        return n

    def close(self) -> None:
        try:
            self.view.release()
            self._map.close()
        except BufferError:
            pass  # a slice is still referenced (a traceback): unmapped when collected


class ChunkStore:
    """``backing``'s chunk store, used through the descriptor of its
    verified ``.ckptfs/chunks`` (storedirs.py): ``dirs`` shares one with the
    rest of a mount; without it the store opens its own (offline tools)."""

    def __init__(
        self, backing: Path, dirs: StoreDirs | None = None, *, create: bool = True
    ) -> None:
        self.backing = Path(backing)
        self.dirs = dirs or StoreDirs(self.backing, create=create)
        self.root = self.backing / CKPTFS_DIR / CHUNKS
        # Cleared the first time the filesystem refuses O_DIRECT (EINVAL), for
        # reads and for writes apart.
        self.direct_ok = True
        self.direct_write_ok = True
        self._put_lock = threading.Lock()
        self._storing: dict[str, threading.Event] = {}  # digests being put
        self._bounces: list[Bounce] = []  # idle bounce buffers

    def path_for(self, digest: str) -> Path:
        """Where the chunk is, for messages and offline tools (the store's own
        calls go through :meth:`_rel` beneath the chunks directory's fd)."""
        return self.root / self._rel(digest)

    @staticmethod
    def _rel(digest: str) -> str:
        check_digest(digest)
        return f"{digest[:2]}/{digest[2:4]}/{digest}"

    @property
    def fd(self) -> int:
        return self.dirs.private(CHUNKS)

    def _fanout(self, digest: str) -> int:
        """The fd of the chunk's directory, made if missing: private like
        every directory of the store's."""
        top = private_dir(self.fd, digest[:2], label=str(self.root / digest[:2]))
        try:
            return private_dir(top, digest[2:4], label=str(self.root / digest[:2] / digest[2:4]))
        finally:
            os.close(top)

    def size_of(self, digest: str) -> int:
        """The size of the chunk's file (FileNotFoundError if there is none)."""
        fd = open_beneath(self.fd, self._rel(digest), os.O_PATH | os.O_NOFOLLOW)
        try:
            return os.fstat(fd).st_size
        finally:
            os.close(fd)

    def exists(self, digest: str) -> bool:
        try:
            os.close(open_beneath(self.fd, self._rel(digest), os.O_PATH | os.O_NOFOLLOW))
        except FileNotFoundError:
            return False
        return True

    def touch(self, digest: str) -> bool:
        """Mark an existing chunk as reused now; False if there is none.

        ``ckptfs gc`` only removes chunks whose mtime is older than its grace
        period and re-checks the mtime just before removing, so a writer that
        dedups against an old unreferenced chunk keeps it alive this way.
        """
        try:
            fd = open_beneath(self.fd, self._rel(digest), os.O_PATH | os.O_NOFOLLOW)
        except FileNotFoundError:
            return False
        try:
            os.utime(via_fd(fd))
        finally:
            os.close(fd)
        return True

    def put(self, digest: str, data: Buffer | Sequence[Buffer]) -> int:
        """Store ``data`` (one buffer or pieces) under ``digest`` unless present.

        Returns the bytes written (0 if the chunk was there already). One
        store per digest at a time in this process: a second put of a digest
        being stored waits for the first, then finds the chunk (two files with
        the same bytes flushed together, or a chunk repeated inside a file,
        are written once). If the first fails, the second stores it.

        The bytes go with O_DIRECT, from the disk's point of view straight
        from where they are (arena slots), not copied into the page cache:
        that copy was three quarters of the flusher's CPU. Where the filesystem
        refuses O_DIRECT, writes are buffered from then on.
        """
        pieces: Sequence[Buffer] = (
            [data] if isinstance(data, bytes | bytearray | memoryview) else data
        )
        while True:
            with self._put_lock:
                busy = self._storing.get(digest)
                if busy is None:
                    done = self._storing[digest] = threading.Event()
                    break
            busy.wait()
        try:
            if self.touch(digest):
                return 0
            return self._store(digest, pieces)
        finally:
            with self._put_lock:
                del self._storing[digest]
            done.set()

    def _store(self, digest: str, pieces: Sequence[Buffer]) -> int:
        """Write a new chunk: temporary name, fsync, rename, directory fsync."""
        dfd = self._fanout(check_digest(digest))
        try:
            return self._store_in(dfd, digest, pieces)
        finally:
            os.close(dfd)

    def _store_in(self, dfd: int, digest: str, pieces: Sequence[Buffer]) -> int:
        tmp = f"{digest}.tmp.{secrets.token_hex(4)}"
        views = [memoryview(p).cast("B") for p in pieces if len(p)]
        total = sum(len(v) for v in views)
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
        while True:
            direct = self.direct_write_ok
            try:
                fd = os.open(tmp, flags | (os.O_DIRECT if direct else 0), 0o444, dir_fd=dfd)
            except OSError as exc:
                if direct and exc.errno == errno.EINVAL:
                    self.direct_write_ok = False  # not on this filesystem
                    continue
                raise
            try:
                try:
                    if direct:
                        self._write_direct(fd, views, total)
                    else:
                        _write_all(fd, views)
                    os.fsync(fd)
                finally:
                    os.close(fd)
                os.rename(tmp, digest, src_dir_fd=dfd, dst_dir_fd=dfd)
            except BaseException as exc:
                try:
                    os.unlink(tmp, dir_fd=dfd)
                except FileNotFoundError:
                    pass
                if direct and isinstance(exc, OSError) and exc.errno == errno.EINVAL:
                    # The filesystem opened it but refuses the writes: buffered
                    # from now on (the file starts again from nothing).
                    self.direct_write_ok = False
                    continue
                raise
            break
        # The directory entry must be durable too before a manifest names it.
        os.fsync(dfd)
        return total

    def _write_direct(self, fd: int, views: list[memoryview], total: int) -> None:
        """Write ``views`` in order to ``fd`` (opened with O_DIRECT) from offset 0.

        O_DIRECT wants page-aligned memory, file offsets and lengths. A run of
        pieces that start on a page and are whole pages long (arena slots of a
        chunk that starts on a page) goes straight from memory in one pwritev;
        everything else is gathered into a reused, page-aligned bounce buffer
        and written from there. The last block is padded with zeros and the
        file truncated back to ``total``.
        """
        bounce: Bounce | None = None
        fill = 0  # bytes gathered in the bounce buffer
        pos = 0  # file offset written so far: always a multiple of DIRECT_ALIGN
        batch: list[memoryview] = []  # aligned pieces not written yet
        try:
            for view in views:
                while view:
                    if not fill and len(view) >= DIRECT_ALIGN and _page_aligned(view):
                        n = len(view) - len(view) % DIRECT_ALIGN
                        batch.append(view[:n])
                        view = view[n:]
                        if len(batch) >= IOV_MAX:
                            pos = _pwrite_all(fd, batch, pos)
                            batch = []
                        continue
                    if batch:
                        pos = _pwrite_all(fd, batch, pos)
                        batch = []
                    if bounce is None:
                        bounce = self._take_bounce()
                    n = bounce.fill_from(fill, view)
                    fill += n
                    view = view[n:]
                    if fill == bounce.size:
                        pos = _pwrite_all(fd, [bounce.view], pos)
                        fill = 0
            if batch:
                pos = _pwrite_all(fd, batch, pos)
            if fill:
                padded = -(-fill // DIRECT_ALIGN) * DIRECT_ALIGN
                assert bounce is not None
                bounce.view[fill:padded] = bytes(padded - fill)
                pos = _pwrite_all(fd, [bounce.view[:padded]], pos)
        finally:
            if bounce is not None:
                self._give_bounce(bounce)
        if pos != total:
            os.ftruncate(fd, total)

    def _take_bounce(self) -> Bounce:
        with self._put_lock:
            if self._bounces:
                return self._bounces.pop()
        return Bounce(BOUNCE_SIZE)

    def _give_bounce(self, bounce: Bounce) -> None:
        with self._put_lock:
            if len(self._bounces) < MAX_IDLE_BOUNCES:
                self._bounces.append(bounce)
                return
        bounce.close()

    def _label(self, digest: str, what: str) -> str:
        return f"chunk {digest}" + (f" of {what}" if what else "")

    def _open(self, digest: str, what: str, flags: int = 0) -> int:
        try:
            return open_beneath(self.fd, self._rel(digest), os.O_RDONLY | os.O_NOFOLLOW | flags)
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


def _address(view: memoryview) -> int | None:
    """The memory address of a writable buffer (None if read-only: bytes)."""
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(view))
    except (TypeError, ValueError):
        return None


def _page_aligned(view: memoryview) -> bool:
    address = _address(view)
    return address is not None and address % DIRECT_ALIGN == 0


def _pwrite_all(fd: int, views: list[memoryview], pos: int) -> int:
    """Write all of ``views`` at ``pos``; return the offset after them."""
    while views:
        n = os.pwritev(fd, views, pos)
        if n <= 0:
            raise OSError(errno.EIO, "short write of a chunk")
        pos += n
        views = _skip(views, n)
    return pos


def _write_all(fd: int, views: list[memoryview]) -> None:
    """Buffered: write all of ``views`` at the file position, IOV_MAX at a time."""
    while views:
        n = os.writev(fd, views[:IOV_MAX])
        if n <= 0:
            raise OSError(errno.EIO, "short write of a chunk")
        views = _skip(views, n)
