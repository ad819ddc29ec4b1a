"""The FUSE operations: each decodes its request, makes one call on
:class:`FileSystem` and encodes the reply.

Every handler is wrapped: OSErrors keep their errno, anything else becomes EIO
and is logged with the operation and its arguments; the session turns the
resulting :class:`FuseError` into the reply. A few operations also have a
synchronous fast path (``*_now`` on FileSystem) that the session's reader
answers inline, with no task (fs/fuse/session.py); it declines (None) when the
answer needs an await.
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from ckptfs.fs.fuse import abi as abi
from ckptfs.fs.fuse.abi import Op
from ckptfs.fs.fuse.session import FuseError, Handlers, Reply, Request
from ckptfs.fs.namespace.filesystem import FileSystem
from ckptfs.fs.namespace.posix import Attr, Caller, SetAttr

log = logging.getLogger("ckptfs.fuse")
T = TypeVar("T")
ATTR_TIMEOUT = 1.0  # other nodes may change names and files: keep kernel caching short
# Refusals that are part of normal operation (by design, or the caller's
# mistake): logged at INFO the first time per operation and errno, then at
# DEBUG, so that WARNING and ERROR keep meaning "an operator must look".
EXPECTED = {
    errno.ENOENT,
    errno.EEXIST,
    errno.ENOTEMPTY,
    errno.ENOTDIR,
    errno.EISDIR,
    errno.EPERM,
    errno.EACCES,
    errno.ENAMETOOLONG,
    errno.EFBIG,
    errno.EINVAL,
    errno.EXDEV,
    errno.ELOOP,
    errno.EBADF,
    errno.ENOTSUP,
    errno.EROFS,
    errno.EBUSY,
    errno.ESTALE,  # the name was replaced after the kernel looked it up: it retries
    errno.EINTR,  # the caller got a signal while its request waited (interrupts.py)
}
_seen: set[tuple[str, int]] = set()


def _log_failure(op: str, args: tuple[Any, ...], exc: OSError, err: int) -> None:
    if err in EXPECTED:
        first = (op, err) not in _seen
        _seen.add((op, err))
        log.log(
            logging.INFO if first else logging.DEBUG,
            "%s%r refused: %s%s",
            op,
            args,
            exc,
            " (logged once per kind; more at DEBUG)" if first else "",
        )
    elif not getattr(exc, "logged", False):
        log.warning("%s%r failed: %s", op, args, exc)


# Where a request's name starts in its body, for the ops that carry one.
NAME_AT = {
    Op.LOOKUP: 0,
    Op.UNLINK: 0,
    Op.RMDIR: 0,
    Op.SYMLINK: 0,
    Op.MKDIR: abi.MKDIR_IN.size,
    Op.MKNOD: abi.MKNOD_IN.size,
    Op.CREATE: abi.CREATE_IN.size,
    Op.RENAME: abi.RENAME_IN.size,
    Op.RENAME2: abi.RENAME2_IN.size,
}


def _args(fs: FileSystem, req: Request) -> tuple[Any, ...]:
    """What a log line says a request was about: its inode's path, and its name."""
    try:
        where: Any = fs.inodes.path(req.nodeid) or "/"
    except Exception:
        where = req.nodeid
    if req.op in NAME_AT:
        try:
            return (where, _one_name(req, NAME_AT[Op(req.op)]))
        except ValueError:
            pass
    return (where,)


def _failed(op: str, fs: FileSystem, req: Request, exc: BaseException) -> FuseError:
    """The reply for an exception a handler raised, logged as it deserves."""
    if isinstance(exc, FuseError):
        return exc
    if isinstance(exc, OSError):
        err = exc.errno or errno.EIO
        if not (op == "lookup" and err == errno.ENOENT):
            # Every create and exists() starts with one: not even a refusal,
            # and not worth finding its path for.
            _log_failure(op, _args(fs, req), exc, err)
        return FuseError(err)
    log.error("%s%r failed unexpectedly", op, _args(fs, req), exc_info=exc)
    return FuseError(errno.EIO)


def handler(fn: Callable[[Operations, Request], Awaitable[T]]) -> Callable[..., Awaitable[T]]:
    @functools.wraps(fn)
    async def wrapper(self: Operations, req: Request) -> T:
        try:
            return await fn(self, req)
        except Exception as exc:
            raise _failed(fn.__name__, self.fs, req, exc) from None

    return wrapper


