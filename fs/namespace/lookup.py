"""Names to inodes, and inodes' attributes: lookup, getattr, readdir.

A lookup reads the backing entry at a name and binds it to an inode
(:mod:`inodes`), with no rename in between (``_resolved``); getattr answers
from the cached file, the last check of its manifest or the directory's last
look where that is current enough, else from the backing store. A listing
(opendir/readdir) is read once per handle and binds only the entries it
returns. The checks of a file's manifest (``_checked``) kept on its inode
are what opens and stats reuse.
"""

from __future__ import annotations

import errno
import stat
import time
from collections.abc import Callable
from typing import TypeVar

import trio
from ckptfs.fs.content.cachedfile import CachedFile
from ckptfs.fs.namespace.adoption import adopted
from ckptfs.fs.namespace.inodes import ROOT, Inode
from ckptfs.fs.namespace.posix import Attr, FsError
from ckptfs.fs.store.entries import Entry

# Below the kernel's own attribute timeout: no staler than what it caches anyway.
DIR_ATTR_REUSE = 0.5
# st_blksize sizes the buffers of Python's open() and of stdio. Without the
# writeback cache each buffered write() is one FUSE request, so a file being
# written gets large ones; any other file gets a local disk's, so that a
# reader's small reads after a seek (torch's zip directory) do not refill
# 1 MiB from the page cache each time (docs/PERFORMANCE.md).
WRITE_BLKSIZE = 1 << 20
READ_BLKSIZE = 4096
# Entries a READDIRPLUS binds between two turns of the loop: a 1 MiB reply
# holds about 5,000 (glibc's readdir asks for 32 KiB, under 200).
READDIR_BATCH = 256
# Reads of a name that a rename overlapped before a lookup waits for a gap.
RESOLVE_TRIES = 3
T = TypeVar("T")


