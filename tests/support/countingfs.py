"""A passthrough FUSE filesystem that counts the bytes read through it: the
tests' stand-in for the NFS backing store that several nodes share.

    python tests/support/countingfs.py REAL_DIR MOUNTPOINT --counters FILE.json

Every operation ckptfs daemons use on their backing directory is passed to
REAL_DIR: lookup, getattr, setattr (truncate, chmod, chown, utimens), readdir,
open, create, read, write, flush, fsync, fsyncdir, release, mkdir, rmdir,
unlink, rename (also over an existing name, and RENAME_NOREPLACE), symlink,
readlink, link, mknod, statfs. Files are opened with FUSE ``direct_io``, so
the kernel caches none of their pages: every byte any process on this
machine reads comes through ``read()`` and is counted, as on an NFS server
serving separate machines. O_DIRECT opens are accepted (NFS accepts them);
the real file is opened without it, since FUSE direct_io already bypasses
the page cache. Attributes and names are not cached either (timeouts 0), so
every daemon sees every other's changes at once.

The counters (``bytes_read``, ``reads``, ``chunk_bytes_read`` for reads under
``.ckptfs/chunks/``, ``bytes_written``, ``writes``) go to the JSON file every
100 ms when they changed, and at once on SIGUSR1. SIGTERM/SIGINT unmount.

Inode numbers are this filesystem's own, never reused while it runs: a name
that now names another real file (after a rename over it) gets a new number,
so the kernel never mistakes one file for another. Blocking calls on file
contents (read, write, fsync) run in worker threads, so one slow call does
not hold up every other daemon's requests.

With ``--read-mbps N`` the reads share one link of N MB/s (10^6 bytes per
second), served in the order they arrive, as the network link to an NFS
server is shared by the nodes of a cluster: a read's reply leaves once the
bytes of every read before it and its own have crossed that link. The
default, 0, is no limit.

With ``--faults FILE`` the store can be made to misbehave on command, as an
NFS server does (tests/cluster/faults/, the fault trials): the caller writes
``{"mode": M, "gen": N}`` to FILE and sends SIGUSR2; the mode holds from
then on, and ``FILE.ack`` says ``N`` once it does. Modes: ``ok`` (the
default), ``stall`` (every request waits until the mode changes: a hung
server), ``enospc`` (whatever would allocate space fails with ENOSPC: a full
store), ``eio`` (reads, writes and fsyncs of file contents fail with EIO:
a failing disk), and ``stall-files`` and ``eio-files``, which hit only opens
of files outside the store's own ``.ckptfs``. Without ``--faults`` nothing of this exists.

``counting_mount`` (below) runs it for a test and always unmounts and stops it.
"""

from __future__ import annotations

import argparse
import errno
import json
import logging
import os
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import pyfuse3
import trio
from mounts import is_mounted

log = logging.getLogger("countingfs")
T = TypeVar("T")
IO_THREADS = 16
PUBLISH_INTERVAL = 0.1
LINK_BURST = 4 << 20  # bytes of idle link time a reader may use at once (--read-mbps)
CHUNKS = os.path.join(".ckptfs", "chunks") + os.sep
GONE = "\0gone"  # the path of a node whose name went (no real path has a NUL)


class Link:
    """The store's one read link, shared by all readers, first come first served.

    A token bucket: a read waits until the bytes queued before it and its own
    have crossed at the link's rate. Up to LINK_BURST bytes of the time it
    stood idle are credited (a TCP window's worth), so that a timer that
    wakes a reader late (epoll's millisecond timeouts) does not take
    bandwidth away from a lone sequential reader.
    """

    def __init__(self, bytes_per_s: float) -> None:
        self.bytes_per_s = bytes_per_s
        self.free_at = 0.0  # when the bytes queued so far have crossed it (trio clock)

    async def carry(self, nbytes: int) -> None:
        if self.bytes_per_s <= 0:
            return
        now = trio.current_time()
        earliest = now - LINK_BURST / self.bytes_per_s
        self.free_at = max(self.free_at, earliest) + nbytes / self.bytes_per_s
        if self.free_at > now:
            await trio.sleep_until(self.free_at)


