"""I/O through an open handle: read, write, flush (close), fsync, release.

A read of a version pending on other nodes whose holders failed looks at
its manifest to tell why (``_after_holders_failed``). A close (flush) of a
writer's handle is a durability point: it commits the file, then may push
the head and tail of a file just saved into the kernel's page cache
(:mod:`kernelpages`). The last release of a writer's handle commits too.
"""

from __future__ import annotations

import contextlib
import errno
import logging

import trio
from ckptfs.fs.cache.errors import FileLost, HoldersFailed
from ckptfs.fs.cache.writing import MAX_FILE_SIZE
from ckptfs.fs.content.cachedfile import CachedFile
from ckptfs.fs.content.state import FileRole, FileState
from ckptfs.fs.interrupts import Interrupted
from ckptfs.fs.namespace.inodes import Inode
from ckptfs.fs.namespace.kernelpages import KernelCache, pieces
from ckptfs.fs.namespace.posix import FsError, kills_privileges, without_privileges
from ckptfs.fs.store.chunkstore import ChunkCorrupt
from ckptfs.fs.store.entries import Entry

log = logging.getLogger("ckptfs.fs")
# A read of a file pending elsewhere whose holders failed looks at its
# manifest, and tries again (made durable, or changed here meanwhile) this often.
HOLDERS_FAILED_TRIES = 3


