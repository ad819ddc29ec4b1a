"""The filesystem's logic, free of FUSE types so it can be tested directly.

Names live in the backing directory (:mod:`backing`); file contents live in
the cache (:mod:`cache`), which owns their state, and are persisted by the
flusher. Close and fsync are the durability points: the file's journal
record is saved, its pending manifest is published, it is queued for
flushing, and at ``durability: backing`` the call waits until it is durable.

Ownership and permissions are those of a local filesystem: the kernel checks
permissions (``default_permissions``) against the attributes given here; new
files, directories and symlinks belong to the caller (with the parent's group
under a setgid directory), and the backing store keeps the owner on every
name, manifests included.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import itertools
import logging
import os
import stat
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import trio
from ckptfs.fs.cache.cache import Cache
from ckptfs.fs.cache.errors import FileLost, HoldersFailed
from ckptfs.fs.cache.journal import record_of
from ckptfs.fs.cache.writing import MAX_FILE_SIZE
from ckptfs.fs.config import Config
from ckptfs.fs.content.cachedfile import CachedFile, Snapshot
from ckptfs.fs.content.state import FileRole, FileState
from ckptfs.fs.flush.flusher import Flusher
from ckptfs.fs.interrupts import Interrupted, interruptible
from ckptfs.fs.namespace.inodes import ROOT, Inode, InodeTable
from ckptfs.fs.namespace.kernelpages import KernelCache, PagePusher, pieces
from ckptfs.fs.namespace.nslock import NamespaceLock
from ckptfs.fs.store.backing import Backing
from ckptfs.fs.store.chunkstore import ChunkCorrupt
from ckptfs.fs.store.entries import Entry, PlainFile
from ckptfs.fs.store.manifest import Manifest, new_id
from ckptfs.fs.store.publish import Published
from ckptfs.fs.store.renamelog import needs_record

log = logging.getLogger("ckptfs.fs")
PRIVILEGE_BITS = stat.S_ISUID | stat.S_ISGID
RETRY_INTERVAL = 5.0
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
# A read of a file pending elsewhere whose holders failed looks at its
# manifest, and tries again (made durable, or changed here meanwhile) this often.
HOLDERS_FAILED_TRIES = 3
# Threads whose open was sent back with ESTALE (a rename replaced its file)
# are remembered until their retry, or, past this many, for this long.
STALE_OPENS_KEPT = 1024
STALE_OPEN_FORGOTTEN = 60.0
# Renames a publish follows, one after another, before the name counts as
# gone: each follow finds where the file is now; a rename right after that
# one (a job renaming twice) needs another.
FOLLOWS = 5
T = TypeVar("T")


class FsError(OSError):
    """An error for the caller with an errno (becomes the FUSE reply).

    ``logged``: the cause was already logged where it happened.
    """

    def __init__(self, err: int, message: str = "", logged: bool = False) -> None:
        super().__init__(err, message or os.strerror(err))
        self.logged = logged


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
    blksize: int


@dataclass
class Handle:
    inode: Inode
    file: CachedFile | None = None
    plain_fd: int | None = None
    writable: bool = False
    uid: int = 0  # who opened it: writes by anyone but root clear setuid/setgid
    tid: int = 0  # the thread that opened it, as the kernel names it (0: unknown)


@dataclass
class SetAttr:
    mode: int | None = None
    uid: int | None = None
    gid: int | None = None
    size: int | None = None
    atime_ns: int | None = None
    mtime_ns: int | None = None


@dataclass
class Caller:
    uid: int
    gid: int
    tid: int = 0  # the calling thread, as the kernel names it (0: unknown)


def _changes_names(
    *parents: int,
) -> Callable[[Callable[..., Awaitable[T]]], Callable[..., Awaitable[T]]]:
    """For an operation that adds or removes a name in the directories its
    arguments ``parents`` (positions) name: once it ends, done or not, no
    getattr of them reuses the last look at their attributes (their mtime
    and link count moved; the kernel, which dropped its own copy, asks)."""

    def wrap(fn: Callable[..., Awaitable[T]]) -> Callable[..., Awaitable[T]]:
        @functools.wraps(fn)
        async def wrapper(self: FileSystem, *args: Any, **kwargs: Any) -> T:
            try:
                return await fn(self, *args, **kwargs)
            finally:
                for i in parents:
                    self.names_changed_in(args[i])

        return wrapper

    return wrap


def kills_privileges(mode: int) -> bool:
    """Whether a write (or chown) clears setuid/setgid, as Linux does: setuid
    always, setgid only with group-execute (without it, it marks mandatory locking)."""
    return bool(mode & stat.S_ISUID) or (mode & (stat.S_ISGID | stat.S_IXGRP)) == (
        stat.S_ISGID | stat.S_IXGRP
    )


def without_privileges(mode: int) -> int:
    mode &= ~stat.S_ISUID
    if mode & stat.S_IXGRP:
        mode &= ~stat.S_ISGID
    return mode


class BuddyMirror(Protocol):
    """The buddy mirroring the filesystem's commits wait for (peer/mirror/mirror.py)."""

    async def commit(self, snap: Snapshot, manifest: Manifest) -> list[str]:
        """Have the buddy hold ``snap``; the holders its pending manifest names."""
        ...

    async def renaming(self, moves: list[tuple[CachedFile, str]]) -> None:
        """Tell the buddy each file's new path, before the rename happens."""
        ...