@dataclass
class Node:
    path: str  # relative to the real root ("" for the root)
    key: tuple[int, int]  # (st_dev, st_ino) of the real file it stands for
    nlookup: int = 0
    fds: set[int] = field(default_factory=set)  # open handles, for fstat once unlinked


@dataclass
class Counters:
    bytes_read: int = 0
    reads: int = 0
    chunk_bytes_read: int = 0
    bytes_written: int = 0
    writes: int = 0

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


# What each request is to the injected faults (--faults): every request
# waits out a stall; "alloc" requests fail on a full store, "data" requests
# (and writes) on a failing one. The "-files" modes hit only opens of the
# users' files (manifests), not of the store's own (.ckptfs: its key, chunks):
# a daemon starts, and its reads of manifests hang or fail.
FAULT_MODES = ("ok", "stall", "enospc", "eio", "stall-files", "eio-files")
STALLS = ("stall", "stall-files")
OWN = ".ckptfs"
ALLOC_OPS = {"create", "mkdir", "mknod", "symlink", "link", "rename", "write"}
DATA_OPS = {"read", "write", "fsync", "fsyncdir"}


class Faults:
    """The fault mode now in force; requests pass through :meth:`gate`."""

    def __init__(self) -> None:
        self.mode = "ok"
        self.resumed = trio.Event()
        self.resumed.set()

    def set(self, mode: str) -> None:
        if mode not in FAULT_MODES:
            raise ValueError(f"unknown fault mode {mode!r}")
        if mode in STALLS and self.mode not in STALLS:
            self.resumed = trio.Event()
        elif mode not in STALLS:
            self.resumed.set()
        self.mode = mode

    async def gate(self, op: str) -> None:
        if self.mode == "stall":
            await self.resumed.wait()
        if self.mode == "enospc" and op in ALLOC_OPS:
            raise pyfuse3.FUSEError(errno.ENOSPC)
        if self.mode == "eio" and op in DATA_OPS:
            raise pyfuse3.FUSEError(errno.EIO)

    async def gate_file(self, rel: str) -> None:
        """An open of ``rel``, in the "-files" modes."""
        if rel == OWN or rel.startswith(OWN + "/"):
            return
        if self.mode == "stall-files":
            await self.resumed.wait()
        if self.mode == "eio-files":
            raise pyfuse3.FUSEError(errno.EIO)


def fuse_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """OSError -> its errno; anything else -> EIO, logged (pyfuse3 answers only
    FUSEError). Every request first passes the injected faults' gate."""

    async def wrapper(*args: Any) -> Any:
        try:
            await args[0].faults.gate(fn.__name__)
            return await fn(*args)
        except pyfuse3.FUSEError:
            raise
        except OSError as exc:
            raise pyfuse3.FUSEError(exc.errno or errno.EIO) from None
        except Exception:
            log.exception("%s%r failed", fn.__name__, args[1:])
            raise pyfuse3.FUSEError(errno.EIO) from None

    wrapper.__name__ = fn.__name__
    return wrapper


