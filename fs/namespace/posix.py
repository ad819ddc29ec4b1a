"""What the POSIX operations take and give back, and rules they share.

The error a caller gets (:class:`FsError`, with its errno), a file's
attributes (:class:`Attr`), a setattr's change (:class:`SetAttr`), the
caller (:class:`Caller`) and an open file handle (:class:`Handle`); the set-id
bits a write or chown clears, as Linux does; whether a path is in a subtree.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass

from ckptfs.fs.content.cachedfile import CachedFile
from ckptfs.fs.namespace.inodes import Inode

PRIVILEGE_BITS = stat.S_ISUID | stat.S_ISGID


class FsError(OSError):
    """An error for the caller with an errno (becomes the FUSE reply).

    ``logged``: the cause was already logged where it happened.
    """

    def __init__(self, err: int, message: str = "", logged: bool = False) -> None:
        super().__init__(err, message or os.strerror(err))
        self.logged = logged


@dataclass
class Attr:
    ino: int
    mode: int
    size: int
    nlink: int
    uid: int
    gid: int
    atime_ns: int
    mtime_ns: int
    ctime_ns: int
    blksize: int


@dataclass
class Handle:
    inode: Inode
    file: CachedFile | None = None
    plain_fd: int | None = None
    writable: bool = False
    uid: int = 0  # who opened it: writes by anyone but root clear setuid/setgid
    tid: int = 0  # the thread that opened it, as the kernel names it (0: unknown)


@dataclass
class SetAttr:
    mode: int | None = None
    uid: int | None = None
    gid: int | None = None
    size: int | None = None
    atime_ns: int | None = None
    mtime_ns: int | None = None


@dataclass
class Caller:
    uid: int
    gid: int
    tid: int = 0  # the calling thread, as the kernel names it (0: unknown)


def kills_privileges(mode: int) -> bool:
    """Whether a write (or chown) clears setuid/setgid, as Linux does: setuid
    always, setgid only with group-execute (without it, it marks mandatory locking)."""
    return bool(mode & stat.S_ISUID) or (mode & (stat.S_ISGID | stat.S_IXGRP)) == (
        stat.S_ISGID | stat.S_IXGRP
    )


def without_privileges(mode: int) -> int:
    mode &= ~stat.S_ISUID
    if mode & stat.S_IXGRP:
        mode &= ~stat.S_ISGID
    return mode


def at_or_under(path: str, prefix: str) -> bool:
    return path == prefix or path.startswith(prefix + "/")


def in_subtree(path: str, prefix: str) -> bool:
    """Whether ``path`` is in what an operator's PATH names ("": everything)."""
    return not prefix or at_or_under(path, prefix)
