"""Content-addressed chunks under ``<backing>/.ckptfs/chunks/``.

All methods block (they touch the backing store); callers run them in worker
threads. Chunks are immutable, so two writers racing on the same hash are
harmless: both rename identical bytes into place.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

import xxhash

CKPTFS_DIR = ".ckptfs"


class ChunkCorrupt(OSError):
    """A chunk is missing, short, or its bytes do not match its hash."""


def chunk_hash(data: bytes | memoryview) -> str:
    """The xxh3-128 hex digest that names a chunk (releases the GIL above 64 KiB)."""
    return xxhash.xxh3_128_hexdigest(data)


class ChunkStore:
    def __init__(self, backing: Path) -> None:
        self.backing = Path(backing)
        self.root = self.backing / CKPTFS_DIR / "chunks"

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

    def put(self, digest: str, data: bytes | memoryview) -> int:
        """Store ``data`` under ``digest`` unless present; return bytes written."""
        final = self.path_for(digest)
        if self.touch(digest):
            return 0
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.with_name(f"{digest}.tmp.{secrets.token_hex(4)}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o444)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            tmp.unlink(missing_ok=True)
            raise
        os.close(fd)
        os.rename(tmp, final)
        # The directory entry must be durable too before a manifest names it.
        dfd = os.open(final.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
        return len(data)

    def get(self, digest: str, length: int, *, what: str = "") -> bytes:
        """Read a chunk and verify it; raise ChunkCorrupt naming ``what``."""
        path = self.path_for(digest)
        label = f"chunk {digest}" + (f" of {what}" if what else "")
        try:
            with open(path, "rb") as f:
                data = f.read(length + 1)
        except FileNotFoundError:
            raise ChunkCorrupt(f"{label} is missing from {path}") from None
        if len(data) != length:
            raise ChunkCorrupt(f"{label} has {len(data)} bytes, expected {length}")
        if chunk_hash(data) != digest:
            raise ChunkCorrupt(f"{label} does not match its hash (corrupted in {path})")
        return data