class FileIOMixin:
    """read, write, flush, fsync, release of a handle.

    A part of :class:`~ckptfs.fs.namespace.filesystem.FileSystem`: it uses
    the state its ``__init__`` sets and the methods of its other parts.
    """

    async def read(self, fh: int, off: int, size: int) -> bytes | memoryview:
        handle = self.handles[fh]
        if handle.plain_fd is not None:
            return await self.backing.pread(handle.plain_fd, size, off, handle.inode.name)
        f = handle.file
        assert f is not None
        try:
            return await self._read_cached(f, off, size)
        except FileLost as exc:
            log.error("read of %s failed: %s", f.path, exc.strerror)
            raise FsError(errno.EIO, exc.strerror, logged=True) from None
        except ChunkCorrupt as exc:
            raise FsError(errno.EIO, f"{f.path}: {exc}", logged=True) from None
        except (Interrupted, FsError):
            raise  # the caller's Ctrl-C (EINTR); ESTALE: not a failure of the store
        except OSError as exc:
            raise FsError(errno.EIO, f"{f.path}: {exc}") from None

    async def _read_cached(self, f: CachedFile, off: int, size: int) -> bytes | memoryview:
        """The bytes, a view of the arena where possible (returned straight to
        the reply). A read whose holders failed looks at the manifest and
        tries again; the last look holds off renames, so it decides."""
        tries = 0
        while True:
            try:
                return await self.cache.read(f, off, size, view_ok=True)
            except HoldersFailed as failed:
                if tries == HOLDERS_FAILED_TRIES:
                    raise FsError(
                        errno.EIO, f"{f.path}: changed here while it was read ({failed.reason})"
                    ) from None
                tries += 1
                await self._after_holders_failed(f, failed, settle=tries == HOLDERS_FAILED_TRIES)

    async def _after_holders_failed(
        self, f: CachedFile, failed: HoldersFailed, *, settle: bool = False
    ) -> None:
        """No holder served bytes of ``f``, a version pending on other nodes:
        why, by its manifest now. Returns if the read may try again: ``f`` was
        published as durable meanwhile (its writer's umount or flush, a
        takeover; it reads the store from here on), or something changed
        here while the manifest was read. Raises ESTALE if its writer moved
        on (another version or another file at its name, or a newer version
        loaded here): the holders drop a version nobody there has open, and
        NFS answers a reader of a file that another client removed the same
        way, and also while the manifest still names that pending version if
        a holder said its writer is changing the file (in place: the next
        close publishes a new version). Raises FileLost (the file LOST here)
        if the manifest still names that pending version otherwise: its
        holders are gone. With ``settle`` (the
        last try) no rename or unlink runs here meanwhile, so it decides."""
        if f.role is not FileRole.REMOTE:
            return  # made durable, or rewritten here, while its holders were asked
        if f.unlinked:
            raise self._stale(f, failed, "it was replaced or removed here meanwhile")
        async with self.ns_lock.reading() if settle else contextlib.nullcontext():
            path, generation = f.path, self.ns_lock.generation
            entry = await self._entry_or_none(path, failed)
        if f.unlinked or self.cache.files.get(f.file_id) is not f:
            raise self._stale(f, failed, "a newer version was loaded here meanwhile")
        if (
            f.role is not FileRole.REMOTE
            or f.version != failed.version
            or f.path != path
            or not self.ns_lock.stable_since(generation)
        ):
            return  # made durable by another open, renamed or relinked meanwhile: again
        m = entry.manifest if entry is not None else None
        if m is not None and (m.file_id, m.version) == (f.file_id, f.version):
            if m.state != "durable" and failed.moved_on:
                # Its writer is changing it in place (r+b, a truncate above 0):
                # its next close publishes what an open here will read.
                raise self._stale(f, failed, "its writer is changing it")
            if m.state != "durable":
                raise self.cache.declare_lost(f, failed)
            assert entry is not None
            self.cache.load(m, path, entry.st.st_uid, entry.st.st_gid)
            return
        now = (
            "nothing"
            if entry is None
            else "another file"
            if m is None or m.file_id != f.file_id
            else f"version {m.version}"
        )
        # Nothing will serve this version again: it goes, as when a newer
        # version is loaded here (its handles still ask its holders).
        self.cache.unlink(f)
        raise self._stale(f, failed, f"its name holds {now} now")

    async def _entry_or_none(self, path: str, failed: HoldersFailed) -> Entry | None:
        """The entry at ``path`` (None: nothing there), for a read whose
        holders failed; EIO if the store cannot tell either (not a loss yet)."""
        try:
            return await self.backing.entry(path)
        except (FileNotFoundError, NotADirectoryError):
            return None
        except Interrupted:
            raise
        except OSError as exc:
            raise FsError(
                errno.EIO,
                f"{path}: no holder served it ({failed.reason}), and its manifest "
                f"could not be read: {exc}",
            ) from exc

    @staticmethod
    def _stale(f: CachedFile, failed: HoldersFailed, why: str) -> FsError:
        log.info(
            "read of %s: version %s is gone from its holders (%s), and %s: stale (ESTALE)",
            f.path,
            failed.version,
            failed.reason,
            why,
        )
        return FsError(
            errno.ESTALE, f"{f.path}: changed on another node while open here", logged=True
        )

    def read_now(self, fh: int, off: int, size: int) -> list[memoryview] | bytes | None:
        """A read that needs no await (Cache.read_now), else None."""
        handle = self.handles.get(fh)
        if handle is None or handle.file is None or handle.plain_fd is not None:
            return None
        return self.cache.read_now(handle.file, off, size)

    async def write(self, fh: int, off: int, data: bytes) -> int:
        handle = self.handles[fh]
        f = handle.file
        if f is None or not handle.writable:
            raise FsError(errno.EBADF)
        if off + len(data) > MAX_FILE_SIZE:
            raise FsError(errno.EFBIG, f"{f.path}: beyond the maximum file size")
        if handle.uid != 0 and kills_privileges(f.mode):
            self.cache.set_attributes(f, mode=without_privileges(f.mode))  # published at close
        try:
            return await self.cache.write(f, off, data)
        except FileLost as exc:
            raise FsError(errno.EIO, exc.strerror, logged=True) from None

    async def flush(self, fh: int) -> None:
        """close(): the durability point for data written through this handle."""
        f = self._written_through(fh)
        if f is not None:
            await self.commit(f)
            await self._push_pages(self.handles[fh].inode, f)

    async def _push_pages(self, inode: Inode, f: CachedFile) -> None:
        """A file saved here through one direct-I/O handle, now published: its
        head and tail into the kernel's page cache, so that the first load
        after the save reads them from there (kernelpages.py). Under
        ``f.lock``, which a write or a truncate of the file takes before it
        changes a byte: the bytes pushed are the file's until the push ends."""
        if (
            self.kernel_pages is None
            or not self.kernel_pages.wanted()
            or inode.kernel_cache is not KernelCache.EMPTY
            or inode.file is not f
            or f.state not in (FileState.PENDING, FileState.DURABLE)
        ):
            return
        try:
            f.lock.acquire_nowait()
        except trio.WouldBlock:
            # A write or a truncate is changing it (a write waiting for room
            # holds the lock for as long as that takes): no push, and no
            # wait, which would hold up this close behind that writer.
            return
        try:
            ranges = []
            for start, end in pieces(f.size):
                # A copy: the slots may be reused (spilled) while the push runs.
                data = self.cache.copy_in_ram(f, start, end)
                if data is None:
                    return  # not all in RAM: no push
                ranges.append((start, data))
            # The publish made the inode's kernel_version this version: an
            # open from now on keeps these pages, which are of it throughout.
            inode.kernel_cache, inode.pushed = KernelCache.PUSHING, trio.Event()
            try:
                await self.kernel_pages.push(inode.ino, ranges)
            finally:
                inode.kernel_cache = KernelCache.ANY
                inode.pushed.set()
        finally:
            f.lock.release()

    def flush_now(self, fh: int) -> bool:
        """Whether the close of ``fh`` has nothing to publish (a reader's)."""
        return self._written_through(fh) is None

    def _written_through(self, fh: int) -> CachedFile | None:
        """The file a close of ``fh`` publishes: a writer's."""
        handle = self.handles.get(fh)
        return handle.file if handle is not None and handle.writable else None

    async def fsync(self, fh: int) -> None:
        await self.flush(fh)

    def release_now(self, fh: int) -> bool:
        """Release a reader's handle, which needs no await (no commit, no
        backing-store descriptor to close); whether it did."""
        handle = self.handles.get(fh)
        if handle is None:
            return True
        if handle.writable or handle.plain_fd is not None:
            return False
        inode, f = handle.inode, handle.file
        del self.handles[fh]
        inode.opens -= 1
        if f is not None:
            self.cache.closed(f, writable=False)
            self.cache.let_go(f)
        if not inode.nlookup and not inode.opens:
            self.forget(inode.ino, 0)
        return True

    async def release(self, fh: int) -> None:
        if self.release_now(fh):
            return
        handle = self.handles.pop(fh, None)
        if handle is None:
            return
        handle.inode.opens -= 1
        if handle.plain_fd is not None:
            await self.backing.close_fd(handle.plain_fd)
        f = handle.file
        if f is not None:
            self.cache.closed(f, handle.writable)
            try:
                if handle.writable and not f.writers and f.modified:
                    await self.commit(f)
            finally:
                self.cache.let_go(f)
        if not handle.inode.nlookup and not handle.inode.opens:
            self.forget(handle.inode.ino, 0)
