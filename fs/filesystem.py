"""The filesystem's logic, free of pyfuse3 types so it can be tested directly.

Names live in the backing directory (:mod:`backing`); file contents live in
the cache (:mod:`cache`) and are persisted by the flusher. Close and fsync are
the durability points: the file's manifest is published (``pending``), the
file is queued for flushing, and at ``durability: backing`` the call waits
until the manifest is ``durable``.
"""

from __future__ import annotations

import errno
import itertools
import logging
import os
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import trio

from .backing import Backing, Entry
from .cache import Cache, FileLost
from .cachedfile import DURABLE, LOST, CachedFile
from .config import Config
from .flusher import Flusher
from .inodes import ROOT, Inode, InodeTable
from .manifest import Manifest, new_id

log = logging.getLogger("ckptfs.fs")


class FsError(OSError):
    """An error for the caller with an errno (becomes the FUSE reply)."""

    def __init__(self, err: int, message: str = "") -> None:
        super().__init__(err, message or os.strerror(err))


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


@dataclass
class Handle:
    inode: Inode
    file: CachedFile | None = None
    plain_fd: int | None = None
    writable: bool = False


@dataclass
class SetAttr:
    mode: int | None = None
    uid: int | None = None
    gid: int | None = None
    size: int | None = None
    atime_ns: int | None = None
    mtime_ns: int | None = None


