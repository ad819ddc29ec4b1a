"""Paths resolved strictly beneath a directory, never through a symlink.

The daemon runs as root and the backing directory is written by job users
(through the mount, from another node, from a login node's NFS mount). A path
such as ``u/d/name`` resolved by the kernel follows a symlink in any
component: a user who swaps ``d`` for a symlink to ``/etc`` between our
lookup and our call would have root act on ``/etc/name``. ``O_NOFOLLOW`` and
``follow_symlinks=False`` guard only the last component.

So every path in the backing store is resolved here: with ``openat2(2)`` and
``RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS`` (Linux 5.6
and later), else one component at a time with ``O_NOFOLLOW | O_DIRECTORY``.
Callers then act on a name inside a directory they hold open (``*at`` calls
on one component, which never follow it), or on an object they hold open.

A directory on the path that is not one any more (a symlink, a file) reads
as a missing name: ENOENT, never an action on what the symlink points at.
Everything here blocks; callers run it in store-call threads.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import stat
from collections.abc import Iterator
from pathlib import Path

# linux/openat2.h
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_NO_SYMLINKS = 0x04
RESOLVE_BENEATH = 0x08
RESOLVE = RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS
SYS_OPENAT2 = 437  # the same number on every architecture (a syscall added after the unified table)
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


_libc = ctypes.CDLL(None, use_errno=True)
_syscall = _libc.syscall
_syscall.restype = ctypes.c_long
# None until the first call tells: a kernel before 5.6, or a seccomp filter
# that refuses openat2 (some container runtimes), falls back to the walk.
_have_openat2: bool | None = None


def split(rel: str) -> list[str]:
    """The components of a path relative to the backing root; ValueError for
    anything that could leave it or is not a plain name (absolute, ``..``,
    ``.``, empty components). Paths come from the kernel's names, which are
    never such, and from records in the store, which are untrusted."""
    if rel == "":
        return []
    parts = rel.split("/")
    if rel.startswith("/") or any(p in ("", ".", "..") or "\0" in p for p in parts):
        raise ValueError(f"not a path beneath the backing root: {rel!r}")
    return parts


def check_rel(rel: str) -> str:
    """``rel`` if it is a path beneath the root (see :func:`split`), else ValueError."""
    split(rel)
    return rel


def _openat2(dir_fd: int, rel: str, flags: int, mode: int) -> int:
    how = _OpenHow(flags | os.O_CLOEXEC, mode if flags & os.O_CREAT else 0, RESOLVE)
    while True:
        fd = _syscall(SYS_OPENAT2, dir_fd, os.fsencode(rel), ctypes.byref(how), ctypes.sizeof(how))
        if fd >= 0:
            return int(fd)
        err = ctypes.get_errno()
        if err != errno.EINTR:
            raise OSError(err, os.strerror(err), rel)


def _walk(dir_fd: int, parts: list[str], flags: int, mode: int) -> int:
    """openat2's resolution done by hand: each directory opened with
    O_NOFOLLOW relative to the last, so none can be a symlink."""
    fd = dir_fd
    try:
        for part in parts[:-1]:
            nxt = os.open(
                part, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd
            )
            if fd != dir_fd:
                os.close(fd)
            fd = nxt
        return os.open(parts[-1], flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=fd)
    finally:
        if fd != dir_fd:
            os.close(fd)


def open_beneath(dir_fd: int, rel: str, flags: int, mode: int = 0o600) -> int:
    """``open(rel, flags)`` with ``rel`` resolved beneath ``dir_fd`` and no
    symlink followed: ELOOP if one is on the path or is the last component
    (unless ``flags`` has ``O_PATH | O_NOFOLLOW``: then its fd), EXDEV or
    ValueError for a path that would leave ``dir_fd``. ``""`` is ``dir_fd``."""
    global _have_openat2
    parts = split(rel)
    if not parts:
        parts, rel = ["."], "."
    if _have_openat2 is not False:
        try:
            fd = _openat2(dir_fd, rel, flags, mode)
            _have_openat2 = True
            return fd
        except OSError as exc:
            if _have_openat2 or exc.errno not in (errno.ENOSYS, errno.EPERM):
                raise
            _have_openat2 = False
    return _walk(dir_fd, parts, flags, mode)


def _not_there(exc: OSError, rel: str) -> OSError:
    """A directory on ``rel`` that is a symlink or a file now: the name is not there."""
    if exc.errno in (errno.ELOOP, errno.ENOTDIR, errno.EXDEV):
        return FileNotFoundError(
            errno.ENOENT, f"{rel}: a directory on its path is not one (a symlink or file now)"
        )
    return exc


def open_dir(dir_fd: int, rel: str) -> int:
    """An fd of the directory ``rel`` beneath ``dir_fd`` (``""``: a new fd of
    ``dir_fd`` itself); ENOENT if it or a directory above it is not one."""
    try:
        return open_beneath(dir_fd, rel, DIR_FLAGS | os.O_NOFOLLOW)
    except OSError as exc:
        raise _not_there(exc, rel) from None


@contextlib.contextmanager
def parent_dir(dir_fd: int, rel: str) -> Iterator[tuple[int, str]]:
    """``(fd of rel's directory, rel's last component)``, the fd closed at
    the end; for the root itself (``""``), ``(dir_fd, ".")``. Calls on the
    name with ``dir_fd=`` that do not follow a last-component symlink
    (stat with follow_symlinks=False, O_NOFOLLOW, mkdir, unlink, rename,
    symlink, link) then cannot leave the directory."""
    parts = split(rel)
    if not parts:
        yield dir_fd, "."
        return
    dfd = open_dir(dir_fd, "/".join(parts[:-1]))
    try:
        yield dfd, parts[-1]
    finally:
        os.close(dfd)


def via_fd(fd: int) -> str:
    """A path to exactly the object ``fd`` holds (procfs): for chmod, chown and
    utime of an object opened with O_PATH (a symlink's own, too), which
    fchmod and friends refuse."""
    return f"/proc/self/fd/{fd}"


@contextlib.contextmanager
def held(
    dir_fd: int, rel: str, expect_ino: int | None = None
) -> Iterator[tuple[int, os.stat_result]]:
    """The object at ``rel`` (a symlink itself, not its target) held open
    with O_PATH, and its stat. ESTALE if ``expect_ino`` is given and another
    object is there now (the name was replaced since it was looked up): an
    action meant for one object must never reach another."""
    try:
        fd = open_beneath(dir_fd, rel, os.O_PATH | os.O_NOFOLLOW)
    except OSError as exc:
        raise _not_there(exc, rel) from None
    try:
        st = os.fstat(fd)
        if expect_ino is not None and st.st_ino != expect_ino:
            raise OSError(errno.ESTALE, f"{rel or '/'}: replaced since it was looked up")
        yield fd, st
    finally:
        os.close(fd)


def check_dir(dfd: int, rel: str, expect_ino: int | None) -> None:
    """ESTALE if the directory held open as ``dfd`` is not the one an inode
    was bound to (``expect_ino``; None: not checked): a directory a user
    replaced (renamed another in its place) since the kernel looked it up
    must not receive what was meant for it."""
    if expect_ino is not None and os.fstat(dfd).st_ino != expect_ino:
        raise OSError(errno.ESTALE, f"{rel or '/'}: replaced since it was looked up")


@contextlib.contextmanager
def in_parent(root: int, rel: str, expect_parent: int | None) -> Iterator[tuple[int, str]]:
    """(fd of ``rel``'s directory, its name), that directory checked against
    ``expect_parent`` (its inode's backing st_ino; None: not checked)."""
    with parent_dir(root, rel) as (dfd, name):
        check_dir(dfd, os.path.dirname(rel), expect_parent)
        yield dfd, name


def is_private_dir(st: os.stat_result, uid: int) -> bool:
    """Whether a directory's stat (lstat) shows one that only ``uid`` may
    change: a real directory, owned by ``uid``, not writable by group or others."""
    return stat.S_ISDIR(st.st_mode) and st.st_uid == uid and not st.st_mode & 0o022


class NotPrivate(OSError):
    """A directory of the daemon's own (``.ckptfs`` and beneath, the cache
    directory) is not one only the daemon's user may change."""


def private_dir(
    dir_fd: int, name: str, mode: int = 0o700, *, create: bool = True, label: str = ""
) -> int:
    """An fd of the directory ``name`` (one component) in ``dir_fd``, made
    with ``mode`` if missing; NotPrivate (EPERM, naming it as ``label``)
    unless it is a real directory owned by this process's user and writable
    by no one else: whoever could change it could replace what the daemon
    reads from it, or make it write elsewhere."""
    label = label or name
    if create:
        with contextlib.suppress(FileExistsError):
            os.mkdir(name, mode, dir_fd=dir_fd)
    try:
        fd = os.open(name, DIR_FLAGS | os.O_NOFOLLOW, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise NotPrivate(
                errno.EPERM, f"{label} is not a directory (a symlink or a file)"
            ) from None
        raise
    st = os.fstat(fd)
    uid = os.geteuid()
    if not is_private_dir(st, uid):
        os.close(fd)
        raise NotPrivate(
            errno.EPERM,
            f"{label} is not a directory only uid {uid} may change "
            f"(owner uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):04o})",
        )
    return fd


def check_private_path(path: Path) -> None:
    """NotPrivate unless ``path`` is a real directory only this process's user
    may change, beneath directories only it or root may change (or sticky,
    as /dev/shm and /tmp: there nobody may move another's entry). For the
    cache directory: a user who made /dev/shm/ckptfs first would own the
    journal that recovery reads, and the arena's bytes."""
    uid = os.geteuid()
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise NotPrivate(errno.ENOENT, f"{path} does not exist") from None
    if not is_private_dir(st, uid):
        link = ", a symlink" if stat.S_ISLNK(st.st_mode) else ""
        raise NotPrivate(
            errno.EPERM,
            f"{path} is not a directory only uid {uid} may change "
            f"(owner uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):04o}{link})",
        )
    for parent in Path(os.path.abspath(path)).parents:
        st = os.stat(parent)
        shared = st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX
        if st.st_uid not in (0, uid) or shared:
            raise NotPrivate(
                errno.EPERM,
                f"{path} is inside {parent}, which another user may change "
                f"(owner uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):04o})",
            )


def make_private_path(path: Path) -> None:
    """``path`` made (mode 0700, with missing parents as mkdir -p would) if
    it is missing, then checked as :func:`check_private_path` says."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    check_private_path(path)
