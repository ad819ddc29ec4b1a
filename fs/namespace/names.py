"""Names added and removed: create, mknod, mkdir, rmdir, symlink, unlink.

Each operation that adds or removes a name marks its directory changed
(``changes_names``), so no getattr of it reuses a look taken before. A file
created here is registered in the cache and gets its first (empty, pending)
manifest in one backing-store call; an unlinked file's bytes live on only
for its open handles and the kernel's inode (:mod:`inodes`). Renames are
:mod:`rename`'s.
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import stat
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from ckptfs.fs.namespace.kernelpages import KernelCache
from ckptfs.fs.namespace.posix import Attr, Caller, FsError
from ckptfs.fs.store.entries import Entry
from ckptfs.fs.store.manifest import new_id

log = logging.getLogger("ckptfs.fs")
T = TypeVar("T")


def changes_names(
    *parents: int,
) -> Callable[[Callable[..., Awaitable[T]]], Callable[..., Awaitable[T]]]:
    """For an operation that adds or removes a name in the directories its
    arguments ``parents`` (positions) name: once it ends, done or not, no
    getattr of them reuses the last look at their attributes (their mtime
    and link count moved; the kernel, which dropped its own copy, asks)."""

    def wrap(fn: Callable[..., Awaitable[T]]) -> Callable[..., Awaitable[T]]:
        @functools.wraps(fn)
        async def wrapper(self: Any, *args: Any, **kwargs: Any) -> T:
            try:
                return await fn(self, *args, **kwargs)
            finally:
                for i in parents:
                    self.names_changed_in(args[i])

        return wrapper

    return wrap


class NamesMixin:
    """create, mknod, mkdir, rmdir, symlink, readlink, unlink.

    A part of :class:`~ckptfs.fs.namespace.filesystem.FileSystem`: it uses
    the state its ``__init__`` sets and the methods of its other parts.
    """

    @changes_names(0)
    async def create(
        self, parent: int, name: str, mode: int, flags: int, caller: Caller, *, direct: bool = False
    ) -> tuple[int, Attr]:
        """A new file and a writable handle of it (``direct``: its writes
        bypass the kernel's page cache, so the inode has no page there)."""
        path = self.inodes.child_path(parent, name)
        f = self.cache.new_file(new_id(), new_id(), path, mode & 0o7777, caller.uid, caller.gid)
        # Registered (an open of the name may find it) and MODIFIED with no
        # writer yet, so `ckptfs flush` would commit it: not before its first
        # manifest exists, or the commit finds no manifest, takes the name for
        # gone and drops the file the caller is about to write.
        try:  # around the lock too: a cancelled acquire must not leave f behind
            async with f.commit_lock:
                async with self.ns_lock.shared(
                    lambda: self.inodes.child_path(parent, name)
                ) as path:
                    self.cache.move_path(f, path)
                    # One backing-store call: the parent's setgid, the manifest, its entry.
                    entry, gid = await self.backing.create_manifest(
                        path,
                        self._manifest(f, f.version),
                        caller.uid,
                        caller.gid,
                        self._dir_ino(parent),
                    )
                    self.cache.set_attributes(f, gid=gid)  # the parent's, if setgid
        except BaseException:
            self.cache.unlink(f)  # nothing publishes it (a waiting commit sees UNLINKED)
            raise
        inode = self._bind(parent, name, entry)
        self.inodes.attach(inode, f)
        inode.kernel_version = f.version
        inode.nlookup += 1
        fh = self._open_handle(inode, f, writable=True, caller=caller)
        if direct and inode.opens == 1:
            inode.kernel_cache = KernelCache.EMPTY
        return fh, self._attr(inode, None)

    async def create_node(self, parent: int, name: str, mode: int, caller: Caller) -> Attr:
        """mknod of a regular file: create it empty and commit it."""
        if not stat.S_ISREG(mode):
            raise FsError(errno.EPERM, "only regular files, directories and symlinks exist here")
        fh, attr = await self.create(parent, name, mode, os.O_WRONLY, caller)
        await self.release(fh)
        return attr

    @changes_names(0)
    async def mkdir(self, parent: int, name: str, mode: int, caller: Caller) -> Attr:
        path = self.inodes.child_path(parent, name)
        await self.backing.mkdir(
            path, mode & 0o7777, (caller.uid, caller.gid), self._dir_ino(parent)
        )
        return await self.lookup(parent, name)

    @changes_names(0)
    async def rmdir(self, parent: int, name: str) -> None:
        path = self.inodes.child_path(parent, name)
        entry = await self._entry(path, parent)
        if entry.kind != "dir":
            raise FsError(errno.ENOTDIR)
        await self.backing.rmdir(path, self._dir_ino(parent))
        self.inodes.detach(parent, name)

    @changes_names(0)
    async def symlink(self, parent: int, name: str, target: bytes, caller: Caller) -> Attr:
        path = self.inodes.child_path(parent, name)
        await self.backing.symlink(target, path, (caller.uid, caller.gid), self._dir_ino(parent))
        return await self.lookup(parent, name)

    async def readlink(self, ino: int) -> bytes:
        return await self.backing.readlink(
            self.inodes.path(ino), self._object_ino(self._inode(ino))
        )

    @changes_names(0)
    async def unlink(self, parent: int, name: str) -> None:
        path = self.inodes.child_path(parent, name)
        async with self.ns_lock.exclusive():
            entry = await self._entry(path, parent)
            if entry.kind == "dir":
                raise FsError(errno.EISDIR)
            await self.backing.unlink(path, self._dir_ino(parent), entry)
            self._removed(parent, name, entry)
        log.info("deleted %r", path)  # %r: a name's newline forges no log line

    def _removed(self, parent: int, name: str, entry: Entry) -> None:
        """A name went away: its file's bytes live on only for open handles
        and for the kernel's inode (see fs/namespace/inodes.py)."""
        inode = self.inodes.child(parent, name)
        f = inode.file if inode is not None else None
        other = None  # a version of the file other than the name's: it goes too
        if f is None and entry.manifest is not None:
            m = entry.manifest
            f = self.cache.files.get(m.file_id)
            if f is not None and not f.stands_for(m):
                # Never the inode's: it holds the name's version's attributes.
                other, f = f, None
            if (
                f is None
                and inode is not None
                and inode.nlookup
                and entry.manifest.state == "durable"
            ):
                # The kernel knows the inode but it never loaded its file: a
                # path walk may still open it, so it gets the file to read.
                # (One pending elsewhere is not loaded here: that open gets
                # ESTALE and looks the name up again.)
                path = self.inodes.child_path(parent, name)
                f = self.cache.load(entry.manifest, path, entry.st.st_uid, entry.st.st_gid)
        if f is not None and inode is not None and inode.file is None:
            self.inodes.attach(inode, f)
        self.inodes.detach(parent, name)
        if f is not None and (entry.manifest is None or f.file_id == entry.manifest.file_id):
            self._retry.discard(f)
            self.cache.unlink(f)
        if other is not None and not other.unlinked:
            self.cache.unlink(other)
