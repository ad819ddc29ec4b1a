"""setattr(2): mode, owner, size (truncate) and times of a name.

A cached file's change is made in the cache and published (a commit if its
content changed, else its manifest rewritten under the same version); a
directory's, symlink's or plain file's is made in the backing store.
"""

from __future__ import annotations

import errno
import time

from ckptfs.fs.cache.writing import MAX_FILE_SIZE
from ckptfs.fs.content.cachedfile import CachedFile
from ckptfs.fs.content.state import FileRole, FileState
from ckptfs.fs.namespace.inodes import Inode
from ckptfs.fs.namespace.posix import (
    Attr,
    Caller,
    FsError,
    SetAttr,
    kills_privileges,
    without_privileges,
)
from ckptfs.fs.store.manifest import Manifest


class SetAttrMixin:
    """setattr of a file (through the cache) or of any other name.

    A part of :class:`~ckptfs.fs.namespace.filesystem.FileSystem`: it uses
    the state its ``__init__`` sets and the methods of its other parts.
    """

    async def setattr(self, ino: int, change: SetAttr, caller: Caller) -> Attr:
        inode = self._inode(ino)
        if (adopting := self._adopting.get(ino)) is not None:
            # Not on the plain file it replaces: a changed mtime would make it
            # another file to the adoption's first publish.
            await adopting.wait()
        if inode.kind == "file" or (inode.kind == "plain" and change.size is not None):
            return await self._setattr_file(inode, change, caller)
        path = self.inodes.path(ino)
        inode.dir_attrs_at = 0.0  # what follows changes them
        mode = None if change.mode is None or inode.kind == "symlink" else change.mode & 0o7777
        try:
            await self.backing.set_attributes(
                path,
                self._object_ino(inode),
                mode=mode,
                uid=-1 if change.uid is None else change.uid,
                gid=-1 if change.gid is None else change.gid,
                atime_ns=change.atime_ns,
                mtime_ns=change.mtime_ns,
            )
        finally:
            # A stat that began before the change ends (the daemon's own READY
            # stat of the mount root, racing an operator's chmod of it) may
            # store what it read afterwards: that is not reused.
            inode.changed_at = time.monotonic()
        return await self.getattr(ino)

    async def _setattr_file(self, inode: Inode, change: SetAttr, caller: Caller) -> Attr:
        f = await self._file_for(inode, writable=change.size is not None)
        if change.size is not None and change.size > MAX_FILE_SIZE:
            raise FsError(errno.EFBIG, f"{f.path}: size {change.size} beyond the maximum")
        if change.size is not None and change.size != f.size:
            if f.lost and change.size:
                raise FsError(errno.EIO, f"{f.path}: its bytes are lost; truncate it to 0", True)
            if f.role is FileRole.REMOTE and change.size:
                raise FsError(errno.EBUSY, f"{f.path}: pending on another node; truncate it to 0")
            if caller.uid != 0 and kills_privileges(f.mode):
                self.cache.set_attributes(f, mode=without_privileges(f.mode))
            await self.cache.truncate(f, change.size)
        owner_changed = False
        if change.uid is not None or change.gid is not None:
            uid = f.uid if change.uid is None else change.uid
            gid = f.gid if change.gid is None else change.gid
            owner_changed = (uid, gid) != (f.uid, f.gid)
            self.cache.set_attributes(f, uid=uid, gid=gid)
            if owner_changed and change.mode is None and kills_privileges(f.mode):
                self.cache.set_attributes(f, mode=without_privileges(f.mode))  # as chown(2)
        self.cache.set_attributes(
            f, mode=change.mode, atime_ns=change.atime_ns, mtime_ns=change.mtime_ns
        )
        if not inode.unlinked and not f.unlinked:
            if f.modified:
                if not f.writers:
                    await self.commit(f)
            elif (
                change.mode is not None
                or change.atime_ns is not None
                or owner_changed
                or (change.mtime_ns is not None)
            ):
                await self._republish_meta(f)
        # The manifest was rewritten, under the same version if only metadata
        # changed: its ctime moved, so the next stat asks the store.
        inode.checked = None
        return self._attr(inode, None)

    async def _republish_meta(self, f: CachedFile) -> None:
        """Mode, owner or times changed, not content: rewrite the manifest as it is."""

        def make() -> Manifest | None:
            state = {FileState.DURABLE: "durable", FileState.PENDING: "pending"}.get(f.state)
            if f.state is FileState.LOST:
                state = "pending"  # still somebody else's pending version
            if state is None:
                return None  # being published: the commit carries the new metadata
            return Manifest(
                f.file_id, f.version, f.size, f.mode, f.mtime_ns, state, list(f.holders),
                list(f.base.chunks) if state == "durable" else [], f.chunking, f.atime_ns,
                seq=f.seq,
            )  # fmt: skip

        await self.publish(f, make, expect_version=f.version)
