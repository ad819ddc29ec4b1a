"""rename(2): the backing-store rename, the buddy told first, records moved.

A rename runs alone under the namespace lock. The journal records of the
pending versions it moves are rewritten in its backing-store call, naming
both paths, so recovery after a crash on either side of it finds their
manifests; at durability ``buddy`` the buddy hears of the new paths first. A
file held here under a path that a rename on another node left stale
(renamelog.py) moves with it.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
from typing import Any

from ckptfs.fs.cache.journal import record_of
from ckptfs.fs.content.cachedfile import CachedFile
from ckptfs.fs.content.state import FileRole, FileState
from ckptfs.fs.namespace.names import changes_names
from ckptfs.fs.namespace.posix import FsError, at_or_under
from ckptfs.fs.store.entries import Entry
from ckptfs.fs.store.renamelog import needs_record

log = logging.getLogger("ckptfs.fs")


class RenameMixin:
    """rename and what it keeps consistent: records, the buddy, stale paths.

    A part of :class:`~ckptfs.fs.namespace.filesystem.FileSystem`: it uses
    the state its ``__init__`` sets and the methods of its other parts.
    """

    @changes_names(0, 2)
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
            kept = await self._unconfirmed_renamed(old_path, new_path, held)
            records.update({key: moved_to for key, (_, moved_to) in kept.items()})
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
                        if at_or_under(f.path, old_path)
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
            # Renamed in the store: the kept records name where it went (their
            # journal records, written just before, name both paths).
            for key, (was, moved_to) in kept.items():
                if self.cache.unconfirmed.get(key) is was:
                    self.cache.unconfirmed.add(key, moved_to)
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
            and not at_or_under(f.path, old_path)
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
            and not at_or_under(f.path, old_path)
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
                and at_or_under(f.path, old)
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

    async def _unconfirmed_renamed(
        self, old: str, new: str, held: contextlib.AsyncExitStack
    ) -> dict[tuple[str, str], tuple[dict[str, Any], dict[str, Any]]]:
        """The same for the crashed daemon's versions recovery keeps
        unconfirmed (fs/cache/unconfirmed.py): no renamelog record follows a
        rename of this node's own file, so without this their next look
        would find nothing at the old path and let them go. Each kept record
        and the one that replaces it once the rename is done, naming both
        paths as its journal record will; with their locks taken in
        ``held``, which a look (recovery.confirm_later) takes too."""
        moving = [
            key for key, r in self.cache.unconfirmed.items() if at_or_under(str(r["path"]), old)
        ]
        for key in sorted(moving):
            await held.enter_async_context(self.cache.journal.locked(key))
        kept = {}
        for key in moving:
            record = self.cache.unconfirmed.get(key)
            if record is None:
                continue  # adopted or let go while the locks were taken
            path = str(record["path"])
            kept[key] = (record, {**record, "path": new + path[len(old) :], "renamed_from": path})
        return kept

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