def fast(fn: Callable[[Operations, Request], T]) -> Callable[..., T | None]:
    @functools.wraps(fn)
    def wrapper(self: Operations, req: Request) -> T | None:
        try:
            return fn(self, req)
        except Exception as exc:
            raise _failed(fn.__name__, self.fs, req, exc) from None

    return wrapper


def _writes(flags: int) -> bool:
    """Whether an open with ``flags`` gets a handle that writes (FileSystem.open)."""
    return (flags & os.O_ACCMODE) != os.O_RDONLY


def _caller(req: Request) -> Caller:
    return Caller(req.uid, req.gid, req.pid)


def _name(raw: bytes) -> str:
    return os.fsdecode(raw)


def _one_name(req: Request, skip: int = 0) -> str:
    return _name(abi.names(req.body[skip:], 1)[0])


def entry(attr: Attr) -> bytes:
    return abi.entry_out(attr, ATTR_TIMEOUT)


def attributes(attr: Attr) -> bytes:
    return abi.attr_out(attr, ATTR_TIMEOUT)


class Operations:
    def __init__(self, fs: FileSystem, writeback_cache: bool, direct_writes: bool = True) -> None:
        self.fs = fs
        self.writeback_cache = writeback_cache
        self.direct_writes = direct_writes

    def handlers(self) -> Handlers:
        """The session's dispatch table."""
        return Handlers(
            slow={
                Op.LOOKUP: self.lookup,
                Op.GETATTR: self.getattr,
                Op.SETATTR: self.setattr,
                Op.READLINK: self.readlink,
                Op.SYMLINK: self.symlink,
                Op.MKNOD: self.mknod,
                Op.MKDIR: self.mkdir,
                Op.UNLINK: self.unlink,
                Op.RMDIR: self.rmdir,
                Op.RENAME: self.rename,
                Op.RENAME2: self.rename,
                Op.LINK: self.link,
                Op.OPEN: self.open,
                Op.READ: self.read,
                Op.WRITE: self.write,
                Op.STATFS: self.statfs,
                Op.RELEASE: self.release,
                Op.FSYNC: self.fsync,
                Op.FLUSH: self.flush,
                Op.OPENDIR: self.opendir,
                Op.READDIRPLUS: self.readdirplus,
                Op.FSYNCDIR: self.fsyncdir,
                Op.ACCESS: self.access,
                Op.CREATE: self.create,
            },
            fast={
                Op.OPEN: self.open_now,
                Op.READ: self.read_now,
                Op.RELEASE: self.release_now,
                Op.FLUSH: self.flush_now,
                Op.GETATTR: self.getattr_now,
                Op.FORGET: self.forget_now,
                Op.BATCH_FORGET: self.batch_forget_now,
                Op.RELEASEDIR: self.releasedir_now,
            },
            writeback_cache=self.writeback_cache,
        )

    def _open_flags(self, flags: int, keep: bool, writes: bool) -> int:
        """The OPEN/CREATE reply's flags for a handle that ``writes`` or not."""
        out = abi.FOPEN_KEEP_CACHE if keep else 0
        if not writes:
            # Nothing to do at close for a reader: the kernel skips the FLUSH
            # (ignored with the writeback cache, which must flush its pages).
            out |= abi.FOPEN_NOFLUSH
        elif self._direct(flags):
            out |= abi.FOPEN_DIRECT_IO
        return out

    def _direct(self, flags: int) -> bool:
        """Whether a writer's handle bypasses the page cache (FOPEN_DIRECT_IO)."""
        return self.direct_writes and (flags & os.O_ACCMODE) == os.O_WRONLY

    # ----- names and attributes -------------------------------------------------------------
    @handler
    async def lookup(self, req: Request) -> Reply:
        return entry(await self.fs.lookup(req.nodeid, _one_name(req)))

    @handler
    async def getattr(self, req: Request) -> Reply:
        return attributes(await self.fs.getattr(req.nodeid))

    @fast
    def getattr_now(self, req: Request) -> Reply | None:
        attr = self.fs.getattr_now(req.nodeid)
        return None if attr is None else attributes(attr)

    @handler
    async def setattr(self, req: Request) -> Reply:
        valid, _, _, size, _, atime, mtime, _, atimensec, mtimensec, _, mode, _, uid, gid, _ = (
            abi.SETATTR_IN.unpack_from(req.body)
        )
        now = time.time_ns()

        def when(is_set: int, is_now: int, sec: int, nsec: int) -> int | None:
            if valid & is_now:
                return now
            return sec * 1_000_000_000 + nsec if valid & is_set else None

        change = SetAttr(
            mode=mode if valid & abi.FATTR_MODE else None,
            uid=uid if valid & abi.FATTR_UID else None,
            gid=gid if valid & abi.FATTR_GID else None,
            size=size if valid & abi.FATTR_SIZE else None,
            atime_ns=when(abi.FATTR_ATIME, abi.FATTR_ATIME_NOW, atime, atimensec),
            mtime_ns=when(abi.FATTR_MTIME, abi.FATTR_MTIME_NOW, mtime, mtimensec),
        )
        return attributes(await self.fs.setattr(req.nodeid, change, _caller(req)))

    @fast
    def forget_now(self, req: Request) -> Reply | None:
        self._forget(req.nodeid, abi.FORGET_IN.unpack_from(req.body)[0])
        return b""

    def _batch(self, req: Request) -> list[tuple[int, int]]:
        (count, _) = abi.BATCH_FORGET_IN.unpack_from(req.body)
        start = abi.BATCH_FORGET_IN.size
        return [
            abi.FORGET_ONE.unpack_from(req.body, start + i * abi.FORGET_ONE.size)
            for i in range(count)
        ]

    @fast
    def batch_forget_now(self, req: Request) -> Reply | None:
        for ino, count in self._batch(req):
            self._forget(ino, count)
        return b""

    def _forget(self, ino: int, count: int) -> None:
        try:
            self.fs.forget(ino, count)
        except Exception:
            log.exception("forget of inode %d failed", ino)

    @handler
    async def readlink(self, req: Request) -> Reply:
        return await self.fs.readlink(req.nodeid)

    # ----- directories ----------------------------------------------------------------------
    @handler
    async def opendir(self, req: Request) -> Reply:
        return abi.open_out(await self.fs.opendir(req.nodeid), 0)

    @handler
    async def readdirplus(self, req: Request) -> Reply:
        fh, start, size, *_ = abi.READ_IN.unpack_from(req.body)
        room = size
        raw: list[bytes] = []  # the names taken, encoded once

        def fits(name: str) -> bool:
            nonlocal room
            encoded = os.fsencode(name)
            need = abi.dirent_plus_size(encoded)
            if need > room:
                return False
            room -= need
            raw.append(encoded)
            return True

        entries = await self.fs.readdir(fh, start, fits)
        return b"".join(
            abi.dirent_plus(name, attr, offset, ATTR_TIMEOUT)
            for name, (offset, _, attr) in zip(raw, entries, strict=True)
        )

    @fast
    def releasedir_now(self, req: Request) -> Reply | None:
        self.fs.releasedir(abi.RELEASE_IN.unpack_from(req.body)[0])
        return b""

    @handler
    async def fsyncdir(self, req: Request) -> Reply:
        return b""  # directory changes are applied to the backing store synchronously

    @handler
    async def mkdir(self, req: Request) -> Reply:
        mode, _ = abi.MKDIR_IN.unpack_from(req.body)
        name = _one_name(req, abi.MKDIR_IN.size)
        return entry(await self.fs.mkdir(req.nodeid, name, mode, _caller(req)))

    @handler
    async def rmdir(self, req: Request) -> Reply:
        await self.fs.rmdir(req.nodeid, _one_name(req))
        return b""

    @handler
    async def unlink(self, req: Request) -> Reply:
        await self.fs.unlink(req.nodeid, _one_name(req))
        return b""

    @handler
    async def rename(self, req: Request) -> Reply:
        if req.op == Op.RENAME2:
            new_parent, flags, _ = abi.RENAME2_IN.unpack_from(req.body)
            skip = abi.RENAME2_IN.size
        else:
            (new_parent,), flags, skip = abi.RENAME_IN.unpack_from(req.body), 0, abi.RENAME_IN.size
        old, new = (_name(n) for n in abi.names(req.body[skip:], 2))
        await self.fs.rename(req.nodeid, old, new_parent, new, flags)
        return b""

    @handler
    async def symlink(self, req: Request) -> Reply:
        name, target = abi.names(req.body, 2)
        return entry(await self.fs.symlink(req.nodeid, _name(name), target, _caller(req)))

    @handler
    async def link(self, req: Request) -> Reply:
        raise OSError(errno.EPERM, "hard links are not supported (a manifest has one name)")

    @handler
    async def mknod(self, req: Request) -> Reply:
        mode, _, _, _ = abi.MKNOD_IN.unpack_from(req.body)
        name = _one_name(req, abi.MKNOD_IN.size)
        return entry(await self.fs.create_node(req.nodeid, name, mode, _caller(req)))

    # ----- files ----------------------------------------------------------------------------
    @handler
    async def create(self, req: Request) -> Reply:
        flags, mode, _, _ = abi.CREATE_IN.unpack_from(req.body)
        name = _one_name(req, abi.CREATE_IN.size)
        fh, attr = await self.fs.create(
            req.nodeid, name, mode, flags, _caller(req), direct=self._direct(flags)
        )
        # Its handle writes whatever the flags (the file is new): close must
        # send the FLUSH that commits it, even after O_CREAT | O_RDONLY.
        return [entry(attr), abi.open_out(fh, self._open_flags(flags, True, writes=True))]

    @handler
    async def open(self, req: Request) -> Reply:
        flags, _ = abi.OPEN_IN.unpack_from(req.body)
        fh, keep = await self.fs.open(req.nodeid, flags, _caller(req))
        return abi.open_out(fh, self._open_flags(flags, keep, _writes(flags)))

    @fast
    def open_now(self, req: Request) -> Reply | None:
        flags, _ = abi.OPEN_IN.unpack_from(req.body)
        return self._opened(flags, self.fs.open_now(req.nodeid, flags, _caller(req)))

    def _opened(self, flags: int, opened: tuple[int, bool] | None) -> Reply | None:
        """A read-only open's reply (None: declined)."""
        if opened is None:
            return None
        fh, keep = opened
        return abi.open_out(fh, self._open_flags(flags, keep, _writes(flags)))

    @handler
    async def read(self, req: Request) -> Reply:
        fh, off, size, *_ = abi.READ_IN.unpack_from(req.body)
        # Nothing may await between this return and the session's reply: the
        # result can be a view of an arena slot (see RangeReader.read).
        return await self.fs.read(fh, off, size)

    @fast
    def read_now(self, req: Request) -> Reply | None:
        fh, off, size, *_ = abi.READ_IN.unpack_from(req.body)
        return self.fs.read_now(fh, off, size)

    @handler
    async def write(self, req: Request) -> Reply:
        fh, off, size, *_ = abi.WRITE_IN.unpack_from(req.body)
        data = req.body[abi.WRITE_IN.size : abi.WRITE_IN.size + size]
        written = await self.fs.write(fh, off, data)
        return abi.WRITE_OUT.pack(written, 0)

    @handler
    async def flush(self, req: Request) -> Reply:
        await self.fs.flush(abi.FLUSH_IN.unpack_from(req.body)[0])
        return b""

    @fast
    def flush_now(self, req: Request) -> Reply | None:
        return b"" if self.fs.flush_now(abi.FLUSH_IN.unpack_from(req.body)[0]) else None

    @handler
    async def fsync(self, req: Request) -> Reply:
        await self.fs.fsync(abi.FSYNC_IN.unpack_from(req.body)[0])
        return b""

    @handler
    async def release(self, req: Request) -> Reply:
        await self.fs.release(abi.RELEASE_IN.unpack_from(req.body)[0])
        return b""

    @fast
    def release_now(self, req: Request) -> Reply | None:
        return b"" if self.fs.release_now(abi.RELEASE_IN.unpack_from(req.body)[0]) else None

    # ----- the filesystem -------------------------------------------------------------------
    @handler
    async def statfs(self, req: Request) -> Reply:
        return abi.statfs_out(await self.fs.statfs())

    @handler
    async def access(self, req: Request) -> Reply:
        return b""  # default_permissions: the kernel checks modes itself
