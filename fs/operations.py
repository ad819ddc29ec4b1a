"""The FUSE operations: each a short translation onto :class:`FileSystem`.

pyfuse3 only turns ``FUSEError`` into an errno; any other exception would
leave the request unanswered and take the mount down. Every handler is
therefore wrapped: OSErrors keep their errno, anything else becomes EIO and is
logged with the operation and its arguments.
"""

from __future__ import annotations

import errno
import functools
import logging
import os
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import pyfuse3

from .cpulatency import CpuLatencyHold
from .filesystem import Attr, Caller, FileSystem, SetAttr

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
}
_seen: set[tuple[str, int]] = set()


def _log_failure(op: str, args: tuple[Any, ...], exc: OSError, err: int) -> None:
    if op == "lookup" and err == errno.ENOENT:
        return  # every create and exists() starts with one: not even a refusal
    if err in EXPECTED:
        first = (op, err) not in _seen
        _seen.add((op, err))
        log.log(
            logging.INFO if first else logging.DEBUG,
            "%s%r refused: %s%s",
            op,
            _short(args),
            exc,
            " (logged once per kind; more at DEBUG)" if first else "",
        )
    elif not getattr(exc, "logged", False):
        log.warning("%s%r failed: %s", op, _short(args), exc)


def handler(fn: Callable[..., Awaitable[T]]) -> Callable[..., Awaitable[T]]:
    @functools.wraps(fn)
    async def wrapper(self: Operations, *args: Any) -> T:
        self.cpu_latency.touch()
        try:
            return await fn(self, *args)
        except pyfuse3.FUSEError as exc:
            _log_failure(fn.__name__, args, OSError(exc.errno, os.strerror(exc.errno)), exc.errno)
            raise
        except OSError as exc:
            err = exc.errno or errno.EIO
            _log_failure(fn.__name__, args, exc, err)
            raise pyfuse3.FUSEError(err) from None
        except Exception:
            log.exception("%s%r failed unexpectedly", fn.__name__, _short(args))
            raise pyfuse3.FUSEError(errno.EIO) from None

    return wrapper


def _short(args: tuple[Any, ...]) -> tuple[Any, ...]:
    return tuple(
        f"<{len(a)} bytes>" if isinstance(a, bytes) and len(a) > 64 else a
        for a in args
        if not hasattr(a, "uid")  # the request context
    )


def _caller(ctx: Any) -> Caller:
    return Caller(ctx.uid, ctx.gid)


def _name(raw: bytes) -> str:
    return os.fsdecode(raw)


