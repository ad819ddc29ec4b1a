"""Inode numbers for names in the backing namespace, with kernel lookup counts.

An inode is bound to ``(parent inode, name)`` and to the identity of what is
there (a manifest's file id, else the backing st_ino), so a name replaced by
another node gets a new inode. Numbers are never reused within a mount.
Paths are computed by walking parents, so a directory rename moves its whole
subtree at once.

An inode whose name was removed through this mount (an unlink, a rename over
it) keeps the cached file it reads for as long as the kernel knows it, not
only while it is open: a path walk that resolved the name just before opens
that inode afterwards, and must get the old bytes, as on any POSIX
filesystem. So an unlinked file's content goes only when its last handle is
closed *and* the kernel has forgotten its orphaned inodes, which it does as
soon as nothing uses them. An inode still bound to a name does not keep a
file: its next open reads the name again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import trio
from ckptfs.fs.content.cachedfile import CachedFile
from ckptfs.fs.namespace.kernelpages import KernelCache

if TYPE_CHECKING:
    from ckptfs.fs.store.entries import Entry

ROOT = 1  # FUSE_ROOT_ID: the nodeid the kernel gives the mount's root


class FileRefs(Protocol):
    """What the inode table tells the cache (fs/cache/cache.py): which
    inodes read a file, so that a removed file lives exactly as long as the
    kernel may still use it."""

    def inode_attached(self, f: CachedFile, ino: int, unlinked: bool) -> None: ...

    def inode_unlinked(self, f: CachedFile) -> bool: ...

    def inode_detached(self, f: CachedFile) -> None: ...


@dataclass(eq=False, slots=True)
class Inode:
    ino: int
    parent: int
    name: str
    kind: str  # "dir" | "symlink" | "plain" | "file"
    ident: tuple[str, object]
    nlookup: int = 0
    opens: int = 0
    unlinked: bool = False
    file: CachedFile | None = None
    kernel_version: str | None = None  # the version the kernel's page cache holds
    kernel_cache: KernelCache = KernelCache.ANY  # what it may hold (kernelpages.py)
    pushed: trio.Event | None = None  # set when a push (PUSHING) ends
    # A directory's last backing-store attributes and when they were read:
    # the kernel asks again after every create in it (it invalidates the
    # parent), and a round trip per create halves small-file throughput.
    dir_attrs: Entry | None = None
    dir_attrs_at: float = 0.0
    # When a name in it, or its own attributes, last changed here (a create,
    # mkdir, unlink, rename; a chmod, chown, utime): attributes read before
    # that are not reused, whoever stores them later.
    changed_at: float = 0.0
    # What the last lookup, stat or open found at this name (a manifest's
    # entry), and when: an open or a stat soon after may answer from it.
    checked: Entry | None = None
    checked_at: float = 0.0


class InodeTable:
    def __init__(self, refs: FileRefs) -> None:
        # Called when a file loses an orphaned inode (it may be dropped now).
        self._refs = refs  # the cache: it counts the inodes that read a file
        self._next = ROOT + 1
        self.by_ino: dict[int, Inode] = {ROOT: Inode(ROOT, ROOT, "", "dir", ("root", 0), 1)}
        self.by_name: dict[tuple[int, str], int] = {}
        # How many names by_name binds in each directory (absent: none). A
        # directory the kernel forgot is kept while it has any, since they
        # compute their paths through it: this answers that without a scan
        # of every name, and tells when the last one goes.
        self.children: dict[int, int] = {}

    def __getitem__(self, ino: int) -> Inode:
        return self.by_ino[ino]

    def get(self, ino: int) -> Inode | None:
        return self.by_ino.get(ino)

    def path(self, ino: int) -> str:
        parts = []
        while ino != ROOT:
            inode = self.by_ino[ino]
            parts.append(inode.name)
            ino = inode.parent
        return "/".join(reversed(parts))

    def child_path(self, parent: int, name: str) -> str:
        base = self.path(parent)
        return f"{base}/{name}" if base else name

    def child(self, parent: int, name: str) -> Inode | None:
        ino = self.by_name.get((parent, name))
        return self.by_ino[ino] if ino is not None else None

    def bind(
        self, parent: int, name: str, kind: str, ident: tuple[str, object], *, fresh: bool = False
    ) -> Inode:
        """The inode for what is now at (parent, name); a new one if it
        changed, or if ``fresh`` (the old one keeps what it reads)."""
        existing = self.child(parent, name)
        if existing is not None and existing.ident == ident and existing.kind == kind and not fresh:
            return existing
        if existing is not None:
            self._unlink(existing)  # the parent gets a name again at once: it stays
        inode = Inode(self._next, parent, name, kind, ident)
        self._next += 1
        self.by_ino[inode.ino] = inode
        self._name(inode, parent, name)
        return inode

    def attach(self, inode: Inode, f: CachedFile | None) -> None:
        """Make ``inode`` read ``f`` (None: nothing)."""
        old = inode.file
        if old is f:
            return
        inode.file = f
        if f is not None:
            self._refs.inode_attached(f, inode.ino, inode.unlinked)
        if old is not None and inode.unlinked:
            self._refs.inode_detached(old)

    def detach(self, parent: int, name: str) -> Inode | None:
        """Remove a name (unlink, rmdir, replaced); the inode lives on while referenced."""
        inode = self.child(parent, name)
        if inode is None:
            return None
        self._unlink(inode)
        self._free_unused(self.by_ino.get(parent))
        return inode

    def move(self, inode: Inode, parent: int, name: str) -> None:
        """Give ``inode`` the name (parent, name), unlinking whatever had it."""
        old_parent = inode.parent
        if self.by_name.get((inode.parent, inode.name)) == inode.ino:
            self._unname(inode.parent, inode.name)
        there = self.child(parent, name)
        if there is not None and there is not inode:
            self._unlink(there)
        self._name(inode, parent, name)
        if old_parent != parent:
            self._free_unused(self.by_ino.get(old_parent))

    def forget(self, ino: int, count: int) -> Inode | None:
        """Drop kernel references; returns the inode if it was freed."""
        inode = self.by_ino.get(ino)
        if inode is None or ino == ROOT:
            return None
        inode.nlookup = max(0, inode.nlookup - count)
        return inode if self._free_unused(inode) else None

    def _name(self, inode: Inode, parent: int, name: str) -> None:
        """Bind the free name (parent, name) to ``inode``."""
        inode.parent, inode.name = parent, name
        self.by_name[(parent, name)] = inode.ino
        self.children[parent] = self.children.get(parent, 0) + 1

    def _unname(self, parent: int, name: str) -> None:
        """Remove the bound name (parent, name)."""
        del self.by_name[(parent, name)]
        left = self.children[parent] - 1
        if left:
            self.children[parent] = left
        else:
            del self.children[parent]

    def _unlink(self, inode: Inode) -> None:
        """Take its name from ``inode`` (bound to it); freed if nothing needs
        it. Its parent is left as it is (see :meth:`_free_unused`)."""
        self._unname(inode.parent, inode.name)
        if not inode.unlinked:
            inode.unlinked = True
            # Kept for the kernel's last uses, unless it went already (its
            # name changed on another node and nothing held it): then an
            # open is sent back to the name (ESTALE), never given a file
            # with no bytes left, which would read as zeros.
            if inode.file is not None and not self._refs.inode_unlinked(inode.file):
                inode.file = None
        self._free_unused(inode)

    def _needed(self, inode: Inode) -> bool:
        if inode.nlookup or inode.opens or inode.ino == ROOT:
            return True
        # A directory's named children compute their paths through it.
        return not inode.unlinked and inode.kind == "dir" and inode.ino in self.children

    def _free_unused(self, inode: Inode | None) -> bool:
        """Free ``inode`` if nothing needs it, then each parent that this
        leaves with no need either; whether ``inode`` was freed."""
        if inode is None or self._needed(inode):
            return False
        parent = self._free(inode)
        while parent is not None and not self._needed(parent):
            parent = self._free(parent)
        return True

    def _free(self, inode: Inode) -> Inode | None:
        """Forget ``inode``; returns its parent if it took a name from it."""
        self.by_ino.pop(inode.ino, None)
        named = self.by_name.get((inode.parent, inode.name)) == inode.ino
        if named:
            self._unname(inode.parent, inode.name)
        self.attach(inode, None)
        return self.by_ino.get(inode.parent) if named else None
