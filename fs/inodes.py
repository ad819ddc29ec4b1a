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

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import trio

from .cachedfile import CachedFile
from .fuseabi import ROOT_ID as ROOT
from .kernelpages import KernelCache

if TYPE_CHECKING:
    from .backing import Entry


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
    # When a name in it last changed here (a create, mkdir, unlink, rename):
    # attributes read before that are not reused, whoever stores them later.
    names_changed_at: float = 0.0
    # What the last lookup, stat or open found at this name (a manifest's
    # entry), and when: an open or a stat soon after may answer from it.
    checked: Entry | None = None
    checked_at: float = 0.0


class InodeTable:
    def __init__(self, let_go: Callable[[CachedFile], None]) -> None:
        # Called when a file loses an orphaned inode (it may be dropped now).
        self._let_go = let_go
        self._next = ROOT + 1
        self.by_ino: dict[int, Inode] = {ROOT: Inode(ROOT, ROOT, "", "dir", ("root", 0), 1)}
        self.by_name: dict[tuple[int, str], int] = {}

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

    def bind(self, parent: int, name: str, kind: str, ident: tuple[str, object]) -> Inode:
        """The inode for what is now at (parent, name); a new one if it changed."""
        existing = self.child(parent, name)
        if existing is not None and existing.ident == ident and existing.kind == kind:
            return existing
        if existing is not None:
            self.detach(parent, name)
        inode = Inode(self._next, parent, name, kind, ident)
        self._next += 1
        self.by_ino[inode.ino] = inode
        self.by_name[(parent, name)] = inode.ino
        return inode

    def attach(self, inode: Inode, f: CachedFile | None) -> None:
        """Make ``inode`` read ``f`` (None: nothing)."""
        old = inode.file
        if old is f:
            return
        inode.file = f
        if f is not None:
            f.ino = inode.ino
            f.orphan_inodes += inode.unlinked
        if old is not None and inode.unlinked:
            old.orphan_inodes -= 1
            self._let_go(old)

    def detach(self, parent: int, name: str) -> Inode | None:
        """Remove a name (unlink, rmdir, replaced); the inode lives on while referenced."""
        ino = self.by_name.pop((parent, name), None)
        if ino is None:
            return None
        inode = self.by_ino[ino]
        if not inode.unlinked:
            inode.unlinked = True
            if inode.file is not None:
                inode.file.orphan_inodes += 1  # kept for the kernel's last uses
        self._maybe_free(inode)
        return inode

    def move(self, inode: Inode, parent: int, name: str) -> None:
        self.by_name.pop((inode.parent, inode.name), None)
        inode.parent, inode.name = parent, name
        self.by_name[(parent, name)] = inode.ino

    def forget(self, ino: int, count: int) -> Inode | None:
        """Drop kernel references; returns the inode if it was freed."""
        inode = self.by_ino.get(ino)
        if inode is None or ino == ROOT:
            return None
        inode.nlookup = max(0, inode.nlookup - count)
        return inode if self._maybe_free(inode) else None

    def _maybe_free(self, inode: Inode) -> bool:
        if inode.nlookup or inode.opens or inode.ino == ROOT:
            return False
        if not inode.unlinked and inode.kind == "dir" and self._has_children(inode.ino):
            return False  # children compute their paths through this inode
        self.by_ino.pop(inode.ino, None)
        if self.by_name.get((inode.parent, inode.name)) == inode.ino:
            del self.by_name[(inode.parent, inode.name)]
        self.attach(inode, None)
        return True

    def _has_children(self, ino: int) -> bool:
        return any(parent == ino for parent, _ in self.by_name)
