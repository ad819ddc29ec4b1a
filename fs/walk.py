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

from .chunkstore import CKPTFS_DIR
from .manifest import is_tmp_name


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


def walk_files(
    top: Path,
    *,
    include_tmp: bool = False,
    errors: list[Problem] | None = None,
) -> Iterator[Path]:
    """Regular files at or under ``top``, sorted, without following symlinks.

    ``.ckptfs`` directories are skipped, and temporary manifest names unless
    ``include_tmp``. A directory that cannot be read raises, or is recorded in
    ``errors`` if given: the caller decides whether a partial walk is enough.
    """
    try:
        st = os.lstat(top)
    except OSError as exc:
        if errors is None:
            raise
        errors.append(Problem(top, f"cannot stat: {exc.strerror or exc}"))
        return
    if stat.S_ISREG(st.st_mode):
        yield top
        return
    if not stat.S_ISDIR(st.st_mode):
        return
    try:
        with os.scandir(top) as it:
            entries = sorted(it, key=lambda e: e.name)
    except OSError as exc:
        if errors is None:
            raise
        errors.append(Problem(top, f"cannot list directory: {exc.strerror or exc}"))
        return
    for entry in entries:
        if entry.name == CKPTFS_DIR or (is_tmp_name(entry.name) and not include_tmp):
            continue
        path = top / entry.name
        try:
            is_dir = entry.is_dir(follow_symlinks=False)
            is_file = entry.is_file(follow_symlinks=False)
        except OSError as exc:
            if errors is None:
                raise
            errors.append(Problem(path, f"cannot stat: {exc.strerror or exc}"))
            continue
        if is_dir:
            yield from walk_files(path, include_tmp=include_tmp, errors=errors)
        elif is_file:
            yield path


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