class FileSystem:
    def __init__(self, config: Config, backing: Backing, cache: Cache, flusher: Flusher) -> None:
        self.config = config
        self.node = config.node
        self.backing = backing
        self.cache = cache
        self.flusher = flusher
        self.inodes = InodeTable(cache)
        self.handles: dict[int, Handle] = {}
        self.dir_handles: dict[int, tuple[int, list[tuple[str, Entry]] | None]] = {}
        self._fh = itertools.count(1)
        self.ns_lock = NamespaceLock()  # path-dependent backing updates (rename vs. publish)
        # Threads whose open got ESTALE because a rename replaced the file
        # meanwhile, and when: their retry is not sent back a second time.
        self._stale_opens: dict[int, float] = {}
        # Read-only opens that waited for a rename onto their name, and of
        # those, the ones sent back to walk the path again (`ckptfs stat`).
        self.opens_waited_for_rename = 0
        self.opens_sent_back = 0
        self._retry: set[CachedFile] = set()  # commits that failed; retried in the background
        # Set when one is added: an idle daemon's loop then sleeps until
        # something happens (each turn lapses the compiled reader's tickets).
        self._retry_wanted = trio.Event()
        # Plain files being adopted (by inode): a second open or a setattr of
        # one waits for the adoption, then acts on the adopted file.
        self._adopting: dict[int, trio.Event] = {}
        self.mirror: BuddyMirror | None = None  # set by the daemon at durability buddy
        # Set by the daemon once the FUSE session exists: pushes a saved
        # file's head and tail into the kernel's page cache at its close.
        self.kernel_pages: PagePusher | None = None
        cache.unreference = self._unreference

    # ----- attributes -------------------------------------------------------
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
            return _adopted(f, entry)
        return m.file_id == f.file_id and (f.handles > 0 or f.modified or f.version == m.version)

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
        if existing is not None and existing.file is not None and _adopted(existing.file, entry):
            return existing  # still the plain file it adopted: the same file
        if entry.kind == "plain" and (f := self._adopter(parent, name, entry)) is not None:
            # Its first publish failed (retried in the background) and the
            # kernel forgot its inode: the name is that file, not the plain one.
            inode = self.inodes.bind(parent, name, "file", ("file", f.file_id))
            self.inodes.attach(inode, f)
            return inode
        inode = self.inodes.bind(parent, name, entry.kind, entry.ident)
        self._checked(inode, entry)
        if entry.manifest is not None and inode.file is None:
            self.inodes.attach(inode, self.cache.files.get(entry.manifest.file_id))
        return inode

    @staticmethod
    def _is_bound(inode: Inode | None) -> Callable[[Entry], bool] | None:
        """Whether an entry is what ``inode`` was bound to (for a call that
        must act on exactly that: a rename's source); None if no inode."""
        if inode is None:
            return None
        ident, f = inode.ident, inode.file
        return lambda entry: entry.ident == ident or (f is not None and _adopted(f, entry))

    def _adopter(self, parent: int, name: str, entry: Entry) -> CachedFile | None:
        """A file that adopted the plain file ``entry`` at (parent, name) and
        whose first publish failed: it waits for a retry, with no handle."""
        if not self._retry:  # (each entry a listing binds asks)
            return None
        path = self.inodes.child_path(parent, name)
        return next((f for f in self._retry if f.path == path and _adopted(f, entry)), None)

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
            and inode.dir_attrs_at > inode.names_changed_at
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
            or (inode.file is not None and _adopted(inode.file, entry))
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
            inode.names_changed_at = time.monotonic()

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

    # ----- directories ------------------------------------------------------
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

    @_changes_names(0)
    async def mkdir(self, parent: int, name: str, mode: int, caller: Caller) -> Attr:
        path = self.inodes.child_path(parent, name)
        await self.backing.mkdir(
            path, mode & 0o7777, (caller.uid, caller.gid), self._dir_ino(parent)
        )
        return await self.lookup(parent, name)

    @_changes_names(0)
    async def rmdir(self, parent: int, name: str) -> None:
        path = self.inodes.child_path(parent, name)
        entry = await self._entry(path, parent)
        if entry.kind != "dir":
            raise FsError(errno.ENOTDIR)
        await self.backing.rmdir(path, self._dir_ino(parent))
        self.inodes.detach(parent, name)

    @_changes_names(0)
    async def symlink(self, parent: int, name: str, target: bytes, caller: Caller) -> Attr:
        path = self.inodes.child_path(parent, name)
        await self.backing.symlink(target, path, (caller.uid, caller.gid), self._dir_ino(parent))
        return await self.lookup(parent, name)

    async def readlink(self, ino: int) -> bytes:
        return await self.backing.readlink(
            self.inodes.path(ino), self._object_ino(self._inode(ino))
        )

    # ----- names ------------------------------------------------------------
    @_changes_names(0)
    async def unlink(self, parent: int, name: str) -> None:
        path = self.inodes.child_path(parent, name)
        async with self.ns_lock.exclusive():
            entry = await self._entry(path, parent)
            if entry.kind == "dir":
                raise FsError(errno.EISDIR)
            await self.backing.unlink(path, self._dir_ino(parent), entry)
            self._removed(parent, name, entry)
        log.debug("deleted %s", path)

    def _removed(self, parent: int, name: str, entry: Entry) -> None:
        """A name went away: its file's bytes live on only for open handles
        and for the kernel's inode (see fs/namespace/inodes.py)."""
        inode = self.inodes.child(parent, name)
        f = inode.file if inode is not None else None
        if f is None and entry.manifest is not None:
            f = self.cache.files.get(entry.manifest.file_id)
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

    @_changes_names(0, 2)
    async def rename(self, p_old: int, old: str, p_new: int, new: str, flags: int) -> None:
        if flags & ~getattr(os, "RENAME_NOREPLACE", 1):
            raise FsError(errno.EINVAL, "only RENAME_NOREPLACE is supported")
        # Opens of the file at the target name wait from now on (the path as
        # it is now: a rename of a parent meanwhile only makes them not wait).
        with self.ns_lock.replacing(self.inodes.child_path(p_new, new)):
            late = await self._rename(p_old, old, p_new, new, flags)
        # Pending versions' journal records name the path recovery looks at;
        # these became pending while the rename took its locks.
        for f in late:
            # Own files only (see _records_renamed); a file taken over from a
            # dead buddy has none either: its publish stays fenced.
            if f.role is FileRole.LOCAL and f.state is FileState.PENDING:
                await self.cache.journal.save(record_of(self.cache.journal_snapshot(f)))

    async def _rename(
        self, p_old: int, old: str, p_new: int, new: str, flags: int
    ) -> list[CachedFile]:
        """The rename; returns the files it moved that became pending after
        it took their record locks (their records name the old path)."""
        # The kernel holds the replaced file's inode lock until this returns
        # (readers' lseek(SEEK_END) of it wait): one backing-store call, if
        # no buddy has to hear of it first.
        async with self.ns_lock.exclusive(), contextlib.AsyncExitStack() as held:
            # Under the lock: a rename of a parent directory may have run meanwhile.
            old_path = self.inodes.child_path(p_old, old)
            new_path = self.inodes.child_path(p_new, new)
            records = await self._records_renamed(old_path, new_path, held)
            parents = (self._dir_ino(p_old), self._dir_ino(p_new))
            try:
                source, target, moved = await self.backing.rename_reading(
                    old_path,
                    new_path,
                    noreplace=bool(flags),
                    rename=self.mirror is None,
                    before=lambda: self._write_records(records),
                    node=self.cache.node,
                    record_ids=self._stale_pending_ids(p_old, old, old_path),
                    expect_parents=parents,
                    expect_source=self._is_bound(self.inodes.child(p_old, old)),
                )
            except FileNotFoundError:
                raise FsError(errno.ENOENT) from None
            except FileExistsError:
                raise FsError(errno.EEXIST) from None
            stale = self._known_elsewhere(source, old_path)
            if self.mirror is not None:
                # A takeover publishes at the path its buddy knows: a closed,
                # renamed file (torch.save to a temporary name, then os.replace)
                # must not be lost because the writer died between the rename
                # and telling the buddy. So the buddy hears first (it keeps
                # the old path too, in case this rename then fails).
                await self.mirror.renaming(
                    [
                        (f, new_path + f.path[len(old_path) :])
                        for f in self.cache.all_files()
                        if _at_or_under(f.path, old_path)
                    ]
                    + [(f, new_path) for f in stale]
                )
                await self.backing.rename(
                    old_path,
                    new_path,
                    before=lambda: self._write_records(records),
                    record_as=(
                        self.cache.node
                        if needs_record(source.kind, source.manifest, self.cache.node)
                        or any(
                            f.role is FileRole.LOCAL and f.state is FileState.PENDING for f in stale
                        )
                        else None
                    ),
                    expect_parents=parents,
                )
            if target is not None and target.ident != source.ident:
                self._removed(p_new, new, target)
            inode = self.inodes.child(p_old, old) or self._bind(p_old, old, source)
            self.inodes.move(inode, p_new, new)
            inode.checked = None  # a rename moves the manifest's ctime
            if moved is not None and inode.ident == moved.ident:
                # The source's manifest, read in the very store call that
                # renamed it (under the namespace lock), with the stat that
                # followed the rename: a check of the moved file, so the first
                # open after a torch.save + os.replace needs no store read.
                self._checked(inode, moved)
            # Again after the awaits: a truncate meanwhile forked a version.
            stale += [f for f in self._known_elsewhere(source, old_path) if f not in stale]
            repathed = self._repath(old_path, new_path)
            for f in stale:
                if not f.unlinked:
                    self.cache.move_path(f, new_path)
                    repathed.append(f)
        return [f for f in repathed if (f.file_id, f.version) not in records]

    def _stale_pending_ids(self, p_old: int, old: str, old_path: str) -> frozenset[str]:
        """The id of the file at ``old`` (as the kernel's lookup bound it) if
        this node holds a pending version of its own of it under a path
        another node's rename left stale: such a rename is recorded (see
        rename_reading). By the inode, not a scan of every cached file: this
        runs at each rename."""
        inode = self.inodes.child(p_old, old)
        if inode is None or inode.ident[0] != "file":
            return frozenset()
        file_id = str(inode.ident[1])
        return frozenset(
            f.file_id
            for f in self.cache.with_id(file_id)
            if f.role is FileRole.LOCAL
            and f.state is FileState.PENDING
            and not _at_or_under(f.path, old_path)
        )

    def _known_elsewhere(self, source: Entry, old_path: str) -> list[CachedFile]:
        """The renamed file's versions held here under another path: one a
        rename on another node moved, which this node's flush has not
        followed yet (renamelog.py). A rename here moves them too, or their
        flush would follow the record to the name this rename just left."""
        m = source.manifest
        if m is None:
            return []
        return [
            f
            for f in self.cache.with_id(m.file_id)
            if f.role not in (FileRole.MIRROR, FileRole.KEPT)
            and not f.unlinked
            and not _at_or_under(f.path, old_path)
        ]

    async def _records_renamed(
        self, old: str, new: str, held: contextlib.AsyncExitStack
    ) -> dict[tuple[str, str], dict[str, Any]]:
        """The journal records of the pending versions a rename of ``old``
        moves, with each record's lock taken in ``held``. They are written in
        the rename's backing-store call, just before it, naming the new path
        and the old one (``renamed_from``): recovery looks at both, so a
        crash on either side of the rename finds the manifest."""

        def moving() -> dict[tuple[str, str], CachedFile]:
            # This node's own files only: another node's pending file read
            # here (REMOTE) has no bytes here to recover, and a record would
            # make a crash's recovery adopt (and flush) an empty file.
            return {
                (f.file_id, f.version): f
                for f in self.cache.all_files()
                if f.role is FileRole.LOCAL
                and f.state is FileState.PENDING
                and _at_or_under(f.path, old)
            }

        # Locks first (each acquire may let a writer run), records after: a
        # writer that dropped a record meanwhile made its file MODIFIED, and
        # one that comes later waits for the lock, so no dropped record is
        # written back.
        locked = set(moving())
        for key in sorted(locked):  # others hold one record's lock at a time
            await held.enter_async_context(self.cache.journal.locked(key))
        records = {}
        for key, f in moving().items():
            if key not in locked:
                continue  # pending only since: saved after the rename (see rename)
            record = record_of(self.cache.journal_snapshot(f))
            record["path"], record["renamed_from"] = new + f.path[len(old) :], f.path
            records[key] = record
        return records

    def _write_records(self, records: dict[tuple[str, str], dict[str, Any]]) -> None:
        """In a backing-store call's thread: the journal records, as publish's
        ``before`` writes its own (journal.write_now)."""
        for key, record in records.items():
            try:
                self.cache.journal.write_now(key, record)
            except Exception as exc:  # tmpfs full or gone: the rename goes on, without crash safety
                log.error("cache journal for %s not rewritten for its rename (%s): a daemon "
                          "crash before it is durable loses it", record["path"], exc)  # fmt: skip

    def _repath(self, old: str, new: str) -> list[CachedFile]:
        return self.cache.repath(old, new)

    # ----- files ------------------------------------------------------------
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

    @_changes_names(0)
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

    def _manifest(
        self,
        f: CachedFile,
        version: str,
        size: int | None = None,
        holders: list[str] | None = None,
        seq: int | None = None,
    ) -> Manifest:
        """The pending manifest of ``f`` at ``version`` (its ``seq``: f's)."""
        return Manifest(
            f.file_id,
            version,
            f.size if size is None else size,
            f.mode,
            f.mtime_ns,
            "pending",
            holders or [self.node],
            atime_ns=f.atime_ns,
            seq=f.seq if seq is None else seq,
        )

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
            if self.cache.dropped_here(f) and self._first_stale_open(caller.tid):
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
        if inode.unlinked and self._first_stale_open(caller.tid):
            self.opens_sent_back += 1
            raise FsError(errno.ESTALE, f"{path}: renamed over while it was opened")

    def _first_stale_open(self, tid: int) -> bool:
        """Whether this thread's open may be sent back: not if the last one
        was (that is the kernel's retry, however long its lookup took). The
        thread's next open of this kind takes the mark back. Callers the
        kernel names 0 (another PID namespace) share one mark."""
        if self._stale_opens.pop(tid, None) is not None:
            return False
        now = time.monotonic()
        if len(self._stale_opens) >= STALE_OPENS_KEPT:  # threads that never came back
            self._stale_opens = {
                t: at for t, at in self._stale_opens.items() if now - at < STALE_OPEN_FORGOTTEN
            }
        self._stale_opens[tid] = now
        return True

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
        """The cached file behind an inode, (re)loaded from its manifest if needed."""
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
            if inode.file is not None and _adopted(inode.file, entry):
                return inode.file  # another open adopted the plain file meanwhile
            if entry.ident != inode.ident:
                # Another file is at the name now (replaced by another node):
                # the kernel's page cache of this inode holds the old file's
                # bytes, so the new file must come with a new inode. ESTALE
                # makes the kernel look the name up again and retry.
                raise FsError(errno.ESTALE, "replaced since it was looked up")
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

    @staticmethod
    async def _after_push(inode: Inode) -> None:
        """A writable open waits for a push of the inode's pages to end (see
        open); once it ends the inode is never pushed again."""
        if inode.kernel_cache is KernelCache.PUSHING and inode.pushed is not None:
            await inode.pushed.wait()

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

    async def commit(self, f: CachedFile, *, only_closed: bool = False) -> None:
        """Publish what has changed and queue it; wait at `backing` durability.
        ``only_closed``: not if a writer has it open by the time it is our turn
        (`ckptfs flush` leaves open files to their close)."""
        async with f.commit_lock:
            if only_closed and f.writers:
                return
            if f.state is FileState.MODIFIED:
                await self._publish_content(f)
        if self.config.durability == "backing" and f.state is not FileState.UNLINKED:
            await self.wait_durable(f)

    async def _publish_content(self, f: CachedFile) -> None:
        snap = self.cache.begin_publish(f, new_id())
        journal = self.cache.journal
        record = record_of(snap)
        key = (f.file_id, snap.version)

        def save_record() -> None:
            # In the same backing-store call, before the manifest: recovery must
            # find the record of any pending manifest it finds. The path is
            # read here, under the namespace lock: a rename while the buddy
            # took the content (before the lock) moved the file.
            record["path"] = f.path
            try:
                journal.write_now(key, record)
            except OSError as exc:  # tmpfs full or gone: publish anyway, without crash safety
                log.error("cache journal for %s not written (%s): a daemon crash before "
                          "it is durable loses it", f.path, exc)  # fmt: skip

        try:
            # Held from before the buddy's acknowledgement to the record's
            # write: a write meanwhile waits (in _begin_change) until the
            # record that lists these slots can be dropped, never after.
            async with journal.locked(key):
                if self.mirror is not None:
                    # durability buddy: the buddy holds this very content before
                    # any manifest names it as a holder (peer/mirror/mirror.py; falls
                    # back to local rather than raise, but may be cancelled).
                    snap.holders = await self.mirror.commit(
                        snap, self._manifest(f, snap.version, snap.size, seq=snap.seq)
                    )
                path = f.path
                result = await self.publish(
                    f,
                    lambda: self._manifest(f, snap.version, snap.size, snap.holders, snap.seq),
                    before=save_record,
                )
                for _ in range(FOLLOWS):
                    # Its directory (or the file) was renamed on another node
                    # while it was written here: its writes go where it is.
                    if result is not Published.NAME_GONE or not await self.follow_rename(f):
                        break
                    result = await self.publish(
                        f,
                        lambda: self._manifest(f, snap.version, snap.size, snap.holders, snap.seq),
                        before=save_record,
                    )
        except BaseException:
            self.cache.publish_failed(snap, name_gone=False)
            if f.state is FileState.MODIFIED and not f.writers:
                self._retry.add(f)  # nobody else will commit it
                self._retry_wanted.set()
            raise
        if result is not Published.DONE:
            self.cache.publish_failed(snap, name_gone=True)
            return
        self._retry.discard(f)
        if self.cache.published(snap):
            if f.path != path:  # renamed while its record was being written
                await journal.save(record_of(self.cache.journal_snapshot(f)))
            inode = self.inodes.get(f.ino) if f.ino else None
            if inode is not None:
                inode.kernel_version = f.version

    async def retry_commits(self) -> None:
        """Background task: commit again files whose commit failed (backing store
        errors), since no writer is left to do it."""
        while True:
            if not self._retry:
                await self._retry_wanted.wait()
                self._retry_wanted = trio.Event()
            await trio.sleep(RETRY_INTERVAL)
            for f in list(self._retry):
                if f.state is not FileState.MODIFIED or f.writers:
                    self._retry.discard(f)
                    continue
                try:
                    await self.commit(f)
                except OSError as exc:
                    log.warning("commit of %s failed again: %s", f.path, exc)

    async def wait_durable(self, f: CachedFile, timeout: float | None = None) -> None:
        limit = timeout if timeout is not None else max(600.0, 4 * self.config.backing_timeout)
        # Interruptible: the file is published and queued; only the wait ends.
        with interruptible(f"close of {f.path} waiting for the backing store"):
            with trio.move_on_after(limit):
                while f.state not in (FileState.DURABLE, FileState.UNLINKED):
                    await f.durable_event.wait()
                return
        raise FsError(errno.EIO, f"{f.path} did not become durable within {limit:.0f}s")

    async def publish(
        self,
        f: CachedFile,
        make: Callable[[], Manifest | None],
        *,
        expect_version: str | None = None,
        before: Callable[[], None] | None = None,
    ) -> Published:
        """Write ``make()`` at the file's current path if that path is still ours.

        The manifest is built under the namespace lock, so it reflects the
        file's state at the moment it is written (a metadata update can never
        put back a pending manifest over a newer durable one); ``make``
        returns None when what it would publish is already stale. With
        ``expect_version``, the manifest in the backing store must still be
        that version (another node may have published a newer one). The
        manifest file is owned by the file's owner; ``before`` runs in the
        same backing-store call, first.
        """
        async with self.ns_lock.shared(lambda: f.path) as path:
            if f.unlinked:
                return Published.NAME_GONE
            manifest = make()
            if manifest is None:
                return Published.STALE
            result = await self.backing.replace_manifest(
                path,
                manifest,
                (f.uid, f.gid),
                file_id=f.file_id,
                expect_version=expect_version,
                plain=f.replaces_plain,
                before=before,
            )
            if result is Published.DONE:
                self.cache.replacing_plain(f, None)
                self.backing.io.wrote()  # room in the store again, if it was full
            return result

    async def follow_rename(self, f: CachedFile) -> bool:
        """``f``'s name is gone from the backing store: True if its publish
        is to be tried again, because a rename recorded by another node
        moved it (renamelog.py) and ``f`` takes the path it is at now, or
        because ``f`` moved here meanwhile (an open found it, a rename here)."""
        old = f.path
        new = await self.backing.renamed_to(old, f.file_id)
        if f.unlinked:
            return False
        if f.path != old:
            return True
        if new is None:
            return False
        async with self.ns_lock.exclusive():
            if f.unlinked:
                return False
            if f.path != old:
                return True
            self.cache.move_path(f, new)
        log.info("%s was renamed to %s on another node: published there", old, new)
        if f.role is FileRole.LOCAL and f.state is FileState.PENDING:
            # Recovery after a crash looks where the journal record says.
            await self.cache.journal.save(record_of(self.cache.journal_snapshot(f)))
        return True

    async def publish_takeover(
        self, f: CachedFile, make: Callable[[], Manifest | None], expect_version: str
    ) -> Published:
        """Publish a buddy's file this node took over: only over exactly the
        version it mirrored (fenced; see Backing.takeover_manifest)."""
        async with self.ns_lock.shared(lambda: f.path) as path:
            manifest = make()
            if manifest is None or f.unlinked:
                return Published.STALE
            return await self.backing.takeover_manifest(
                path, manifest, file_id=f.file_id, expect_version=expect_version
            )

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
        await self.backing.set_attributes(
            path,
            self._object_ino(inode),
            mode=None if change.mode is None or inode.kind == "symlink" else change.mode & 0o7777,
            uid=-1 if change.uid is None else change.uid,
            gid=-1 if change.gid is None else change.gid,
            atime_ns=change.atime_ns,
            mtime_ns=change.mtime_ns,
        )
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

    async def statfs(self) -> os.statvfs_result:
        return await self.backing.statvfs()

    async def create_node(self, parent: int, name: str, mode: int, caller: Caller) -> Attr:
        """mknod of a regular file: create it empty and commit it."""
        if not stat.S_ISREG(mode):
            raise FsError(errno.EPERM, "only regular files, directories and symlinks exist here")
        fh, attr = await self.create(parent, name, mode, os.O_WRONLY, caller)
        await self.release(fh)
        return attr

    def files_under(self, prefix: str) -> list[CachedFile]:
        """Linked files at or under ``prefix``, and retired versions still owed."""
        return [
            f for f in self.cache.all_files() if (not f.unlinked) and in_subtree(f.path, prefix)
        ]

    def close_all(self) -> None:
        # The inode table needs no teardown: after unmount nothing reads it and
        # the process ends; only descriptors of plain files are ours to close.
        for fh in list(self.handles):
            handle = self.handles.pop(fh)
            if handle.plain_fd is not None:
                os.close(handle.plain_fd)

    def describe(self) -> dict[str, Any]:
        return {
            "handles": len(self.handles),
            "inodes": len(self.inodes.by_ino),
            "opens_waited_for_rename": self.opens_waited_for_rename,
            "opens_sent_back": self.opens_sent_back,
            "pages_pushed": self.kernel_pages.stats() if self.kernel_pages else {},
        }


def _at_or_under(path: str, prefix: str) -> bool:
    return path == prefix or path.startswith(prefix + "/")


def in_subtree(path: str, prefix: str) -> bool:
    """Whether ``path`` is in what an operator's PATH names ("": everything)."""
    return not prefix or _at_or_under(path, prefix)


def _adopted(f: CachedFile, entry: Entry) -> bool:
    """Whether ``entry`` is the plain file that ``f`` adopted and has not yet
    replaced: until its first publish the name still shows that plain file,
    and it is the same file (a lookup must not make a second one of it)."""
    return (
        not f.unlinked
        and f.replaces_plain is not None
        and entry.kind == "plain"
        and f.replaces_plain.matches(entry.st)
    )
