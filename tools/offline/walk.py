"""Walking a backing directory offline: its files, manifests and chunk store.

Shared by the offline tools (export, gc, check, retention). Everything here
blocks and touches only the backing directory; no daemon is involved.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from ckptfs.fs.store.manifest import Manifest, is_tmp_name, read_manifest
from ckptfs.fs.store.storedirs import CKPTFS_DIR


@dataclass(frozen=True)
class Problem:
    """Something wrong with one file of the backing store."""

    path: Path
    problem: str
    chunk: str | None = None

    def __str__(self) -> str:
        where = f"{self.path}: chunk {self.chunk}" if self.chunk else str(self.path)
        return f"{where}: {self.problem}"


def find_backing_root(path: Path) -> Path | None:
    """The nearest directory at or above ``path`` that holds a ``.ckptfs`` chunk store.

    One with a ``chunks`` directory wins over a bare ``.ckptfs`` (which a
    store that has no chunk yet, or a stray copy, may be).
    """
    path = Path(os.path.abspath(path))
    candidates = (path, *path.parents)
    for marker in (Path(CKPTFS_DIR, "chunks"), Path(CKPTFS_DIR)):
        for candidate in candidates:
            if (candidate / marker).is_dir():
                return candidate
    return None


def skipped_name(name: str) -> bool:
    """Names the offline tools never treat as files of the namespace."""
    return name == CKPTFS_DIR or is_tmp_name(name)


@dataclass(frozen=True)
class Found:
    """A regular file a walk found: its path (for messages) and, to open or
    stat it, its directory's descriptor (valid until the walk moves on) and
    its name there. Reached through descriptors only: a directory a user
    swapped for a symlink while the walk ran leads nowhere."""

    path: Path
    dir_fd: int
    name: str

    def read_manifest(self, key: bytes | None = None) -> Manifest | None:
        return read_manifest(self.name, dir_fd=self.dir_fd, key=key)

    def stat(self) -> os.stat_result:
        return os.stat(self.name, dir_fd=self.dir_fd, follow_symlinks=False)


def walk_files(
    top: Path,
    *,
    include_tmp: bool = False,
    errors: list[Problem] | None = None,
) -> Iterator[Found]:
    """Regular files at or under ``top`` (the operator's path), sorted,
    through directory descriptors, never following a symlink (os.fwalk).

    ``.ckptfs`` directories are skipped, and temporary manifest names unless
    ``include_tmp``. A directory that cannot be read raises, or is recorded in
    ``errors`` if given: the caller decides whether a partial walk is enough.
    """

    def failed(exc: OSError) -> None:
        where = Path(exc.filename) if exc.filename else top
        if errors is None:
            raise exc
        errors.append(Problem(where, f"cannot list directory: {exc.strerror or exc}"))

    try:
        st = os.lstat(top)
    except OSError as exc:
        if errors is None:
            raise
        errors.append(Problem(top, f"cannot stat: {exc.strerror or exc}"))
        return
    if stat.S_ISREG(st.st_mode):
        fd = os.open(top.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            yield Found(top, fd, top.name)
        finally:
            os.close(fd)
        return
    if not stat.S_ISDIR(st.st_mode):
        return
    for dirpath, dirnames, filenames, dfd in os.fwalk(top, onerror=failed):
        dirnames[:] = sorted(d for d in dirnames if d != CKPTFS_DIR)
        for name in sorted(filenames):
            if name == CKPTFS_DIR or (is_tmp_name(name) and not include_tmp):
                continue
            try:
                file_st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            except FileNotFoundError:
                continue  # removed meanwhile
            except OSError as exc:
                if errors is None:
                    raise
                errors.append(Problem(Path(dirpath) / name, f"cannot stat: {exc.strerror or exc}"))
                continue
            if stat.S_ISREG(file_st.st_mode):
                yield Found(Path(dirpath) / name, dfd, name)


def resolve_under(backing: Path, path: Path | None) -> Path:
    """``path`` (absolute, or relative to ``backing``) checked to lie in ``backing``."""
    if path is None:
        return backing
    full = path if path.is_absolute() else backing / path
    root = os.path.abspath(backing)
    target = os.path.abspath(full)
    if os.path.commonpath([root, target]) != root:
        raise ValueError(f"{path} is not inside the backing directory {backing}")
    return Path(target)


def chunk_problem(exc: Exception, digest: str) -> str:
    """The text of a ChunkStore error without its leading ``chunk <hash>``.

    A Problem already names the chunk; this keeps the message from saying it twice.
    """
    text = str(exc)
    prefix = f"chunk {digest} "
    return text[len(prefix) :] if text.startswith(prefix) else text