class CountingFS(pyfuse3.Operations):
    supports_dot_lookup = False

    def __init__(self, real: Path, read_link: Link | None = None) -> None:
        super().__init__()
        self.real = str(real)
        self.read_link = read_link or Link(0)
        st = os.lstat(self.real)
        self.nodes: dict[int, Node] = {
            pyfuse3.ROOT_INODE: Node("", (st.st_dev, st.st_ino), nlookup=1)
        }
        self.by_path: dict[str, int] = {"": pyfuse3.ROOT_INODE}
        self.next_ino = pyfuse3.ROOT_INODE + 1
        self.fd_node: dict[int, int] = {}  # open fd -> inode
        self.fd_chunk: set[int] = set()  # open fds of chunk files
        # Open directories: a listing taken at opendir (stable offsets) and the path.
        self.dirs: dict[int, list[tuple[str, os.stat_result]]] = {}
        self.dir_paths: dict[int, str] = {}
        self.next_dir = 1
        self.counters = Counters()
        self.limiter = trio.CapacityLimiter(IO_THREADS)
        self.faults = Faults()

    # ----- helpers ----------------------------------------------------------
    def _real(self, rel: str) -> str:
        if GONE in rel:  # a node whose name went, or a name beneath it
            raise pyfuse3.FUSEError(errno.ESTALE)
        return os.path.join(self.real, rel) if rel else self.real

    def _node(self, inode: int) -> Node:
        node = self.nodes.get(inode)
        if node is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        return node

    def _child(self, parent: int, name: bytes) -> str:
        base = self._node(parent).path
        text = os.fsdecode(name)
        return os.path.join(base, text) if base else text

    def _entry(self, rel: str, st: os.stat_result) -> pyfuse3.EntryAttributes:
        """The attributes of ``rel``, with its inode number (new if it is a new file)."""
        key = (st.st_dev, st.st_ino)
        ino = self.by_path.get(rel)
        if ino is None or self.nodes[ino].key != key:
            ino = self.next_ino
            self.next_ino += 1
            self.nodes[ino] = Node(rel, key)
            self.by_path[rel] = ino
        return self._attrs(ino, st)

    def _attrs(self, ino: int, st: os.stat_result) -> pyfuse3.EntryAttributes:
        e = pyfuse3.EntryAttributes()
        e.st_ino = ino
        e.generation = 0
        e.entry_timeout = 0
        e.attr_timeout = 0
        for name in ("st_mode", "st_nlink", "st_uid", "st_gid", "st_rdev", "st_size"):
            setattr(e, name, getattr(st, name))
        e.st_blksize = st.st_blksize
        e.st_blocks = st.st_blocks
        e.st_atime_ns, e.st_mtime_ns, e.st_ctime_ns = st.st_atime_ns, st.st_mtime_ns, st.st_ctime_ns
        return e

    def _lookup(self, rel: str) -> pyfuse3.EntryAttributes:
        """Like a kernel lookup: the entry, its lookup count up by one."""
        e = self._entry(rel, os.lstat(self._real(rel)))
        self.nodes[e.st_ino].nlookup += 1
        return e

    def _stat(self, node: Node) -> os.stat_result:
        if node.path != GONE:
            try:
                st = os.lstat(self._real(node.path))
                if (st.st_dev, st.st_ino) == node.key:
                    return st
            except FileNotFoundError:
                pass
        for fd in node.fds:  # unlinked or replaced, still open
            return os.fstat(fd)
        # A file renamed over by another name has no name left: as an NFS
        # server says of such a handle (the kernel looks the name up again).
        raise pyfuse3.FUSEError(errno.ESTALE if node.path == GONE else errno.ENOENT)

    def _moved(self, old: str, new: str) -> None:
        """Names under ``old`` are now under ``new`` (after a rename)."""
        replaced = self.by_path.pop(new, None)
        if replaced is not None and replaced in self.nodes and self.nodes[replaced].path == new:
            self.nodes[replaced].path = GONE  # keeps only its open fds
        prefix = old + os.sep
        for rel in [r for r in self.by_path if r == old or r.startswith(prefix)]:
            ino = self.by_path.pop(rel)
            moved = new + rel[len(old) :]
            self.by_path[moved] = ino
            self.nodes[ino].path = moved

    def _gone(self, rel: str) -> None:
        ino = self.by_path.pop(rel, None)
        if ino is not None and ino in self.nodes:
            self.nodes[ino].path = GONE

    async def _io(self, fn: Callable[..., T], *args: Any) -> T:
        return await trio.to_thread.run_sync(fn, *args, limiter=self.limiter)

    # ----- names and attributes ---------------------------------------------------
    @fuse_errors
    async def lookup(self, parent: int, name: bytes, ctx: Any = None) -> pyfuse3.EntryAttributes:
        return self._lookup(self._child(parent, name))

    def forget(self, inode_list: list[tuple[int, int]]) -> None:
        for ino, count in inode_list:
            node = self.nodes.get(ino)
            if node is None or ino == pyfuse3.ROOT_INODE:
                continue
            node.nlookup -= count
            if node.nlookup <= 0 and not node.fds:
                del self.nodes[ino]
                if self.by_path.get(node.path) == ino:
                    del self.by_path[node.path]

    @fuse_errors
    async def getattr(self, inode: int, ctx: Any = None) -> pyfuse3.EntryAttributes:
        return self._attrs(inode, self._stat(self._node(inode)))

    @fuse_errors
    async def setattr(
        self, inode: int, attr: Any, fields: Any, fh: int | None, ctx: Any
    ) -> pyfuse3.EntryAttributes:
        node = self._node(inode)
        path = self._real(node.path)
        target: int | str = fh if fh is not None else path
        if fields.update_size:
            await self._io(os.truncate, target, attr.st_size)
        if fields.update_mode:
            os.chmod(target, stat.S_IMODE(attr.st_mode))
        if fields.update_uid or fields.update_gid:
            uid = attr.st_uid if fields.update_uid else -1
            gid = attr.st_gid if fields.update_gid else -1
            if isinstance(target, int):
                os.fchown(target, uid, gid)
            else:
                os.chown(target, uid, gid, follow_symlinks=False)
        if fields.update_atime or fields.update_mtime:
            st = self._stat(node)
            atime = attr.st_atime_ns if fields.update_atime else st.st_atime_ns
            mtime = attr.st_mtime_ns if fields.update_mtime else st.st_mtime_ns
            if isinstance(target, int):
                os.utime(target, ns=(atime, mtime))
            else:
                os.utime(target, ns=(atime, mtime), follow_symlinks=False)
        return self._attrs(inode, self._stat(node))

    @fuse_errors
    async def readlink(self, inode: int, ctx: Any) -> bytes:
        return os.fsencode(os.readlink(self._real(self._node(inode).path)))

    @fuse_errors
    async def statfs(self, ctx: Any) -> pyfuse3.StatvfsData:
        st = os.statvfs(self.real)
        out = pyfuse3.StatvfsData()
        for name in ("f_bsize", "f_frsize", "f_blocks", "f_bfree", "f_bavail", "f_files",
                     "f_ffree", "f_favail", "f_namemax"):  # fmt: skip
            setattr(out, name, getattr(st, name))
        return out

    @fuse_errors
    async def access(self, inode: int, mode: int, ctx: Any) -> bool:
        return True  # the daemons run as root

    # ----- directories --------------------------------------------------------------
    def _listing(self, rel: str) -> list[tuple[str, os.stat_result]]:
        entries = []
        with os.scandir(self._real(rel)) as it:
            for d in it:
                try:
                    entries.append((d.name, d.stat(follow_symlinks=False)))
                except FileNotFoundError:
                    continue  # removed meanwhile
        entries.sort()
        return entries

    @fuse_errors
    async def opendir(self, inode: int, ctx: Any) -> int:
        rel = self._node(inode).path
        fh = self.next_dir
        self.next_dir += 1
        self.dirs[fh] = self._listing(rel)
        self.dir_paths[fh] = rel
        return fh

    @fuse_errors
    async def readdir(self, fh: int, start_id: int, token: Any) -> None:
        parent = self.dir_paths.get(fh, "")
        if start_id == 0 and fh in self.dirs:
            # A listing from the start (a rewinddir of a directory kept
            # open) is taken anew, as an NFS server answers READDIR from
            # cookie 0 with the directory as it is now.
            self.dirs[fh] = self._listing(parent)
        entries = self.dirs.get(fh, [])
        for i in range(start_id, len(entries)):
            name, st = entries[i]
            rel = os.path.join(parent, name) if parent else name
            e = self._entry(rel, st)
            if not pyfuse3.readdir_reply(token, os.fsencode(name), e, i + 1):
                break
            self.nodes[e.st_ino].nlookup += 1

    @fuse_errors
    async def releasedir(self, fh: int) -> None:
        self.dirs.pop(fh, None)
        self.dir_paths.pop(fh, None)

    @fuse_errors
    async def fsyncdir(self, fh: int, datasync: bool) -> None:
        path = self._real(self.dir_paths.get(fh, ""))

        def sync() -> None:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

        await self._io(sync)

    @fuse_errors
    async def mkdir(self, parent: int, name: bytes, mode: int, ctx: Any) -> Any:
        rel = self._child(parent, name)
        os.mkdir(self._real(rel), mode)
        return self._lookup(rel)

    @fuse_errors
    async def rmdir(self, parent: int, name: bytes, ctx: Any) -> None:
        rel = self._child(parent, name)
        os.rmdir(self._real(rel))
        self._gone(rel)

    @fuse_errors
    async def unlink(self, parent: int, name: bytes, ctx: Any) -> None:
        rel = self._child(parent, name)
        os.unlink(self._real(rel))
        self._gone(rel)

    @fuse_errors
    async def rename(
        self, p_old: int, old: bytes, p_new: int, new: bytes, flags: int, ctx: Any
    ) -> None:
        src, dst = self._child(p_old, old), self._child(p_new, new)
        if flags & pyfuse3.RENAME_EXCHANGE:
            raise pyfuse3.FUSEError(errno.EINVAL)
        if flags & pyfuse3.RENAME_NOREPLACE and os.path.lexists(self._real(dst)):
            raise pyfuse3.FUSEError(errno.EEXIST)
        os.rename(self._real(src), self._real(dst))
        self._moved(src, dst)

    @fuse_errors
    async def symlink(self, parent: int, name: bytes, target: bytes, ctx: Any) -> Any:
        rel = self._child(parent, name)
        os.symlink(target, self._real(rel))
        return self._lookup(rel)

    @fuse_errors
    async def link(self, inode: int, new_parent: int, new_name: bytes, ctx: Any) -> Any:
        rel = self._child(new_parent, new_name)
        os.link(self._real(self._node(inode).path), self._real(rel))
        st = os.lstat(self._real(rel))
        self.nodes[inode].nlookup += 1
        return self._attrs(inode, st)

    @fuse_errors
    async def mknod(self, parent: int, name: bytes, mode: int, rdev: int, ctx: Any) -> Any:
        rel = self._child(parent, name)
        os.mknod(self._real(rel), mode, rdev)
        return self._lookup(rel)

    # ----- file contents ------------------------------------------------------------
    def _opened(self, ino: int, fd: int, rel: str) -> pyfuse3.FileInfo:
        self.nodes[ino].fds.add(fd)
        self.fd_node[fd] = ino
        if rel.startswith(CHUNKS):
            self.fd_chunk.add(fd)
        # direct_io: no page cache, so every read by anyone on this machine is counted.
        return pyfuse3.FileInfo(fh=fd, direct_io=True, keep_cache=False)

    @fuse_errors
    async def open(self, inode: int, flags: int, ctx: Any) -> pyfuse3.FileInfo:
        node = self._node(inode)
        await self.faults.gate_file(node.path)
        fd = await self._io(os.open, self._real(node.path), _real_flags(flags))
        return self._opened(inode, fd, node.path)

    @fuse_errors
    async def create(
        self, parent: int, name: bytes, mode: int, flags: int, ctx: Any
    ) -> tuple[pyfuse3.FileInfo, pyfuse3.EntryAttributes]:
        rel = self._child(parent, name)
        fd = await self._io(os.open, self._real(rel), _real_flags(flags) | os.O_CREAT, mode)
        e = self._entry(rel, os.fstat(fd))
        self.nodes[e.st_ino].nlookup += 1
        return self._opened(e.st_ino, fd, rel), e

    @fuse_errors
    async def read(self, fh: int, off: int, size: int) -> bytes:
        data = await self._io(os.pread, fh, size, off)
        await self.read_link.carry(len(data))
        c = self.counters
        c.reads += 1
        c.bytes_read += len(data)
        if fh in self.fd_chunk:
            c.chunk_bytes_read += len(data)
        return data

    @fuse_errors
    async def write(self, fh: int, off: int, buf: bytes) -> int:
        n = await self._io(os.pwrite, fh, buf, off)
        self.counters.writes += 1
        self.counters.bytes_written += n
        return n

    @fuse_errors
    async def flush(self, fh: int) -> None:
        return None

    @fuse_errors
    async def fsync(self, fh: int, datasync: bool) -> None:
        await self._io(os.fdatasync if datasync else os.fsync, fh)

    @fuse_errors
    async def release(self, fh: int) -> None:
        ino = self.fd_node.pop(fh, None)
        self.fd_chunk.discard(fh)
        node = self.nodes.get(ino) if ino is not None else None
        if node is not None:
            node.fds.discard(fh)
        os.close(fh)