class FileSystem:
    def __init__(self, config: Config, backing: Backing, cache: Cache, flusher: Flusher) -> None:
        self.config = config
        self.node = config.node
        self.backing = backing
        self.cache = cache
        self.flusher = flusher
        self.inodes = InodeTable()
        self.handles: dict[int, Handle] = {}
        self.dir_handles: dict[int, tuple[int, list[tuple[str, Entry]] | None]] = {}
        self._fh = itertools.count(1)
        self.ns_lock = trio.Lock()  # path-dependent backing updates (rename vs. publish)
        cache.referenced = self._referenced
        self.on_publish: list[Any] = []  # hooks: async fn(CachedFile), after a publish
        self.on_modify: list[Any] = []  # hooks: async fn(CachedFile), before a published
        # file changes or goes away

    # ----- attributes -------------------------------------------------------
    def _attr(self, inode: Inode, entry: Entry | None) -> Attr:
        f = inode.file
        st = entry.st if entry else None
        if inode.kind == "file" and f is not None and (entry is None or self._local(f, entry)):
            mode, size, mtime = stat.S_IFREG | f.mode, f.size, f.mtime_ns
        elif entry is not None and entry.manifest is not None:
            m = entry.manifest
            mode, size, mtime = stat.S_IFREG | (m.mode & 0o7777), m.size, m.mtime_ns
        elif st is not None:
            mode, size, mtime = st.st_mode, st.st_size, st.st_mtime_ns
        else:
            raise FsError(errno.ENOENT)
        now = time.time_ns()
        return Attr(
            ino=inode.ino,
            mode=mode,
            size=size,
            nlink=0 if inode.unlinked else (st.st_nlink if st and inode.kind == "dir" else 1),
            uid=st.st_uid if st else 0,
            gid=st.st_gid if st else 0,
            atime_ns=st.st_atime_ns if st else now,
            mtime_ns=mtime,
            ctime_ns=st.st_ctime_ns if st else now,
        )

    @staticmethod
    def _local(f: CachedFile, entry: Entry) -> bool:
        """Whether our cached copy, not the manifest, is authoritative for attributes."""
        m = entry.manifest
        return (
            m is not None
            and m.file_id == f.file_id
            and (f.handles > 0 or f.gen != f.published_gen or f.version == m.version)
        )

    async def _entry(self, path: str) -> Entry:
        try:
            return await self.backing.entry(path)
        except FileNotFoundError:
            raise FsError(errno.ENOENT) from None

    def _bind(self, parent: int, name: str, entry: Entry) -> Inode:
        inode = self.inodes.bind(parent, name, entry.kind, entry.ident)
        if entry.manifest is not None and inode.file is None:
            inode.file = self.cache.files.get(entry.manifest.file_id)
            if inode.file is not None:
                inode.file.ino = inode.ino
        return inode

    async def lookup(self, parent: int, name: str) -> Attr:
        path = self.inodes.child_path(parent, name)
        entry = await self._entry(path)
        inode = self._bind(parent, name, entry)
        inode.nlookup += 1
        return self._attr(inode, entry)

    async def getattr(self, ino: int) -> Attr:
        inode = self._inode(ino)
        if inode.unlinked:
            return self._attr(inode, None)
        if inode.kind == "file" and inode.file is not None and inode.file.handles:
            return self._attr(inode, None)  # open here: our copy is current
        try:
            entry = await self.backing.entry(self.inodes.path(ino))
        except FileNotFoundError:
            if inode.file is not None:
                return self._attr(inode, None)
            raise FsError(errno.ENOENT) from None
        same = entry.ident == inode.ident or ino == ROOT
        return self._attr(inode, entry if same else None)

    def _inode(self, ino: int) -> Inode:
        inode = self.inodes.get(ino)
        if inode is None:
            raise FsError(errno.ENOENT, f"unknown inode {ino}")
        return inode

    def _referenced(self, f: CachedFile) -> bool:
        inode = self.inodes.get(f.ino) if f.ino is not None else None
        return inode is not None and inode.file is f

    def forget(self, ino: int, count: int) -> None:
        freed = self.inodes.forget(ino, count)
        if freed is not None and freed.file is not None:
            self._maybe_drop(freed.file)

    def _maybe_drop(self, f: CachedFile) -> None:
        if f.unlinked and f.handles == 0:
            self.cache.drop(f)

    # ----- directories ------------------------------------------------------
    async def opendir(self, ino: int) -> int:
        if self._inode(ino).kind != "dir":
            raise FsError(errno.ENOTDIR)
        fh = next(self._fh)
        self.dir_handles[fh] = (ino, None)
        return fh

    async def readdir(self, fh: int, start: int) -> list[tuple[str, Attr]]:
        """Entries from offset ``start``; the listing is taken once per opendir."""
        ino, listing = self.dir_handles[fh]
        if listing is None:
            listing = await self.backing.listdir(self.inodes.path(ino))
            self.dir_handles[fh] = (ino, listing)
        result = []
        for name, entry in listing[start:]:
            # The listing may be older than what lookup saw since: an inode the
            # kernel already knows is kept, never replaced from the snapshot.
            inode = self.inodes.child(ino, name) or self._bind(ino, name, entry)
            result.append((name, self._attr(inode, entry)))
        return result

    def releasedir(self, fh: int) -> None:
        self.dir_handles.pop(fh, None)

    async def mkdir(self, parent: int, name: str, mode: int, uid: int, gid: int) -> Attr:
        path = self.inodes.child_path(parent, name)
        await self.backing.mkdir(path, mode & 0o7777)
        await self._chown_new(path, uid, gid)
        return await self.lookup(parent, name)

    async def _chown_new(self, path: str, uid: int, gid: int) -> None:
        if os.geteuid() == 0 and (uid or gid):
            await self.backing.chown(path, uid, gid)

    async def rmdir(self, parent: int, name: str) -> None:
        path = self.inodes.child_path(parent, name)
        entry = await self._entry(path)
        if entry.kind != "dir":
            raise FsError(errno.ENOTDIR)
        await self.backing.rmdir(path)
        self.inodes.detach(parent, name)

    async def symlink(self, parent: int, name: str, target: bytes, uid: int, gid: int) -> Attr:
        path = self.inodes.child_path(parent, name)
        await self.backing.symlink(target, path)
        await self._chown_new(path, uid, gid)
        return await self.lookup(parent, name)

    async def readlink(self, ino: int) -> bytes:
        return await self.backing.readlink(self.inodes.path(ino))

    # ----- names ------------------------------------------------------------
    async def unlink(self, parent: int, name: str) -> None:
        path = self.inodes.child_path(parent, name)
        async with self.ns_lock:
            entry = await self._entry(path)
            if entry.kind == "dir":
                raise FsError(errno.EISDIR)
            await self.backing.unlink(path)
            gone = self._removed(parent, name, entry)
        if gone is not None:
            await self._run_hooks(self.on_modify, gone)
        log.info("deleted %s", path)

    def _removed(self, parent: int, name: str, entry: Entry) -> CachedFile | None:
        """A name went away: its file's bytes live on only for open handles."""
        inode = self.inodes.detach(parent, name)
        f = inode.file if inode is not None else None
        if f is None and entry.manifest is not None:
            f = self.cache.files.get(entry.manifest.file_id)
        if f is not None:
            f.unlinked = True
            self._maybe_drop(f)
            return f
        return None

    async def rename(self, p_old: int, old: str, p_new: int, new: str, flags: int) -> None:
        if flags & ~getattr(os, "RENAME_NOREPLACE", 1):
            raise FsError(errno.EINVAL, "only RENAME_NOREPLACE is supported")
        old_path = self.inodes.child_path(p_old, old)
        new_path = self.inodes.child_path(p_new, new)
        async with self.ns_lock:
            source = await self._entry(old_path)
            try:
                target: Entry | None = await self.backing.entry(new_path)
            except FileNotFoundError:
                target = None
            if target is not None and flags:
                raise FsError(errno.EEXIST)
            await self.backing.rename(old_path, new_path)
            replaced = None
            if target is not None and target.ident != source.ident:
                replaced = self._removed(p_new, new, target)
            inode = self.inodes.child(p_old, old) or self._bind(p_old, old, source)
            self.inodes.move(inode, p_new, new)
            moved = self._repath(old_path, new_path)
        if replaced is not None:
            await self._run_hooks(self.on_modify, replaced)
        # Closed files not durable yet: their crash-journal records name the path.
        for f in moved:
            if f.state != DURABLE and f.gen == f.published_gen and not f.writers:
                await self._run_hooks(self.on_publish, f)

    def _repath(self, old: str, new: str) -> list[CachedFile]:
        moved = []
        for f in self.cache.files.values():
            if f.path == old or f.path.startswith(old + "/"):
                f.path = new + f.path[len(old) :]
                moved.append(f)
        return moved

    @staticmethod
    async def _run_hooks(hooks: list[Any], f: CachedFile) -> None:
        for hook in hooks:
            await hook(f)

    # ----- files ------------------------------------------------------------
    def _open_handle(self, inode: Inode, f: CachedFile | None, writable: bool) -> int:
        fh = next(self._fh)
        self.handles[fh] = Handle(inode, f, writable=writable)
        inode.opens += 1
        if f is not None:
            f.handles += 1
            f.writers += writable
        return fh

    async def create(
        self, parent: int, name: str, mode: int, flags: int, uid: int, gid: int
    ) -> tuple[int, Attr]:
        path = self.inodes.child_path(parent, name)
        f = self.cache.new_file(new_id(), new_id(), path, mode & 0o7777)
        try:
            async with self.ns_lock:
                await self.backing.write_manifest(path, self._pending_manifest(f))
        except BaseException:
            self.cache.drop(f)
            raise
        await self._chown_new(path, uid, gid)
        entry = await self._entry(path)
        inode = self._bind(parent, name, entry)
        inode.file, f.ino = f, inode.ino
        inode.kernel_version = f.version
        inode.nlookup += 1
        fh = self._open_handle(inode, f, writable=True)
        return fh, self._attr(inode, None)

    def _pending_manifest(self, f: CachedFile) -> Manifest:
        return Manifest(f.file_id, f.version, f.size, f.mode, f.mtime_ns, "pending", [self.node])

    async def open(self, ino: int, flags: int) -> tuple[int, bool]:
        """Open a file; returns (fh, whether the kernel may keep its cached pages)."""
        inode = self._inode(ino)
        writable = (flags & os.O_ACCMODE) != os.O_RDONLY
        if inode.kind == "plain" and not writable:
            fd = await self.backing.open_plain(self.inodes.path(ino))
            fh = self._open_handle(inode, None, writable=False)
            self.handles[fh].plain_fd = fd
            return fh, False
        if inode.kind not in ("file", "plain"):
            raise FsError(errno.EISDIR if inode.kind == "dir" else errno.ELOOP)
        truncate = writable and bool(flags & os.O_TRUNC)
        f = await self._file_for(inode, writable, truncate)
        if writable and f.state == LOST and not truncate:
            raise FsError(errno.EIO, f"{f.path}: its bytes are lost; only O_TRUNC may rewrite it")
        if writable and not f.writers and f.published_gen >= 0:
            await self._run_hooks(self.on_modify, f)
        fh = self._open_handle(inode, f, writable)
        try:
            if truncate and f.size:
                await self.cache.truncate(f, 0)
        except BaseException:
            await self.release(fh)
            raise
        keep = inode.kernel_version == f.version
        inode.kernel_version = f.version
        return fh, keep

    async def _file_for(self, inode: Inode, writable: bool, truncate: bool = False) -> CachedFile:
        """The cached file behind an inode, built from its manifest if needed."""
        f = inode.file
        if f is not None and (inode.unlinked or f.handles or f.gen != f.published_gen):
            return f  # open or changed here: our copy is the current one
        if inode.unlinked:
            raise FsError(errno.ENOENT)
        path = self.inodes.path(inode.ino)
        entry = await self._entry(path)
        if entry.kind == "plain":
            return await self._adopt_plain(inode, path, entry, writable, truncate)
        m = entry.manifest
        if m is None:
            raise FsError(errno.EISDIR)
        if f is None or f.file_id != m.file_id:
            f = self.cache.files.get(m.file_id)
        if f is not None and self._local(f, entry):
            f.path = path
        else:
            f = self._from_manifest(m, path)
        inode.file, f.ino = f, inode.ino
        return f

    def _from_manifest(self, m: Manifest, path: str) -> CachedFile:
        if m.state == "durable":
            return self.cache.from_manifest(m, path)
        # Pending elsewhere: only its holders have the bytes, and peer reads
        # are not available on this node.
        f = self.cache.from_manifest(
            Manifest(m.file_id, m.version, m.size, m.mode, m.mtime_ns, "durable", m.holders),
            path,
        )
        f.state = LOST
        holders = ", ".join(m.holders) or "none"
        reason = f"not durable yet and no reachable holder has its bytes (holders: {holders})"
        self.cache.lost[path] = reason
        log.error("%s is lost: %s", path, reason)
        return f

    async def _adopt_plain(
        self, inode: Inode, path: str, entry: Entry, writable: bool, truncate: bool
    ) -> CachedFile:
        """Writing to a plain backing file turns it into a ckptfs file at close."""
        if not writable:
            raise FsError(errno.EIO, "plain file opened through the cache")
        f = self.cache.new_file(new_id(), new_id(), path, entry.st.st_mode & 0o7777)
        if not truncate:  # its old bytes are kept: copy them in (spillable as a writer)
            f.writers += 1
            try:
                fd = await self.backing.open_plain(path)
                try:
                    off = 0
                    while data := await self.backing.pread(fd, 4 << 20, off, path):
                        await self.cache.write(f, off, data)
                        off += len(data)
                finally:
                    await self.backing.close_fd(fd)
            except BaseException:
                self.cache.drop(f)
                raise
            finally:
                f.writers -= 1
        f.mtime_ns = entry.st.st_mtime_ns
        f.replaces_plain = True  # the plain file stays until the first publish
        inode.kind, inode.file, f.ino = "file", f, inode.ino
        inode.ident = ("file", f.file_id)
        return f

    async def read(self, fh: int, off: int, size: int) -> bytes:
        handle = self.handles[fh]
        if handle.plain_fd is not None:
            return await self.backing.pread(handle.plain_fd, size, off, handle.inode.name)
        assert handle.file is not None
        try:
            return await self.cache.read(handle.file, off, size)
        except FileLost as exc:
            log.error("read of %s failed: %s", handle.file.path, exc)
            raise FsError(errno.EIO, str(exc)) from None
        except OSError as exc:
            raise FsError(errno.EIO, f"{handle.file.path}: {exc}") from None

    async def write(self, fh: int, off: int, data: bytes) -> int:
        handle = self.handles[fh]
        if handle.file is None:
            raise FsError(errno.EBADF)
        return await self.cache.write(handle.file, off, data)

    async def flush(self, fh: int) -> None:
        """close(): the durability point for data written through this handle."""
        handle = self.handles.get(fh)
        if handle is not None and handle.writable and handle.file is not None:
            await self.commit(handle.file)

    async def fsync(self, fh: int) -> None:
        await self.flush(fh)

    async def release(self, fh: int) -> None:
        handle = self.handles.pop(fh, None)
        if handle is None:
            return
        handle.inode.opens -= 1
        if handle.plain_fd is not None:
            await self.backing.close_fd(handle.plain_fd)
        f = handle.file
        if f is not None:
            f.handles -= 1
            f.writers -= handle.writable
            if handle.writable and not f.writers and f.gen != f.published_gen:
                await self.commit(f)
            self._maybe_drop(f)
        if not handle.inode.nlookup and not handle.inode.opens:
            self.forget(handle.inode.ino, 0)

    async def commit(self, f: CachedFile) -> None:
        """Publish what has changed and queue it; wait at `backing` durability."""
        if f.unlinked:
            return
        if f.gen != f.published_gen:
            f.version = new_id()
            gen = f.gen
            published = await self.publish(f, lambda _: self._pending_manifest(f))
            if not published:
                return
            f.published_gen = gen
            f.closed_at = time.time()
            self.cache.lost.pop(f.path, None)  # rewritten: whatever was lost is replaced
            inode = self.inodes.get(f.ino) if f.ino else None
            if inode is not None:
                inode.kernel_version = f.version
            self.flusher.enqueue(f)
            await self._run_hooks(self.on_publish, f)
        if self.config.durability == "backing":
            await self.wait_durable(f)

    async def wait_durable(self, f: CachedFile, timeout: float | None = None) -> None:
        limit = timeout if timeout is not None else max(600.0, 4 * self.config.backing_timeout)
        with trio.move_on_after(limit):
            while f.state != DURABLE and not f.unlinked:
                await f.durable_event.wait()
            return
        raise FsError(errno.EIO, f"{f.path} did not become durable within {limit:.0f}s")

    async def publish(
        self, f: CachedFile, make: Callable[[Manifest | None], Manifest | None]
    ) -> bool:
        """Write ``make()`` at the file's current path if that path is still ours.

        The manifest is built under the namespace lock, so it reflects the
        file's state at the moment it is written (a metadata update can never
        put back a pending manifest over a newer durable one). ``make`` returns
        None when what it would publish is already stale.
        """
        async with self.ns_lock:
            if f.unlinked:
                return False
            try:
                current = await self.backing.manifest(f.path)
            except FileNotFoundError:
                current = None
            if (current is None and not f.replaces_plain) or (
                current is not None and current.file_id != f.file_id
            ):
                log.warning("%s no longer names the file being written; not publishing", f.path)
                return False
            manifest = make(current)
            if manifest is None:
                return False
            await self.backing.write_manifest(f.path, manifest)
            f.replaces_plain = False
            return True

    async def setattr(self, ino: int, change: SetAttr, fh: int | None) -> Attr:
        inode = self._inode(ino)
        if inode.kind == "file" or (inode.kind == "plain" and change.size is not None):
            return await self._setattr_file(inode, change)
        path = self.inodes.path(ino)
        if change.mode is not None:
            await self.backing.chmod(path, change.mode & 0o7777)
        if change.uid is not None or change.gid is not None:
            await self.backing.chown(
                path,
                -1 if change.uid is None else change.uid,
                -1 if change.gid is None else change.gid,
            )
        if change.atime_ns is not None or change.mtime_ns is not None:
            st = (await self._entry(path)).st
            await self.backing.utime(
                path,
                st.st_atime_ns if change.atime_ns is None else change.atime_ns,
                st.st_mtime_ns if change.mtime_ns is None else change.mtime_ns,
            )
        return await self.getattr(ino)

    async def _setattr_file(self, inode: Inode, change: SetAttr) -> Attr:
        f = await self._file_for(inode, writable=change.size is not None)
        if change.size is not None and change.size != f.size:
            if f.state == LOST and change.size:
                raise FsError(errno.EIO, f"{f.path}: its bytes are lost; truncate it to 0")
            if not f.writers and f.published_gen >= 0:
                await self._run_hooks(self.on_modify, f)
            await self.cache.truncate(f, change.size)
        if change.mode is not None:
            f.mode = change.mode & 0o7777
        if change.mtime_ns is not None:
            f.mtime_ns = change.mtime_ns
        if not inode.unlinked:
            path = self.inodes.path(inode.ino)
            if change.uid is not None or change.gid is not None:
                await self.backing.chown(
                    path,
                    -1 if change.uid is None else change.uid,
                    -1 if change.gid is None else change.gid,
                )
            if not f.writers:
                if f.gen != f.published_gen:
                    await self.commit(f)
                elif change.mode is not None or change.mtime_ns is not None:
                    await self._republish_meta(f)
        return self._attr(inode, None)

    async def _republish_meta(self, f: CachedFile) -> None:
        """Mode or mtime changed, not content: rewrite the manifest in its current state."""

        def make(_: Manifest | None) -> Manifest:
            if f.state == DURABLE:
                return Manifest(
                    f.file_id,
                    f.version,
                    f.size,
                    f.mode,
                    f.mtime_ns,
                    "durable",
                    [self.node],
                    list(f.base),
                    f.chunking,
                )
            return self._pending_manifest(f)

        await self.publish(f, make)

    async def statfs(self) -> os.statvfs_result:
        return await self.backing.statvfs()

    async def create_node(self, parent: int, name: str, mode: int, uid: int, gid: int) -> Attr:
        """mknod of a regular file: create it empty and commit it."""
        if not stat.S_ISREG(mode):
            raise FsError(errno.EPERM, "only regular files can be created")
        fh, attr = await self.create(parent, name, mode, os.O_WRONLY, uid, gid)
        await self.release(fh)
        return attr

    def files_under(self, prefix: str) -> list[CachedFile]:
        return [
            f
            for f in self.cache.files.values()
            if not f.unlinked
            and (not prefix or f.path == prefix or f.path.startswith(prefix + "/"))
        ]

    def close_all(self) -> None:
        self.inodes.release_all()
        for fh in list(self.handles):
            handle = self.handles.pop(fh)
            if handle.plain_fd is not None:
                os.close(handle.plain_fd)
