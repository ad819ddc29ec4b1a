"""Commits: a changed file's pending manifest published, its flush queued.

A commit (close, fsync, `ckptfs flush`, a retry) snapshots the file, has the
buddy hold it at durability ``buddy``, and publishes its pending manifest
with its journal record written in the same backing-store call; at
durability ``backing`` it waits until the file is durable. A publish whose
name went because a rename on another node moved it follows the rename.
Commits that failed are retried in the background. A takeover of a dead
buddy's file publishes through here too (fenced).
"""

from __future__ import annotations

import errno
import logging
import time
from collections.abc import Callable
from typing import Protocol

import trio
from ckptfs.fs.cache.journal import record_of
from ckptfs.fs.content.cachedfile import CachedFile, Snapshot
from ckptfs.fs.content.state import FileRole, FileState
from ckptfs.fs.interrupts import interruptible
from ckptfs.fs.namespace.posix import FsError
from ckptfs.fs.store.manifest import Manifest, new_id
from ckptfs.fs.store.publish import Published

log = logging.getLogger("ckptfs.fs")
RETRY_INTERVAL = 5.0
# Renames a publish follows, one after another, before the name counts as
# gone: each follow finds where the file is now; a rename right after that
# one (a job renaming twice) needs another.
FOLLOWS = 5


class BuddyMirror(Protocol):
    """The buddy mirroring the filesystem's commits wait for (peer/mirror/client.py)."""

    async def commit(self, snap: Snapshot, manifest: Manifest) -> list[str]:
        """Have the buddy hold ``snap``; the holders its pending manifest names."""
        ...

    async def renaming(self, moves: list[tuple[CachedFile, str]]) -> None:
        """Tell the buddy each file's new path, before the rename happens."""
        ...


class CommitMixin:
    """commit, publish, follow_rename, wait_durable, the background retries.

    A part of :class:`~ckptfs.fs.namespace.filesystem.FileSystem`: it uses
    the state its ``__init__`` sets and the methods of its other parts.
    """

    async def commit(self, f: CachedFile, *, only_closed: bool = False) -> None:
        """Publish what has changed and queue it; wait at `backing` durability.
        ``only_closed``: not if a writer has it open by the time it is our turn
        (`ckptfs flush` leaves open files to their close)."""
        async with f.commit_lock:
            if only_closed and f.writers:
                return
            if f.state is FileState.MODIFIED and not await self._publish_content(f):
                return  # superseded for now: nothing of it to wait for
        if self.config.durability == "backing" and f.state is not FileState.UNLINKED:
            await self.wait_durable(f)

    async def _publish_content(self, f: CachedFile) -> bool:
        """Publish ``f``'s content; False if a newer version from another
        node is at its name while ``f`` is still being written here (then
        it stays MODIFIED, for its last close)."""
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
                    # any manifest names it as a holder (peer/mirror/client.py; falls
                    # back to local rather than raise, but may be cancelled).
                    snap.holders = await self.mirror.commit(
                        snap, self._manifest(f, snap.version, snap.size, seq=snap.seq)
                    )
                path = f.path
                result, tried = await self.publish(
                    f,
                    lambda: self._manifest(f, snap.version, snap.size, snap.holders, snap.seq),
                    before=save_record,
                )
                for _ in range(FOLLOWS):
                    # Its directory (or the file) was renamed on another node
                    # while it was written here: its writes go where it is.
                    if result is not Published.NAME_GONE or not await self.follow_rename(f, tried):
                        break
                    result, tried = await self.publish(
                        f,
                        lambda: self._manifest(f, snap.version, snap.size, snap.holders, snap.seq),
                        before=save_record,
                    )
        except BaseException:
            self.cache.publish_failed(snap)
            if f.state is FileState.MODIFIED and not f.writers:
                self._retry.add(f)  # nobody else will commit it
                self._retry_wanted.set()
            raise
        if result is Published.STALE and (f.writers or f.content_gen != snap.content_gen):
            # A newer version from another node is at the name, but this
            # file is still being written here (a FLUSH with other writers
            # open, a child's close of an inherited descriptor): the last
            # close commits it again, as a version newer still.
            self.cache.publish_failed(snap)
            return False
        if result is not Published.DONE:
            self.cache.publish_failed(
                snap,
                "a newer version from another node is at its name"
                if result is Published.STALE
                else "the name no longer names this file",
            )
            return True
        self._retry.discard(f)
        held = (
            "in this node's RAM" if len(snap.holders) < 2 else f"held by {', '.join(snap.holders)}"
        )
        log.info("saved: %r (%d bytes, %s, %.2fs after its open)", f.path, snap.size, held,
                 time.time() - f.opened_at)  # fmt: skip
        if self.cache.published(snap):
            if f.path != path:  # renamed while its record was being written
                await journal.save(record_of(self.cache.journal_snapshot(f)))
            inode = self.inodes.get(f.ino) if f.ino else None
            if inode is not None:
                inode.kernel_version = f.version
        return True

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
    ) -> tuple[Published, str]:
        """Write ``make()`` at the file's current path if that path is still
        ours; the result, and the path it tried (a NAME_GONE is about that
        path, which an open here may have moved ``f`` from meanwhile:
        follow_rename).

        The manifest is built under the namespace lock, so it reflects the
        file's state at the moment it is written (a metadata update can never
        put back a pending manifest over a newer durable one); ``make``
        returns None when what it would publish is already stale. With
        ``expect_version``, the manifest in the backing store must still be
        that version (another node may have published a newer one). The
        manifest file is owned by the file's owner; ``before`` runs in the
        same backing-store call, first."""
        async with self.ns_lock.shared(lambda: f.path) as path:
            if f.unlinked:
                return Published.NAME_GONE, path
            manifest = make()
            if manifest is None:
                return Published.STALE, path
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
            return result, path

    async def follow_rename(self, f: CachedFile, tried: str) -> bool:
        """``f``'s name ``tried`` is gone from the backing store: True if its
        publish is to be tried again, because a rename recorded by another
        node moved it (renamelog.py) and ``f`` takes the path it is at now,
        or because ``f`` moved here meanwhile (an open found it at its new
        name, a rename here). From ``tried``, not ``f.path``: an open during
        the publish that failed moves ``f``, and the renames from there lead
        nowhere (fault trials, seed 46, trial 21)."""
        if f.unlinked:
            return False
        if f.path != tried:
            return True
        old = tried
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
    ) -> tuple[Published, str]:
        """Publish a buddy's file this node took over: only over exactly the
        version it mirrored (fenced; see Backing.takeover_manifest). The
        result, and the path it tried (as publish)."""
        async with self.ns_lock.shared(lambda: f.path) as path:
            manifest = make()
            if manifest is None or f.unlinked:
                return Published.STALE, path
            result = await self.backing.takeover_manifest(
                path,
                manifest,
                file_id=f.file_id,
                expect_version=expect_version,
                holder=self.cache.node,
            )
            return result, path