def _real_flags(flags: int) -> int:
    # O_DIRECT would need aligned buffers here; FUSE direct_io already skips
    # the page cache. O_CREAT/O_EXCL are for create() only.
    return (flags & ~(os.O_DIRECT | os.O_CREAT | os.O_EXCL | os.O_NOCTTY)) | os.O_CLOEXEC


# ----- running it -----------------------------------------------------------------------
async def publish(fs: CountingFS, path: Path) -> None:
    """Write the counters to ``path`` every 100 ms when they changed, and on SIGUSR1."""
    last: dict[str, int] | None = None
    with trio.open_signal_receiver(signal.SIGUSR1) as signals:
        while True:
            now = fs.counters.as_dict()
            if now != last:
                tmp = path.with_name(path.name + ".tmp")
                tmp.write_text(json.dumps(now))
                os.replace(tmp, path)
                last = now
            with trio.move_on_after(PUBLISH_INTERVAL):
                async for _ in signals:
                    last = None  # write now, even unchanged
                    break


async def take_faults(fs: CountingFS, path: Path) -> None:
    """On SIGUSR2: the mode written in ``path`` holds from now on; ``path.ack``
    names its generation once it does."""
    with trio.open_signal_receiver(signal.SIGUSR2) as signals:
        async for _ in signals:
            try:
                order = json.loads(path.read_text())
                fs.faults.set(str(order["mode"]))
            except (OSError, ValueError, KeyError, TypeError) as exc:
                log.warning("bad fault order in %s: %s", path, exc)
                continue
            ack = path.with_name(path.name + ".ack")
            tmp = ack.with_name(ack.name + ".tmp")
            tmp.write_text(json.dumps({"mode": fs.faults.mode, "gen": order.get("gen")}))
            os.replace(tmp, ack)