def entry(attr: Attr) -> pyfuse3.EntryAttributes:
    e = pyfuse3.EntryAttributes()
    e.st_ino = attr.ino
    e.generation = 0
    e.entry_timeout = ATTR_TIMEOUT
    e.attr_timeout = ATTR_TIMEOUT
    e.st_mode = attr.mode
    e.st_nlink = attr.nlink
    e.st_uid = attr.uid
    e.st_gid = attr.gid
    e.st_rdev = 0
    e.st_size = attr.size
    e.st_blksize = attr.blksize
    e.st_blocks = -(-attr.size // 512)
    e.st_atime_ns = attr.atime_ns
    e.st_mtime_ns = attr.mtime_ns
    e.st_ctime_ns = attr.ctime_ns
    return e


class Operations(pyfuse3.Operations):
    def __init__(
        self,
        fs: FileSystem,
        writeback_cache: bool,
        direct_writes: bool = True,
        cpu_latency: CpuLatencyHold | None = None,
    ) -> None:
        super().__init__()
        self.fs = fs
        self.cpu_latency = cpu_latency or CpuLatencyHold(0)
        self.enable_writeback_cache = writeback_cache
        self.direct_writes = direct_writes

    def _direct(self, flags: int) -> bool:
        return self.direct_writes and (flags & os.O_ACCMODE) == os.O_WRONLY

    @handler
    async def lookup(self, parent: int, name: bytes, ctx: Any = None) -> pyfuse3.EntryAttributes:
        return entry(await self.fs.lookup(parent, _name(name)))

    @handler
    async def getattr(self, inode: int, ctx: Any = None) -> pyfuse3.EntryAttributes:
        return entry(await self.fs.getattr(inode))

    @handler
    async def setattr(
        self, inode: int, attr: Any, fields: Any, fh: int | None, ctx: Any
    ) -> pyfuse3.EntryAttributes:
        change = SetAttr(
            mode=attr.st_mode if fields.update_mode else None,
            uid=attr.st_uid if fields.update_uid else None,
            gid=attr.st_gid if fields.update_gid else None,
            size=attr.st_size if fields.update_size else None,
            atime_ns=attr.st_atime_ns if fields.update_atime else None,
            mtime_ns=attr.st_mtime_ns if fields.update_mtime else None,
        )
        return entry(await self.fs.setattr(inode, change, _caller(ctx)))

    def forget(self, inode_list: Sequence[tuple[int, int]]) -> None:
        for ino, count in inode_list:
            try:
                self.fs.forget(ino, count)
            except Exception:
                log.exception("forget of inode %d failed", ino)

    @handler
    async def readlink(self, inode: int, ctx: Any) -> bytes:
        return await self.fs.readlink(inode)

    @handler
    async def opendir(self, inode: int, ctx: Any) -> int:
        return await self.fs.opendir(inode)

    @handler
    async def readdir(self, fh: int, start_id: int, token: Any) -> None:
        entries = await self.fs.readdir(fh, start_id)
        for i, (name, attr) in enumerate(entries):
            if not pyfuse3.readdir_reply(token, os.fsencode(name), entry(attr), start_id + i + 1):
                # The kernel's buffer is full: it holds no reference to these yet.
                for _, unsent in entries[i:]:
                    self.fs.forget(unsent.ino, 0)
                break
            self.fs.inodes[attr.ino].nlookup += 1

    @handler
    async def releasedir(self, fh: int) -> None:
        self.fs.releasedir(fh)

    @handler
    async def mkdir(self, parent: int, name: bytes, mode: int, ctx: Any) -> Any:
        return entry(await self.fs.mkdir(parent, _name(name), mode, _caller(ctx)))

    @handler
    async def rmdir(self, parent: int, name: bytes, ctx: Any) -> None:
        await self.fs.rmdir(parent, _name(name))

    @handler
    async def unlink(self, parent: int, name: bytes, ctx: Any) -> None:
        await self.fs.unlink(parent, _name(name))

    @handler
    async def rename(
        self, p_old: int, old: bytes, p_new: int, new: bytes, flags: int, ctx: Any
    ) -> None:
        await self.fs.rename(p_old, _name(old), p_new, _name(new), flags)

    @handler
    async def symlink(self, parent: int, name: bytes, target: bytes, ctx: Any) -> Any:
        return entry(await self.fs.symlink(parent, _name(name), target, _caller(ctx)))

    @handler
    async def link(self, inode: int, new_parent: int, new_name: bytes, ctx: Any) -> Any:
        raise OSError(errno.EPERM, "hard links are not supported (a manifest has one name)")

    @handler
    async def mknod(self, parent: int, name: bytes, mode: int, rdev: int, ctx: Any) -> Any:
        return entry(await self.fs.create_node(parent, _name(name), mode, _caller(ctx)))

    @handler
    async def create(
        self, parent: int, name: bytes, mode: int, flags: int, ctx: Any
    ) -> tuple[pyfuse3.FileInfo, pyfuse3.EntryAttributes]:
        fh, attr = await self.fs.create(parent, _name(name), mode, flags, _caller(ctx))
        return pyfuse3.FileInfo(fh=fh, keep_cache=True, direct_io=self._direct(flags)), entry(attr)

    @handler
    async def open(self, inode: int, flags: int, ctx: Any) -> pyfuse3.FileInfo:
        fh, keep = await self.fs.open(inode, flags, _caller(ctx))
        return pyfuse3.FileInfo(fh=fh, keep_cache=keep, direct_io=self._direct(flags))

    @handler
    async def read(self, fh: int, off: int, size: int) -> bytes | memoryview:
        # Nothing may await between this return and pyfuse3's reply: the
        # result can be a view of an arena slot (see RangeReader.read).
        return await self.fs.read(fh, off, size)

    @handler
    async def write(self, fh: int, off: int, buf: bytes) -> int:
        return await self.fs.write(fh, off, buf)

    @handler
    async def flush(self, fh: int) -> None:
        await self.fs.flush(fh)

    @handler
    async def fsync(self, fh: int, datasync: bool) -> None:
        await self.fs.fsync(fh)

    @handler
    async def release(self, fh: int) -> None:
        await self.fs.release(fh)

    @handler
    async def fsyncdir(self, fh: int, datasync: bool) -> None:
        return None  # directory changes are applied to the backing store synchronously

    @handler
    async def statfs(self, ctx: Any) -> pyfuse3.StatvfsData:
        st = await self.fs.statfs()
        out = pyfuse3.StatvfsData()
        for name in (
            "f_bsize",
            "f_frsize",
            "f_blocks",
            "f_bfree",
            "f_bavail",
            "f_files",
            "f_ffree",
            "f_favail",
            "f_namemax",
        ):
            setattr(out, name, getattr(st, name))
        return out

    @handler
    async def access(self, inode: int, mode: int, ctx: Any) -> bool:
        return True  # default_permissions: the kernel checks modes itself
