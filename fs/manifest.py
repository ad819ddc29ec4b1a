"""The per-file manifest that ckptfs stores at the file's own path.

Format (see docs/FORMAT.md): the magic line ``CKPTFS-MANIFEST 1`` followed by
one JSON object. Anything that does not start with the magic line is a plain
file and is served read-through.
"""

from __future__ import annotations

import json
import os
import secrets
from dataclasses import asdict, dataclass, field
from pathlib import Path

MAGIC = b"CKPTFS-MANIFEST 1\n"
HASH_NAME = "xxh3-128"
STATES = ("pending", "durable")
# A manifest is small; anything larger at a path is a plain file that merely
# happens to start with the magic bytes, and reading it whole would be wasteful.
MAX_MANIFEST_BYTES = 64 << 20


class ManifestError(ValueError):
    pass


@dataclass
class Chunk:
    offset: int
    length: int
    hash: str


@dataclass
class Manifest:
    file_id: str
    version: str
    size: int
    mode: int
    mtime_ns: int
    state: str = "pending"
    holders: list[str] = field(default_factory=list)
    chunks: list[Chunk] = field(default_factory=list)
    chunking: str = "fixed"

    def to_bytes(self) -> bytes:
        body = asdict(self)
        body["hash"] = HASH_NAME
        body["chunks"] = [[c.offset, c.length, c.hash] for c in self.chunks]
        return MAGIC + json.dumps(body, separators=(",", ":")).encode() + b"\n"

    @classmethod
    def from_bytes(cls, data: bytes, where: str = "manifest") -> Manifest:
        if not data.startswith(MAGIC):
            raise ManifestError(f"{where}: missing magic line")
        try:
            body = json.loads(data[len(MAGIC) :])
            if body.get("hash", HASH_NAME) != HASH_NAME:
                raise ManifestError(f"{where}: unsupported hash {body['hash']!r}")
            chunks = [Chunk(int(o), int(n), str(h)) for o, n, h in body.get("chunks", [])]
            manifest = cls(
                file_id=str(body["file_id"]),
                version=str(body["version"]),
                size=int(body["size"]),
                mode=int(body["mode"]),
                mtime_ns=int(body["mtime_ns"]),
                state=str(body["state"]),
                holders=[str(h) for h in body.get("holders", [])],
                chunks=chunks,
                chunking=str(body.get("chunking", "fixed")),
            )
        except ManifestError:
            raise
        except (ValueError, KeyError, TypeError) as exc:
            raise ManifestError(f"{where}: malformed manifest ({exc})") from None
        manifest.validate(where)
        return manifest

    def validate(self, where: str = "manifest") -> None:
        if self.state not in STATES:
            raise ManifestError(f"{where}: unknown state {self.state!r}")
        if self.size < 0:
            raise ManifestError(f"{where}: negative size")
        if self.state == "durable":
            expected = 0
            for chunk in self.chunks:
                if chunk.offset != expected or chunk.length <= 0:
                    raise ManifestError(f"{where}: chunk list has a gap at offset {expected}")
                expected += chunk.length
            if expected != self.size:
                raise ManifestError(f"{where}: chunks cover {expected} bytes, size is {self.size}")


def new_id() -> str:
    return secrets.token_hex(8)


def read_manifest(path: str | os.PathLike[str]) -> Manifest | None:
    """Return the manifest at ``path``, or None if it is a plain file (blocking)."""
    with open(path, "rb") as f:
        head = f.read(len(MAGIC))
        if head != MAGIC:
            return None
        if os.fstat(f.fileno()).st_size > MAX_MANIFEST_BYTES:
            return None
        data = head + f.read()
    return Manifest.from_bytes(data, where=str(path))


def tmp_name_for(path: Path) -> Path:
    # Shortened so that a name near NAME_MAX still has a temporary name.
    return path.with_name(f".{path.name[:128]}.ckptfs-tmp.{secrets.token_hex(4)}")


def is_tmp_name(name: str | bytes) -> bool:
    text = name.decode("utf-8", "surrogateescape") if isinstance(name, bytes) else name
    return text.startswith(".") and ".ckptfs-tmp." in text


def write_manifest(path: Path, manifest: Manifest, *, sync: bool = True) -> None:
    """Atomically replace ``path`` with ``manifest`` (blocking).

    Written to a temporary name, fsynced and renamed, so a reader on any node
    sees either the old or the new manifest, never a torn one.
    """
    tmp = tmp_name_for(path)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, manifest.mode & 0o7777 or 0o644)
    try:
        os.write(fd, manifest.to_bytes())
        os.fchmod(fd, manifest.mode & 0o7777)
        if sync:
            os.fsync(fd)
    except BaseException:
        os.close(fd)
        os.unlink(tmp)
        raise
    os.close(fd)
    try:
        os.rename(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