async def run(
    real: Path, mountpoint: Path, counters: Path, read_mbps: float = 0, faults: Path | None = None
) -> None:
    fs = CountingFS(real, Link(read_mbps * 1e6))
    options = set(pyfuse3.default_options) | {"fsname=countingfs", "allow_other"}
    options.discard("default_permissions")
    pyfuse3.init(fs, str(mountpoint), options)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(publish, fs, counters)
            if faults is not None:
                nursery.start_soon(take_faults, fs, faults)

            async def stop_on_signal() -> None:
                with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                    async for _ in signals:
                        pyfuse3.terminate()
                        return

            nursery.start_soon(stop_on_signal)
            await pyfuse3.main(min_tasks=4, max_tasks=64)
            nursery.cancel_scope.cancel()
    finally:
        pyfuse3.close(unmount=True)
        tmp = counters.with_name(counters.name + ".tmp")
        tmp.write_text(json.dumps(fs.counters.as_dict()))
        os.replace(tmp, counters)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("real", type=Path)
    parser.add_argument("mountpoint", type=Path)
    parser.add_argument("--counters", type=Path, required=True)
    parser.add_argument(
        "--read-mbps", type=float, default=0, help="the shared read link's MB/s (0: no limit)"
    )
    parser.add_argument(
        "--faults", type=Path, help="a file of fault orders, read on SIGUSR2 (see above)"
    )
    args = parser.parse_args(argv)
    if args.read_mbps < 0:
        parser.error("--read-mbps must not be negative")
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s countingfs: %(message)s")
    trio.run(
        run,
        args.real.resolve(),
        args.mountpoint.resolve(),
        args.counters.resolve(),
        args.read_mbps,
        args.faults.resolve() if args.faults else None,
    )
    return 0


