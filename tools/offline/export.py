"""``ckptfs export``: turn manifests back into plain files, offline.

Reads the backing directory directly (no daemon): a manifest is reassembled
from its chunks, each verified against its hash; a plain file is copied; a
directory is recursed. Every destination file is written under a temporary
name and renamed into place, so a failure never leaves a partial file.
"""

from __future__ import annotations

import os
import shutil
import stat
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from ckptfs.fs.store.chunkstore import CKPTFS_DIR, ChunkCorrupt, ChunkStore
from ckptfs.fs.store.manifest import Manifest, ManifestError, manifest_from_fd, tmp_name_for
from ckptfs.tools.offline.walk import Problem, chunk_problem, find_backing_root, skipped_name


@dataclass
class ExportResult:
    files: list[Path] = field(default_factory=list)  # destination files written
    bytes: int = 0
    skipped: list[Path] = field(default_factory=list)  # sources neither file, dir nor symlink
    problems: list[Problem] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


class _Failed(Exception):
    def __init__(self, problem: Problem) -> None:
        super().__init__(str(problem))
        self.problem = problem


def export(src: Path, dst: Path, *, backing: Path | None = None) -> ExportResult:
    """Write plain, byte-identical copies of ``src`` (a file or tree) to ``dst``.

    ``backing`` is the backing directory holding the chunk store; by default
    the nearest one above ``src``. A file that cannot be exported (pending,
    unreadable, a chunk missing or corrupted, a manifest ckptfs did not
    write) is reported in ``problems`` and the others are still exported. As
    with ``cp -r``, a file exported into an existing directory keeps its
    name. The tree is read through directory descriptors, following no
    symlink: a directory a user swaps for one while this runs (as root)
    exports nothing from where it points.
    """
    src, dst = Path(src), Path(dst)
    st = os.lstat(src)  # FileNotFoundError names src
    root = backing if backing is not None else find_backing_root(src)
    store = ChunkStore(root, create=False) if root is not None else None
    if root is not None and _is_within(src, Path(root) / CKPTFS_DIR):
        raise ValueError(f"{src} is inside the chunk store, not the namespace")
    key = _key(store)
    result = ExportResult()
    parent = os.open(src.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        source = _Source(src, parent, src.name, store, key)
        if stat.S_ISDIR(st.st_mode):
            if _is_within(dst, src):
                raise ValueError(f"destination {dst} is inside the source tree {src}")
            _export_dir(source, dst, result)
        else:
            if dst.is_dir():
                dst = dst / src.name
            _export_one(source, st, dst, result)
    finally:
        os.close(parent)
    return result


def _key(store: ChunkStore | None) -> bytes | None:
    try:
        return store.dirs.manifest_key() if store is not None else None
    except FileNotFoundError:
        return None  # no daemon ever mounted it: nothing sealed


@dataclass(frozen=True)
class _Source:
    """A name in a source directory held open (``dir_fd``), and where it
    is (``path``, for messages)."""

    path: Path
    dir_fd: int
    name: str
    store: ChunkStore | None
    key: bytes | None

    def child(self, fd: int, name: str) -> _Source:
        return _Source(self.path / name, fd, name, self.store, self.key)


def _is_within(path: Path, parent: Path) -> bool:
    a, b = os.path.realpath(path), os.path.realpath(parent)
    return os.path.commonpath([a, b]) == b


def _export_dir(src: _Source, dst: Path, result: ExportResult) -> None:
    try:
        dst.mkdir(parents=True, exist_ok=True)
        fd = os.open(
            src.name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
            dir_fd=src.dir_fd,
        )  # fmt: skip
    except OSError as exc:
        result.problems.append(Problem(src.path, f"cannot export directory: {exc.strerror or exc}"))
        return
    try:
        names = sorted(os.listdir(fd))
        for name in names:
            if skipped_name(name):
                continue
            try:
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            except FileNotFoundError:
                continue  # removed meanwhile
            if stat.S_ISDIR(st.st_mode):
                _export_dir(src.child(fd, name), dst / name, result)
            else:
                _export_one(src.child(fd, name), st, dst / name, result)
        try:
            st = os.fstat(fd)
            os.utime(dst, ns=(st.st_atime_ns, st.st_mtime_ns))
            os.chmod(dst, stat.S_IMODE(st.st_mode))
        except OSError:
            pass  # the files are what matters; a directory's times are cosmetic
    except OSError as exc:
        result.problems.append(Problem(src.path, f"cannot export directory: {exc.strerror or exc}"))
    finally:
        os.close(fd)


def _export_one(src: _Source, st: os.stat_result, dst: Path, result: ExportResult) -> None:
    try:
        if stat.S_ISLNK(st.st_mode):
            _replace_symlink(os.readlink(src.name, dir_fd=src.dir_fd), dst)
            result.files.append(dst)
        elif stat.S_ISREG(st.st_mode):
            result.bytes += _export_file(src, dst)
            result.files.append(dst)
        else:
            result.skipped.append(src.path)
    except _Failed as exc:
        result.problems.append(exc.problem)
    except OSError as exc:
        result.problems.append(Problem(src.path, f"cannot export to {dst}: {exc.strerror or exc}"))


def _export_file(src: _Source, dst: Path) -> int:
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    fd = os.open(src.name, flags, dir_fd=src.dir_fd)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _Failed(Problem(src.path, "not a regular file (replaced meanwhile?)"))
        try:
            manifest = manifest_from_fd(fd, str(src.path), src.key, st)
        except ManifestError as exc:
            raise _Failed(Problem(src.path, f"unreadable manifest ({exc})")) from None
        if manifest is None:
            with open(fd, "rb", closefd=False) as f:
                return _write_atomically(
                    dst, lambda out: shutil.copyfileobj(f, out), st.st_mode, st.st_mtime_ns
                )
    finally:
        os.close(fd)
    if src.key is not None and not manifest.sealed:
        raise _Failed(
            Problem(src.path, "a manifest ckptfs did not write, or one changed outside it: "
                    "not exported (ckptfs check lists it)")
        )  # fmt: skip
    if manifest.state != "durable":
        holders = ", ".join(manifest.holders) or "no node"
        raise _Failed(
            Problem(
                src.path,
                f"not durable yet (state {manifest.state}): its bytes are only in the RAM of "
                f"{holders}; run `ckptfs flush --wait` on the mount first",
            )
        )
    if src.store is None:
        raise _Failed(
            Problem(src.path, "is a manifest but no .ckptfs chunk store was found above it")
        )
    store = src.store
    return _write_atomically(
        dst,
        lambda out: _reassemble(manifest, store, src.path, out),
        manifest.mode,
        manifest.mtime_ns,
        manifest.atime,
    )


def _reassemble(manifest: Manifest, store: ChunkStore, src: Path, out: BinaryIO) -> None:
    """Chunks in order; gaps between them are holes, left sparse in the copy."""
    for chunk in manifest.chunks:
        out.seek(chunk.offset)
        try:
            data = store.get(chunk.hash, chunk.length)
        except ChunkCorrupt as exc:
            raise _Failed(Problem(src, chunk_problem(exc, chunk.hash), chunk=chunk.hash)) from None
        except OSError as exc:
            where = store.path_for(chunk.hash)
            raise _Failed(
                Problem(src, f"cannot read {where}: {exc.strerror or exc}", chunk=chunk.hash)
            ) from None
        out.write(data)
    out.truncate(manifest.size)
    out.seek(manifest.size)


def _write_atomically(
    dst: Path,
    fill: Callable[[BinaryIO], object],
    mode: int,
    mtime_ns: int,
    atime_ns: int | None = None,
) -> int:
    """Write ``dst`` through a temporary name; return its size."""
    tmp = tmp_name_for(dst)  # hidden by ckptfs and the offline tools if left behind
    try:
        with open(tmp, "xb") as out:
            fill(out)
            out.flush()
            size = out.tell()
            os.fchmod(out.fileno(), mode & 0o7777)
            os.fsync(out.fileno())
        os.utime(tmp, ns=(mtime_ns if atime_ns is None else atime_ns, mtime_ns))
        os.rename(tmp, dst)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return size


def _replace_symlink(target: str, dst: Path) -> None:
    tmp = tmp_name_for(dst)
    os.symlink(target, tmp)
    try:
        os.rename(tmp, dst)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
