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

The operations are composed from one part per job, each in its own module:
lookups, attributes and listings (:mod:`lookup`), names added and removed
(:mod:`names`), renames (:mod:`rename`), opens (:mod:`opening`), plain-file
adoption (:mod:`adoption`), I/O through a handle (:mod:`fileio`), commits
and publishes (:mod:`commits`), setattr (:mod:`setattr`). This module holds
the state they share and the filesystem-wide calls (statfs, describe).
"""

from __future__ import annotations

import itertools
import os
from typing import Any

import trio
from ckptfs.fs.cache.cache import Cache
from ckptfs.fs.config import Config
from ckptfs.fs.content.cachedfile import CachedFile
from ckptfs.fs.flush.flusher import Flusher
from ckptfs.fs.namespace.adoption import AdoptionMixin
from ckptfs.fs.namespace.commits import BuddyMirror, CommitMixin
from ckptfs.fs.namespace.fileio import FileIOMixin
from ckptfs.fs.namespace.inodes import InodeTable
from ckptfs.fs.namespace.kernelpages import PagePusher
from ckptfs.fs.namespace.lookup import LookupMixin
from ckptfs.fs.namespace.names import NamesMixin
from ckptfs.fs.namespace.nslock import NamespaceLock
from ckptfs.fs.namespace.opening import OpenMixin
from ckptfs.fs.namespace.posix import Handle, in_subtree
from ckptfs.fs.namespace.rename import RenameMixin
from ckptfs.fs.namespace.setattr import SetAttrMixin
from ckptfs.fs.namespace.staleopens import StaleOpens
from ckptfs.fs.store.backing import Backing
from ckptfs.fs.store.entries import Entry


class FileSystem(
    LookupMixin,
    NamesMixin,
    RenameMixin,
    OpenMixin,
    AdoptionMixin,
    FileIOMixin,
    CommitMixin,
    SetAttrMixin,
):
    """The POSIX operations of a mount, free of FUSE types."""

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
        # meanwhile: their retry is not sent back a second time.
        self.stale_opens = StaleOpens()
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

    async def statfs(self) -> os.statvfs_result:
        return await self.backing.statvfs()

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