# ----- for tests ------------------------------------------------------------------------
class CountingMount:
    def __init__(
        self,
        real: Path,
        mountpoint: Path,
        counters: Path,
        proc: subprocess.Popen,
        faults: Path | None = None,
    ) -> None:
        self.real, self.mountpoint, self.counters_path, self.proc = real, mountpoint, counters, proc
        self.faults_path = faults
        self.fault_gen = 0

    def inject(self, mode: str, timeout: float = 10.0) -> None:
        """Put the store in fault ``mode`` (FAULT_MODES); returns once it holds."""
        if self.faults_path is None:
            raise AssertionError("countingfs was started without --faults")
        self.fault_gen += 1
        gen = self.fault_gen
        tmp = self.faults_path.with_name(self.faults_path.name + ".tmp")
        tmp.write_text(json.dumps({"mode": mode, "gen": gen}))
        os.replace(tmp, self.faults_path)
        ack = self.faults_path.with_name(self.faults_path.name + ".ack")
        self.proc.send_signal(signal.SIGUSR2)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if json.loads(ack.read_text()).get("gen") == gen:
                    return
            except (OSError, ValueError):
                pass
            time.sleep(0.01)
        raise AssertionError(f"countingfs at {self.mountpoint} did not take mode {mode!r}")

    def counters(self, timeout: float = 10.0) -> dict[str, int]:
        """The counters now: asks for a fresh write (SIGUSR1) and waits for it."""
        before = self.counters_path.stat().st_mtime_ns if self.counters_path.exists() else 0
        self.proc.send_signal(signal.SIGUSR1)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.counters_path.exists() and self.counters_path.stat().st_mtime_ns != before:
                break
            time.sleep(0.02)
        else:
            raise AssertionError(f"countingfs at {self.mountpoint} wrote no counters in {timeout}s")
        return dict(json.loads(self.counters_path.read_text()))