class LookupMixin:
    """Lookups, attributes, the inode table's bookkeeping, directory listings.

    A part of :class:`~ckptfs.fs.namespace.filesystem.FileSystem`: it uses
    the state its ``__init__`` sets and the methods of its other parts.
    """

    def _attr(self, inode: Inode, entry: Entry | None) -> Attr:
        f = inode.file
        st = entry.st if entry else None
        now = time.time_ns()
        if inode.kind == "file" and f is not None and (entry is None or self._local(f, entry)):
            mode, size, uid, gid = stat.S_IFREG | f.mode, f.size, f.uid, f.gid
            atime, mtime = f.atime_ns, f.mtime_ns
        elif entry is not None and entry.manifest is not None:
            m = entry.manifest
            mode, size = stat.S_IFREG | (m.mode & 0o7777), m.size
            uid, gid, atime, mtime = entry.st.st_uid, entry.st.st_gid, m.atime, m.mtime_ns
        elif st is not None:
            mode, size, uid, gid = st.st_mode, st.st_size, st.st_uid, st.st_gid
            atime, mtime = st.st_atime_ns, st.st_mtime_ns
        else:
            raise FsError(errno.ENOENT)
        return Attr(
            ino=inode.ino,
            mode=mode,
            size=size,
            nlink=0 if inode.unlinked else (st.st_nlink if st and inode.kind == "dir" else 1),
            uid=uid,
            gid=gid,
            atime_ns=atime,
            mtime_ns=mtime,
            ctime_ns=st.st_ctime_ns if st else now,
            blksize=WRITE_BLKSIZE if f is not None and f.writers else READ_BLKSIZE,
        )

    @staticmethod
    def _local(f: CachedFile, entry: Entry) -> bool:
        """Whether our cached copy, not the entry, is authoritative for attributes."""
        m = entry.manifest
        if m is None:
            return adopted(f, entry)
        return m.file_id == f.file_id and (
            f.handles > 0 or f.modified or f.version == m.version or f.supersedes(m)
        )

    async def _entry(self, path: str, parent: int | None = None) -> Entry:
        """The entry at ``path``; with ``parent`` (its directory's inode),
        ESTALE if that directory is not the one the inode was bound to."""
        try:
            return await self.backing.entry(path, self._dir_ino(parent))
        except FileNotFoundError:
            raise FsError(errno.ENOENT) from None

    def _dir_ino(self, ino: int | None) -> int | None:
        """The backing st_ino a directory's inode was bound to: what a call
        through it expects to find (backing.py); None for the root, which
        never moves, and for anything unknown."""
        inode = self.inodes.get(ino) if ino is not None else None
        if inode is None or inode.ident[0] != "dir":
            return None
        return int(inode.ident[1])  # type: ignore[call-overload]

    @staticmethod
    def _object_ino(inode: Inode) -> int | None:
        """The backing st_ino of a directory, symlink or plain file's inode
        (what setattr expects to find at its name); None for the root."""
        if inode.ident[0] not in ("dir", "symlink", "plain"):
            return None
        return int(inode.ident[1])  # type: ignore[call-overload]

    def _bind(self, parent: int, name: str, entry: Entry) -> Inode:
        existing = self.inodes.child(parent, name)
        if existing is not None and existing.file is not None and adopted(existing.file, entry):
            return existing  # still the plain file it adopted: the same file
        if entry.kind == "plain" and (f := self._adopter(parent, name, entry)) is not None:
            # Its first publish failed (retried in the background) and the
            # kernel forgot its inode: the name is that file, not the plain one.
            inode = self.inodes.bind(parent, name, "file", ("file", f.file_id))
            self.inodes.attach(inode, f)
            return inode
        fresh = existing is not None and self._open_on_another_version(existing, entry)
        inode = self.inodes.bind(parent, name, entry.kind, entry.ident, fresh=fresh)
        self._checked(inode, entry)
        m = entry.manifest
        if m is not None and inode.file is None:
            f = self.cache.files.get(m.file_id)
            if f is not None and f.stands_for(m):
                self.inodes.attach(inode, f)  # (another version is loaded by the open)
        return inode

    @staticmethod
    def _open_on_another_version(inode: Inode, entry: Entry) -> bool:
        """Whether ``inode`` is open (or its last RELEASE is still on its
        way) on a version of its file other than the one ``entry`` shows at
        its name, a version another node wrote. Then the name's version needs
        an inode of its own: the kernel keeps one size per inode, and one
        inode with handles of two versions would read the bytes of one with
        the size of the other (bug 1 of docs/FAULT-TRIALS.md). The old inode
        goes on reading its version, as a file replaced under an open
        descriptor does; a file changed here is one version, shared. An
        older version than the inode's (a read that a newer load overtook)
        changes nothing."""
        f, m = inode.file, entry.manifest
        return (
            inode.kind == "file"
            and inode.opens > 0
            and f is not None
            and m is not None
            and f.file_id == m.file_id
            and m.order > (f.seq, f.version)
            and not (f.writers or f.modified)
        )

    @staticmethod
    def _is_bound(inode: Inode | None) -> Callable[[Entry], bool] | None:
        """Whether an entry is what ``inode`` was bound to (for a call that
        must act on exactly that: a rename's source); None if no inode."""
        if inode is None:
            return None
        ident, f = inode.ident, inode.file
        return lambda entry: entry.ident == ident or (f is not None and adopted(f, entry))

    def _adopter(self, parent: int, name: str, entry: Entry) -> CachedFile | None:
        """A file that adopted the plain file ``entry`` at (parent, name) and
        whose first publish failed: it waits for a retry, with no handle."""
        if not self._retry:  # (each entry a listing binds asks)
            return None
        path = self.inodes.child_path(parent, name)
        return next((f for f in self._retry if f.path == path and adopted(f, entry)), None)

    async def _resolved(
        self, path_of: Callable[[], str], bind: Callable[[Entry], T], parent: Callable[[], int]
    ) -> T:
        """``bind(entry)`` for the backing entry at ``path_of()`` in the
        directory whose inode is ``parent()``, with no rename or unlink in
        between: an entry read before a rename and bound after it would give
        the old file's identity to the name (and take it from the inode
        renamed there)."""
        for _ in range(RESOLVE_TRIES):
            generation = self.ns_lock.generation
            entry = await self._entry(path_of(), parent())
            if self.ns_lock.stable_since(generation):
                return bind(entry)
        async with self.ns_lock.reading():  # renames keep coming: wait for a gap
            return bind(await self._entry(path_of(), parent()))

    async def lookup(self, parent: int, name: str) -> Attr:
        def bind(entry: Entry) -> Attr:
            inode = self._bind(parent, name, entry)
            inode.nlookup += 1
            return self._attr(inode, entry)

        return await self._resolved(
            lambda: self.inodes.child_path(parent, name), bind, lambda: parent
        )

    def getattr_now(self, ino: int) -> Attr | None:
        """The attributes if they need no backing-store read, else None."""
        inode = self._inode(ino)
        if inode.unlinked:
            return self._attr(inode, None)
        f = inode.file
        if inode.kind == "file" and f is not None and (f.writers or f.modified):
            return self._attr(inode, None)  # being written here: our copy is current
        # The kernel asks after every read (a read invalidates its cached
        # atime): torch.load's getsize between its two opens would pay a
        # backing-store round trip. An open file's attributes are our copy's
        # whatever the name holds now (see _local); a closed one's the last
        # check's, if it is as recent as an open may reuse.
        if (
            inode.kind == "file"
            and f is not None
            and (seen := self._last_check(inode, f)) is not None
            and (f.handles or self._recently_checked(inode))
        ):
            return self._attr(inode, seen)
        if inode.kind == "dir" and self._dir_attrs_reusable(inode):
            return self._attr(inode, inode.dir_attrs)
        return None

    @staticmethod
    def _dir_attrs_reusable(inode: Inode) -> bool:
        """Whether the directory's last look may answer a getattr now: recent,
        and read after the last change of a name in it here (a look that
        began before it may be stored after it, by the request thread)."""
        return (
            inode.dir_attrs is not None
            and inode.dir_attrs_at > inode.changed_at
            and time.monotonic() - inode.dir_attrs_at < DIR_ATTR_REUSE
        )

    @staticmethod
    def _keep_dir_attrs(inode: Inode, entry: Entry, read_at: float) -> None:
        """The directory's attributes as a look that began at ``read_at``
        found them, unless a later look's are kept already."""
        if inode.dir_attrs is None or read_at >= inode.dir_attrs_at:
            inode.dir_attrs, inode.dir_attrs_at = entry, read_at

    def _getattr_with(self, inode: Inode, entry: Entry, read_at: float) -> Attr:
        same = (
            entry.ident == inode.ident
            or inode.ino == ROOT
            or (inode.file is not None and adopted(inode.file, entry))
        )
        if same:
            self._checked(inode, entry)
        if inode.kind == "dir" and same:
            self._keep_dir_attrs(inode, entry, read_at)
        if not same and inode.file is None and not inode.unlinked:
            raise FsError(errno.ESTALE, "replaced since it was looked up")
        return self._attr(inode, entry if same else None)

    async def getattr(self, ino: int) -> Attr:
        attr = self.getattr_now(ino)
        if attr is not None:
            return attr
        inode = self._inode(ino)
        now = time.monotonic()
        try:
            entry = await self.backing.entry(self.inodes.path(ino), self._dir_ino(inode.parent))
        except FileNotFoundError:
            if inode.file is not None:
                return self._attr(inode, None)
            # Removed elsewhere while the kernel's entry lived: it looks the
            # name up again (a stat by path then answers what is there now).
            raise FsError(errno.ESTALE, "its name was removed elsewhere") from None
        return self._getattr_with(inode, entry, now)

    def name_of(self, ino: int) -> tuple[int, str] | None:
        """(parent, name) of a named inode; None for the root or an unlinked one."""
        inode = self.inodes.get(ino)
        if inode is None or inode.unlinked or ino == ROOT:
            return None
        return inode.parent, inode.name

    def names_changed_in(self, parent: int) -> None:
        """A name was added to or removed from directory ``parent`` here:
        no look at its attributes that began before now is reused."""
        inode = self.inodes.get(parent)
        if inode is not None:
            inode.changed_at = time.monotonic()

    def _inode(self, ino: int) -> Inode:
        inode = self.inodes.get(ino)
        if inode is None:
            raise FsError(errno.ENOENT, f"unknown inode {ino}")
        return inode

    def _unreference(self, f: CachedFile) -> None:
        """The cache forgot ``f``: the next open reloads it from its manifest."""
        inode = self.inodes.get(f.ino) if f.ino is not None else None
        if inode is not None and inode.file is f:
            self.inodes.attach(inode, None)

    def forget(self, ino: int, count: int) -> None:
        self.inodes.forget(ino, count)

    @staticmethod
    def _checked(inode: Inode, entry: Entry) -> None:
        if entry.manifest is not None:
            # Kept until the next check or until the kernel forgets the inode
            # (a `ls -l` of a checkpoint tree binds many): without chunks.
            inode.checked, inode.checked_at = entry.kept(), entry.read_at

    @staticmethod
    def _last_check(inode: Inode, f: CachedFile) -> Entry | None:
        """The last check's entry for the inode's name, if it found ``f`` at
        the version we hold (not an older or newer one, nor another file)."""
        seen = inode.checked
        if seen is None or seen.manifest is None or f.unlinked:
            return None
        m = seen.manifest
        return seen if (m.file_id, m.version) == (f.file_id, f.version) else None

    def _recently_checked(self, inode: Inode) -> bool:
        """Whether an open or a stat may reuse the last check (``fuse.open_recheck``)."""
        return time.monotonic() - inode.checked_at < self.config.open_recheck

    async def opendir(self, ino: int) -> int:
        if self._inode(ino).kind != "dir":
            raise FsError(errno.ENOTDIR)
        fh = next(self._fh)
        self.dir_handles[fh] = (ino, None)
        return fh

    async def readdir(
        self, fh: int, start: int, fits: Callable[[str], bool]
    ) -> list[tuple[int, str, Attr]]:
        """(offset, name, attributes) of the listing's entries from offset
        ``start`` on, for as long as ``fits`` takes their names (the room
        left in the reply). The listing is read once per opendir, so an
        entry's offset (its index + 1) means the same entry for as long as
        the handle lives, whatever names come and go meanwhile. Only the
        entries returned are bound to inodes, each counted as a reference the
        kernel gets with the reply."""
        ino, listing = self.dir_handles[fh]
        if listing is None:
            listing = await self.backing.listdir(self.inodes.path(ino), self._dir_ino(ino))
            self.dir_handles[fh] = (ino, listing)
        sent: list[tuple[int, str, Attr]] = []
        try:
            for offset in range(start, len(listing)):
                name, entry = listing[offset]
                if not fits(name):
                    break
                # The listing may be older than what lookup saw since: an inode the
                # kernel already knows is kept, never replaced from the snapshot.
                inode = self.inodes.child(ino, name) or self._bind(ino, name, entry)
                sent.append((offset + 1, name, self._attr(inode, entry)))
                inode.nlookup += 1
                if len(sent) % READDIR_BATCH == 0:
                    await trio.sleep(0)  # a reply of thousands: let other requests in
        except BaseException:
            for _, _, attr in sent:  # never sent: the kernel has no reference
                self.forget(attr.ino, 1)
            raise
        return sent

    def releasedir(self, fh: int) -> None:
        self.dir_handles.pop(fh, None)
