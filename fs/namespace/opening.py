"""open(2): which file an open gets, and its handle.

An open finds the cached file behind its inode, (re)loading it from its
manifest unless a recent check or a writer here makes our copy current
(``_file_now``); a read-only open of a name that a rename in flight replaces
waits for the rename and may be sent back (ESTALE) to walk the path again.
It tells the kernel whether its cached pages of the inode may be kept. A
plain backing file opened for writing is adopted (:mod:`adoption`).
"""

from __future__ import annotations

import errno
import os

import trio
from ckptfs.fs.content.cachedfile import CachedFile
from ckptfs.fs.content.state import FileRole
from ckptfs.fs.interrupts import interruptible
from ckptfs.fs.namespace.adoption import adopted
from ckptfs.fs.namespace.inodes import Inode
from ckptfs.fs.namespace.kernelpages import KernelCache
from ckptfs.fs.namespace.posix import Caller, FsError, Handle
from ckptfs.fs.store.entries import Entry


class OpenMixin:
    """open, open_now and the handles they make; the file behind an inode.

    A part of :class:`~ckptfs.fs.namespace.filesystem.FileSystem`: it uses
    the state its ``__init__`` sets and the methods of its other parts.
    """

    async def open(self, ino: int, flags: int, caller: Caller) -> tuple[int, bool]:
        """Open a file; returns (fh, whether the kernel may keep its cached pages)."""
        inode = self._inode(ino)
        writable = (flags & os.O_ACCMODE) != os.O_RDONLY
        if inode.kind == "file" and not writable:
            await self._after_rename_onto(inode, caller)
        if inode.kind == "plain" and not writable:
            # The same plain file (not a manifest written at its name since).
            ino_then = inode.ident[1]
            fd = await self.backing.open_plain(
                self.inodes.path(ino), lambda st: st.st_ino == ino_then
            )
            fh = self._open_handle(inode, None, writable=False, caller=caller)
            self.handles[fh].plain_fd = fd
            return fh, False
        if inode.kind not in ("file", "plain"):
            raise FsError(errno.EISDIR if inode.kind == "dir" else errno.ELOOP)
        truncate = writable and bool(flags & os.O_TRUNC)
        f = await self._file_for(inode, writable, truncate)
        if writable and f.lost and not truncate:
            raise FsError(
                errno.EIO, f"{f.path}: its bytes are lost; only O_TRUNC may rewrite it", True
            )
        if writable and f.role is FileRole.REMOTE and not truncate:
            # Its bytes are on its holders: a partial write here would start
            # from nothing. A full rewrite (the next torch.save) is fine.
            raise FsError(
                errno.EBUSY,
                f"{f.path}: being flushed by {', '.join(f.holders)}; only O_TRUNC may rewrite it",
            )
        if not writable:
            if self.cache.dropped_here(f) and self.stale_opens.may_send_back(caller.tid):
                # Its mirror here went (durable, replaced or removed by its
                # writer) after the manifest was read: no holder may serve
                # it, and a read of a mapping that fails is SIGBUS. The
                # kernel looks the name up again and opens what is there.
                inode.checked = None
                raise FsError(errno.ESTALE, f"{f.path}: its writer let go of this version")
            return self._opened(inode, f, caller)
        # Right before the handle, with no await between: a writer through
        # the page cache holds a page's lock while its WRITE waits for the
        # push (f.lock), and the push may wait for that page (kernelpages.py).
        await self._after_push(inode)
        fh = self._open_handle(inode, f, writable, caller)
        try:
            if truncate and (f.size or f.lost):
                await self.cache.truncate(f, 0)
        except BaseException:
            await self.release(fh)
            raise
        return fh, self._kernel_may_keep(inode, f)

    def open_now(self, ino: int, flags: int, caller: Caller) -> tuple[int, bool] | None:
        """A read-only open of a file whose cached copy needs no look at the
        backing store (see _file_now); None if it does."""
        if (flags & os.O_ACCMODE) != os.O_RDONLY:
            return None
        inode = self._inode(ino)
        if inode.kind != "file" or self._open_waits_for_rename(inode, caller) is not None:
            return None
        f = self._file_now(inode, writable=False)
        if f is None or self.cache.dropped_here(f):
            return None  # (the loop's open sends a dropped version back)
        return self._opened(inode, f, caller)

    def _open_handle(
        self, inode: Inode, f: CachedFile | None, writable: bool, caller: Caller, fh: int = 0
    ) -> int:
        fh = fh or next(self._fh)
        self.handles[fh] = Handle(inode, f, writable=writable, uid=caller.uid, tid=caller.tid)
        inode.opens += 1
        if inode.kernel_cache is KernelCache.EMPTY:
            inode.kernel_cache = KernelCache.ANY  # this handle may let the kernel cache pages
        if f is not None:
            self.cache.opened(f, writable)
        return fh

    def _opened(self, inode: Inode, f: CachedFile, caller: Caller, fh: int = 0) -> tuple[int, bool]:
        """A read-only handle of ``f`` (numbered ``fh``, if given); whether
        the kernel may keep its pages."""
        return self._open_handle(inode, f, False, caller, fh), self._kernel_may_keep(inode, f)

    def _kernel_may_keep(self, inode: Inode, f: CachedFile) -> bool:
        """Whether the kernel's pages of the inode are of ``f`` as it is now
        (FOPEN_KEEP_CACHE); from here on they are. If not, its cached
        attributes may be of another version too (a lookup or stat within
        the attribute timeout, before a rewrite elsewhere): dropped."""
        keep = inode.kernel_version == f.version and not f.modified
        inode.kernel_version = f.version
        if not keep and self.kernel_pages is not None:
            self.kernel_pages.attributes_changed(inode.ino)
        return keep

    def _being_replaced(self, inode: Inode) -> trio.Event | None:
        """Set once no rename onto the inode's name is in flight; None if none is now."""
        if not self.ns_lock.any_replacing() or inode.unlinked:
            return None
        return self.ns_lock.replacement_of(self.inodes.path(inode.ino))

    def _open_waits_for_rename(self, inode: Inode, caller: Caller) -> trio.Event | None:
        """What a read-only open of ``inode`` waits for before it opens: the
        end of a rename in flight onto its name, unless the calling thread
        has the file open already (torch.load(mmap=True)'s second open, while
        it reads through its first: it gets the same file, as the rename had
        not ended when the open came)."""
        ended = self._being_replaced(inode)
        if ended is None or self._open_in_thread(inode, caller.tid):
            return None
        return ended

    def _open_in_thread(self, inode: Inode, tid: int) -> bool:
        # Only while a rename is in flight onto the name: a scan of the handles.
        return bool(tid and inode.opens) and any(
            h.inode is inode and h.tid == tid for h in self.handles.values()
        )

    async def _after_rename_onto(self, inode: Inode, caller: Caller) -> None:
        """A read-only open of a name that a rename in flight is replacing
        comes after the rename. The kernel walked the path before the rename
        ended and sent the open for the file it found; were it to get that
        file, a replace right after a load's first open (torch.save to a
        temporary name, then os.replace) would give the load's second open
        the new file whenever the rename took longer than the load's parse,
        a tear that a rename's backing-store round trips make likely. So the
        open waits for the rename and, if the file is no longer at the name,
        answers ESTALE: the kernel walks the path again and opens the new
        file. A thread's open that comes back after such an ESTALE is not
        sent back again (the kernel retries once; a second ESTALE would
        reach the caller): it gets what it asked for."""
        ended = self._open_waits_for_rename(inode, caller)
        if ended is None:
            return
        path = self.inodes.path(inode.ino)
        self.opens_waited_for_rename += 1
        with interruptible(f"{path}: open, waiting for the rename onto its name"):
            await ended.wait()
        if inode.unlinked and self.stale_opens.may_send_back(caller.tid):
            self.opens_sent_back += 1
            raise FsError(errno.ESTALE, f"{path}: renamed over while it was opened")

    def _file_now(self, inode: Inode, writable: bool) -> CachedFile | None:
        """The cached file behind an inode if it needs no look at its manifest."""
        f = inode.file
        if f is not None and f.unlinked and not inode.unlinked:
            # Retired while the inode still has its name (the name vanished
            # or changed on another node): what is at the name counts.
            return None
        if f is not None and (inode.unlinked or f.writers or f.modified):
            # Being written or changed here: our copy is the current one. A
            # file only open for reading here may have been rewritten on
            # another node (and its RELEASE may still be on its way): look.
            return f
        if (
            f is not None
            and not writable
            and self._last_check(inode, f) is not None
            and self._recently_checked(inode)
        ):
            return f  # the lookup just before this open read the manifest
        return None

    async def _file_for(self, inode: Inode, writable: bool, truncate: bool = False) -> CachedFile:
        """The cached file behind an inode, (re)loaded from its manifest if
        needed. An open or a setattr of an inode whose handles read an older
        version than the name's is sent back to the name (ESTALE), which a
        lookup gives an inode of its own (_open_on_another_version)."""
        f = self._file_now(inode, writable)
        if f is not None:
            return f
        if inode.unlinked:
            raise FsError(errno.ESTALE, "its name was removed")  # the kernel looks up again

        def bind(entry: Entry) -> CachedFile | Entry:
            if inode.unlinked:  # removed or renamed over meanwhile
                if inode.file is None:
                    raise FsError(errno.ESTALE, "its name was removed")
                return inode.file  # kept for this inode (see fs/namespace/inodes.py)
            if inode.file is not None and adopted(inode.file, entry):
                return inode.file  # another open adopted the plain file meanwhile
            if entry.ident != inode.ident:
                # Another file is at the name now (replaced by another node):
                # the kernel's page cache of this inode holds the old file's
                # bytes, so the new file must come with a new inode. ESTALE
                # makes the kernel look the name up again and retry.
                raise FsError(errno.ESTALE, "replaced since it was looked up")
            if self._open_on_another_version(inode, entry):
                # The kernel looks the name up again, which gives the
                # name's version an inode of its own, and retries there:
                # never sent back here twice. (Also the open of a thread
                # that reads the old version: close-to-open, the new one.)
                raise FsError(errno.ESTALE, "open on an older version; the name has a newer one")
            self._checked(inode, entry)
            if entry.kind == "plain":
                return entry
            if entry.manifest is None:
                raise FsError(errno.EISDIR)
            path = self.inodes.path(inode.ino)
            loaded = self.cache.load(entry.manifest, path, entry.st.st_uid, entry.st.st_gid)
            self.inodes.attach(inode, loaded)
            return loaded

        try:
            got = await self._resolved(
                lambda: self.inodes.path(inode.ino), bind, lambda: inode.parent
            )
        except FsError as exc:
            if exc.errno != errno.ENOENT:
                raise
            # Removed elsewhere (another node) while the kernel's entry
            # lived: it looks the name up again and retries (an O_CREAT
            # open then creates the file), as for a replaced one.
            raise FsError(errno.ESTALE, "its name was removed elsewhere") from None
        if isinstance(got, CachedFile):
            return got
        return await self._adopt_plain(inode, self.inodes.path(inode.ino), got, writable, truncate)

    @staticmethod
    async def _after_push(inode: Inode) -> None:
        """A writable open waits for a push of the inode's pages to end (see
        open); once it ends the inode is never pushed again."""
        if inode.kernel_cache is KernelCache.PUSHING and inode.pushed is not None:
            await inode.pushed.wait()
