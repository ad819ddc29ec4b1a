"""Plain-file adoption: a plain backing file opened for writing becomes a
ckptfs file.

Its bytes are copied into the cache (unless the open truncates), and the
new file replaces the plain one at its first publish; until then the name
still shows the plain file, which is the same file to a lookup
(:func:`adopted`). A second open or a setattr of it meanwhile waits for the
adoption.
"""

from __future__ import annotations

import errno

import trio
from ckptfs.fs.content.cachedfile import CachedFile
from ckptfs.fs.interrupts import Interrupted
from ckptfs.fs.namespace.inodes import Inode
from ckptfs.fs.namespace.posix import FsError
from ckptfs.fs.store.entries import Entry, PlainFile
from ckptfs.fs.store.manifest import new_id


class AdoptionMixin:
    """The adoption of a plain file by a writable open.

    A part of :class:`~ckptfs.fs.namespace.filesystem.FileSystem`: it uses
    the state its ``__init__`` sets and the methods of its other parts.
    """

    async def _adopt_plain(
        self, inode: Inode, path: str, entry: Entry, writable: bool, truncate: bool
    ) -> CachedFile:
        """Writing to a plain backing file turns it into a ckptfs file at close."""
        if not writable:
            raise FsError(errno.EIO, "plain file opened through the cache")
        if (adopting := self._adopting.get(inode.ino)) is not None:
            await adopting.wait()  # another open is adopting it: one file for both
            f = inode.file
            if f is None or f.unlinked or inode.kind != "file":
                raise FsError(errno.ESTALE, f"{path}: its adoption by another open failed")
            return f
        done = self._adopting[inode.ino] = trio.Event()
        try:
            return await self._adopt_now(inode, path, entry, truncate)
        finally:
            del self._adopting[inode.ino]
            done.set()

    async def _adopt_now(self, inode: Inode, path: str, entry: Entry, truncate: bool) -> CachedFile:
        st, plain = entry.st, PlainFile.of(entry.st)
        f = self.cache.new_file(new_id(), new_id(), path, st.st_mode & 0o7777, st.st_uid, st.st_gid)
        # Registered, so `ckptfs flush --wait` may commit it: not before its
        # copy is whole and it knows which plain file it replaces.
        try:  # around the lock too: a cancelled acquire must not leave f behind
            async with f.commit_lock:
                if not truncate:  # its old bytes are kept (spillable while MODIFIED)
                    await self._copy_plain(f, path, plain)
                if inode.unlinked:  # removed or renamed over while it was copied
                    raise FsError(errno.ESTALE, f"{path}: its name was removed")
                self.cache.set_attributes(f, mtime_ns=st.st_mtime_ns, atime_ns=st.st_atime_ns)
                self.cache.replacing_plain(f, plain)
                inode.kind = "file"
                self.inodes.attach(inode, f)
                inode.ident = ("file", f.file_id)
        except BaseException:
            self.cache.unlink(f)  # nothing publishes it (a waiting commit sees UNLINKED)
            raise
        return f

    async def _copy_plain(self, f: CachedFile, path: str, plain: PlainFile) -> None:
        with self.cache.writing(f):
            fd = await self.backing.open_plain(path, plain.matches)
            try:
                off = 0
                while data := await self.backing.pread(fd, 4 << 20, off, path):
                    if await self.cache.write(f, off, data) < len(data):
                        # A short write is an interrupted one: the open fails
                        # and the copy is dropped.
                        raise Interrupted(f"copy of {path} into the cache")
                    off += len(data)
            finally:
                await self.backing.close_fd(fd)


def adopted(f: CachedFile, entry: Entry) -> bool:
    """Whether ``entry`` is the plain file that ``f`` adopted and has not yet
    replaced: until its first publish the name still shows that plain file,
    and it is the same file (a lookup must not make a second one of it)."""
    return (
        not f.unlinked
        and f.replaces_plain is not None
        and entry.kind == "plain"
        and f.replaces_plain.matches(entry.st)
    )
