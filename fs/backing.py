"""The namespace in the backing directory: names, directories and manifests.

Every call runs in a worker thread under the backing-store timeout (see
blocking.py). Paths are relative to the backing root (``""`` is the root);
the ``.ckptfs`` directory and temporary names are hidden.
"""

from __future__ import annotations

import errno
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from .blocking import BackingIO
from .chunkstore import CKPTFS_DIR
from .manifest import Manifest, ManifestError, is_tmp_name, read_manifest, write_manifest


@dataclass
class Entry:
    """What a name in the backing directory is: a directory, symlink, plain file or manifest."""

    kind: str  # "dir" | "symlink" | "plain" | "file"
    st: os.stat_result
    manifest: Manifest | None = None

    @property
    def ident(self) -> tuple[str, object]:
        if self.manifest is not None:
            return ("file", self.manifest.file_id)
        return (self.kind, self.st.st_ino)


def hidden(rel_dir: str, name: str) -> bool:
    return (rel_dir == "" and name == CKPTFS_DIR) or is_tmp_name(name)


def _entry_at(path: Path) -> Entry:
    st = os.lstat(path)
    if stat.S_ISDIR(st.st_mode):
        return Entry("dir", st)
    if stat.S_ISLNK(st.st_mode):
        return Entry("symlink", st)
    if stat.S_ISREG(st.st_mode):
        try:
            manifest = read_manifest(path)
        except ManifestError as exc:
            raise OSError(errno.EIO, f"unreadable manifest: {exc}") from None
        return Entry("file", st, manifest) if manifest else Entry("plain", st)
    return Entry("plain", st)


def _list(path: Path, rel: str) -> list[tuple[str, Entry]]:
    entries = []
    for name in sorted(os.listdir(path)):
        if hidden(rel, name):
            continue
        try:
            entries.append((name, _entry_at(path / name)))
        except FileNotFoundError:  # removed meanwhile (another node)
            continue
    return entries


def _rmdir(path: Path) -> None:
    try:
        os.rmdir(path)
    except OSError as exc:
        if exc.errno != errno.ENOTEMPTY:
            raise
        # Leftover temporary files of an interrupted manifest write are not
        # visible through the mount and must not make rmdir fail.
        names = os.listdir(path)
        if not names or not all(is_tmp_name(n) for n in names):
            raise
        for name in names:
            os.unlink(path / name)
        os.rmdir(path)


class Backing:
    def __init__(self, root: Path, io: BackingIO) -> None:
        self.root = root
        self.io = io

    def abs(self, rel: str) -> Path:
        return self.root / rel if rel else self.root

    async def entry(self, rel: str) -> Entry:
        return await self.io.run(_entry_at, self.abs(rel), what=f"stat {rel or '/'}")

    async def listdir(self, rel: str) -> list[tuple[str, Entry]]:
        return await self.io.run(_list, self.abs(rel), rel, what=f"readdir {rel or '/'}")

    async def manifest(self, rel: str) -> Manifest | None:
        return await self.io.run(read_manifest, self.abs(rel), what=f"read manifest {rel}")

    async def write_manifest(self, rel: str, manifest: Manifest) -> None:
        await self.io.run(write_manifest, self.abs(rel), manifest, what=f"write manifest {rel}")

    async def mkdir(self, rel: str, mode: int) -> None:
        await self.io.run(os.mkdir, self.abs(rel), mode, what=f"mkdir {rel}")

    async def rmdir(self, rel: str) -> None:
        await self.io.run(_rmdir, self.abs(rel), what=f"rmdir {rel}")

    async def unlink(self, rel: str) -> None:
        await self.io.run(os.unlink, self.abs(rel), what=f"unlink {rel}")

    async def rename(self, old: str, new: str) -> None:
        await self.io.run(os.rename, self.abs(old), self.abs(new), what=f"rename {old} -> {new}")

    async def symlink(self, target: bytes, rel: str) -> None:
        await self.io.run(os.symlink, target, self.abs(rel), what=f"symlink {rel}")

    async def readlink(self, rel: str) -> bytes:
        return await self.io.run(os.readlink, os.fsencode(self.abs(rel)), what=f"readlink {rel}")

    async def chmod(self, rel: str, mode: int) -> None:
        await self.io.run(os.chmod, self.abs(rel), mode, what=f"chmod {rel}")

    async def chown(self, rel: str, uid: int, gid: int) -> None:
        await self.io.run(os.lchown, self.abs(rel), uid, gid, what=f"chown {rel}")

    async def utime(self, rel: str, atime_ns: int, mtime_ns: int) -> None:
        def utime() -> None:
            os.utime(self.abs(rel), ns=(atime_ns, mtime_ns), follow_symlinks=False)

        await self.io.run(utime, what=f"utime {rel}")

    async def truncate(self, rel: str, size: int) -> None:
        await self.io.run(os.truncate, self.abs(rel), size, what=f"truncate {rel}")

    async def open_plain(self, rel: str) -> int:
        return await self.io.run(os.open, self.abs(rel), os.O_RDONLY, what=f"open {rel}")

    async def pread(self, fd: int, size: int, off: int, rel: str) -> bytes:
        return await self.io.run(os.pread, fd, size, off, what=f"read {rel}")

    async def close_fd(self, fd: int) -> None:
        await self.io.run(os.close, fd, what="close")

    async def statvfs(self) -> os.statvfs_result:
        return await self.io.run(os.statvfs, self.root, what="statfs")