@contextmanager
def counting_mount(
    real: Path, mountpoint: Path, timeout: float = 30.0, faults: bool = False
) -> Iterator[CountingMount]:
    """Mount countingfs of ``real`` at ``mountpoint``; always unmount and stop
    it. With ``faults``, :meth:`CountingMount.inject` can make it misbehave."""
    real.mkdir(parents=True, exist_ok=True)
    mountpoint.mkdir(parents=True, exist_ok=True)
    counters = mountpoint.parent / f"{mountpoint.name}.counters.json"
    log_path = mountpoint.parent / f"{mountpoint.name}.countingfs.log"
    argv = [sys.executable, __file__, str(real), str(mountpoint), "--counters", str(counters)]
    faults_path = mountpoint.parent / f"{mountpoint.name}.faults.json" if faults else None
    if faults_path is not None:
        argv += ["--faults", str(faults_path)]
    with open(log_path, "ab") as log_file:
        proc = subprocess.Popen(argv, stdout=log_file, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + timeout
        while not (is_mounted(mountpoint.resolve()) and counters.exists()):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"countingfs did not mount: {log_path.read_text()}")
            time.sleep(0.05)
        yield CountingMount(real, mountpoint, counters, proc, faults_path)
    finally:
        if faults_path is not None and proc.poll() is None:
            try:  # a stalled store would hold up the unmount's requests
                CountingMount(real, mountpoint, counters, proc, faults_path).inject("ok")
            except AssertionError:
                pass
        if is_mounted(mountpoint.resolve()):
            subprocess.run(["fusermount3", "-u", "-z", str(mountpoint)], capture_output=True,
                           timeout=30)  # fmt: skip
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.terminate()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)


if __name__ == "__main__":
    sys.exit(main())
