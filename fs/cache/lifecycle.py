"""A file's life in the cache: removal and retirement, changes (MODIFIED
before the first await), forks, publishing, flush snapshots and pins, and
becoming durable. A part of :class:`ckptfs.fs.cache.cache.Cache`; each state
change goes through transitions.move (docs/STATES.md)."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import trio
from ckptfs.fs.cache.transitions import move, start
from ckptfs.fs.content.cachedfile import CachedFile, ChunkMap, Page, Snapshot
from ckptfs.fs.content.state import FileRole, FileState, MirrorState, PageState
from ckptfs.fs.store.manifest import Chunk, new_id

if TYPE_CHECKING:
    pass
from ckptfs.fs.cache.errors import FileLost

log = logging.getLogger("ckptfs.cache")


class Lifecycle:
    """A file's life in the cache: removal and retirement, changes (MODIFIED (see the module)."""

    # ----- state transitions -------------------------------------------------
    def _notify(self, f: CachedFile) -> None:
        """Wake everyone waiting for this file's state to change."""
        f.durable_event.set()
        f.durable_event = trio.Event()

    def _retire(self, f: CachedFile) -> None:
        """No name refers to ``f`` any more (UNLINKED)."""
        key = self._record_key(f)
        if key is not None:
            self.journal.drop_later(key)  # recovery rejects it: its manifest is gone
        if f.role is FileRole.LOCAL and f.mirror is not MirrorState.NONE:
            self.on_mirror_done(f.mirror_id, "")  # nothing will publish this content
        f.unlinked_while_lost = f.lost  # (retired twice, it stays so)
        move(f, FileState.UNLINKED)
        if self.files.get(f.file_id) is f:
            del self.files[f.file_id]
        self._notify(f)
        if self._referenced(f):
            self.retired.add(f)
        else:
            self.drop(f)

    def unlink(self, f: CachedFile) -> None:
        self._retire(f)

    @staticmethod
    def _record_key(f: CachedFile) -> tuple[str, str] | None:
        """The journal record that lists this file's slots, if it may have one."""
        if f.role is FileRole.REMOTE:
            return None  # no slots here: a record of that version is a mirror's, or nobody's
        if f.state is FileState.PENDING:
            return (f.file_id, f.version)
        if f.state is FileState.PUBLISHING and f.publishing is not None:
            return (f.file_id, f.publishing.version)
        return None

    async def _begin_change(self, f: CachedFile) -> None:
        """Make ``f`` MODIFIED before any of its bytes change (caller holds f.lock)."""
        if f.lost:
            raise FileLost(f"{f.path}: its bytes are lost; only a full rewrite may replace it")
        if f.state is FileState.UNLINKED:
            # Open handles of a removed file may still write; nothing publishes it.
            self._content_here(f)
            return
        key = self._record_key(f)
        if f.state is not FileState.MODIFIED:
            # New content begins (a rewrite of a pending or durable file): the
            # history's times count from here, not from the first version's open.
            f.opened_at, f.closed_at, f.mirrored_at = time.time(), None, None
        move(f, FileState.MODIFIED)
        f.role = FileRole.LOCAL
        if f.mirror is MirrorState.ACKED:
            f.mirror = MirrorState.STREAMING  # the buddy's copy no longer matches
        self._notify(f)
        if key is not None:
            # The record lists slots this change is about to overwrite.
            await self.journal.drop(key)
            if f.state is not FileState.MODIFIED:
                # A commit began during the wait (a snapshot without the
                # change to come): MODIFIED again, or its publish would leave
                # the file PUBLISHING with nobody to publish the change.
                await self._begin_change(f)

    @staticmethod
    def _content_here(f: CachedFile) -> None:
        """A removed file written through a handle: if it was another node's
        (REMOTE), its bytes were only on its holders, and a write here is a
        full rewrite (a writable open of it truncates): its content is this
        node's from here on, never read from its holders again."""
        if f.role is FileRole.REMOTE:
            f.role, f.base = FileRole.LOCAL, ChunkMap()

    def _fork(self, f: CachedFile) -> None:
        """Truncating a PENDING file to 0 (the next torch.save of the same name):
        the old version keeps its content, record and flush, as a retired file,
        until it is durable or the new version is published; ``f`` starts empty."""
        old = CachedFile(
            f.file_id, f.version, f.path, f.size, f.mode, f.uid, f.gid, f.mtime_ns,
            f.atime_ns, self.page_size,
        )  # fmt: skip
        start(old, f.state)
        old.role, old.mirror = f.role, f.mirror
        old.holders, old.chunking = list(f.holders), f.chunking
        old.pages, old.base, old.content_gen = f.pages, f.base, f.content_gen
        old.dirty_count, old.ram_count = f.dirty_count, f.ram_count
        old.opened_at, old.closed_at, old.flushed_bytes = f.opened_at, f.closed_at, f.flushed_bytes
        old.mirrored_at = f.mirrored_at
        if f.flushing is not None:
            f.flushing.file = old  # the flush in progress stores exactly this content
            old.flushing, f.flushing = f.flushing, None
        self.retired.add(old)
        if old.ram_count:
            self._resident[old] = None
        f.pages, f.base, f.dirty_count, f.ram_count = {}, ChunkMap(), 0, 0
        move(f, FileState.MODIFIED)
        f.role = FileRole.LOCAL
        old.mirror_id, f.mirror_id, f.mirror = f.mirror_id, new_id(), MirrorState.NONE
        f.content_gen = next(self._gen)
        f.opened_at, f.closed_at, f.flushed_bytes = time.time(), None, 0
        f.mirrored_at = None
        self._notify(f)
        if old.flushing is None:
            self.on_pending(old)

    def begin_publish(self, f: CachedFile, version: str) -> Snapshot:
        """MODIFIED -> PUBLISHING: the content a commit is about to publish."""
        assert f.state is FileState.MODIFIED, f.state
        snap = self._snapshot(f, version)
        # A new version: ordered after the one it replaces, and by the time
        # of its close (another node's version of it may be older or newer).
        snap.seq = max(f.seq + 1, time.time_ns())
        move(f, FileState.PUBLISHING)
        f.publishing = snap
        self._notify(f)
        return snap

    def published(self, snap: Snapshot) -> bool:
        """The pending manifest of ``snap`` is in the backing store.

        PUBLISHING -> PENDING if nothing changed since the snapshot; a file
        written meanwhile stays MODIFIED (its writer dropped the record).
        Returns whether the file is now PENDING.
        """
        f = snap.file
        f.version, f.seq = snap.version, snap.seq  # what the store names now, either way
        f.publishing = None
        for old in [r for r in self.retired if r.file_id == f.file_id and r is not f]:
            if old.state is FileState.PENDING:
                self._retire(old)  # a newer version replaced it
        if f.state is FileState.PUBLISHING and f.content_gen == snap.content_gen:
            move(f, FileState.PENDING)
            f.holders = list(snap.holders) or [self.node]
            f.closed_at = time.time()
            self._notify(f)
            self.on_pending(f)
            return True
        self._notify(f)
        return False

    def publish_failed(self, snap: Snapshot, dropped: str = "") -> None:
        """The pending manifest of ``snap`` was not published. ``dropped``
        says why its content goes (the name went, a newer version is
        there); empty, the file stays MODIFIED for a commit to try again."""
        f = snap.file
        f.publishing = None
        # Never published, so recovery would reject it: no need to wait.
        self.journal.drop_later((f.file_id, snap.version))
        if f.state is FileState.PUBLISHING:
            move(f, FileState.MODIFIED)
        if dropped:
            log.info("%s: %s; dropping the content being written", f.path, dropped)
            self._retire(f)
        else:
            self._notify(f)

    def flush_snapshot(self, f: CachedFile) -> Snapshot | None:
        """The snapshot the flusher stores, with its RAM slots pinned; None if
        ``f`` owes nothing (not PENDING, not ours, or already being flushed)."""
        if not f.owes_flush or f.flushing is not None:
            return None
        snap = self._snapshot(f, f.version)
        for page in snap.pages.values():
            if page.in_ram:
                self.arena.pin(page.slot)
                snap.pinned.append(page.slot)
        f.flushing = snap
        f.flushed_bytes = 0
        self._notify(f)
        return snap

    def flush_ended(self, snap: Snapshot) -> None:
        """The flusher is done with ``snap``; its pins go once no thread reads them."""
        snap.ended = True
        self._unpin_snapshot(snap)
        if snap.file.flushing is snap:
            snap.file.flushing = None
            self._notify(snap.file)

    def thread_started(self, snap: Snapshot) -> None:
        snap.threads += 1

    def thread_ended(self, snap: Snapshot) -> None:
        """A thread reading ``snap``'s slots ended (maybe long after the loop gave up on it)."""
        snap.threads -= 1
        self._unpin_snapshot(snap)

    def _unpin_snapshot(self, snap: Snapshot) -> None:
        if snap.ended and not snap.threads and snap.pinned:
            for slot in snap.pinned:
                self.arena.unpin(slot)
            snap.pinned = []
            self._signal_space()

    def mark_durable(self, snap: Snapshot, chunks: list[Chunk], kind: str) -> bool:
        """PENDING -> DURABLE, if the durable manifest of ``snap`` names the
        file's current content; refused if anything changed since the snapshot."""
        f = snap.file
        if (
            f.state is not FileState.PENDING
            or f.version != snap.version
            or f.content_gen != snap.content_gen
        ):
            return False
        f.base = ChunkMap.of(chunks, f.size)
        f.chunking = kind
        for p, page in list(f.pages.items()):
            if page.state is PageState.DIRTY:
                page.state = PageState.CLEAN
                f.dirty_count -= 1
                self.dirty_pages -= 1
            elif page.state is PageState.SPILLED:
                del f.pages[p]
        move(f, FileState.DURABLE)
        f.lost_reason = ""
        self.journal.drop_later((f.file_id, f.version))
        self._notify(f)
        if f.role is FileRole.LOCAL and f.mirror is not MirrorState.NONE:
            self.on_mirror_done(f.mirror_id, f.version)
            # The next change is new content for the buddy, under a new id.
            f.mirror, f.mirror_id = MirrorState.NONE, new_id()
        if f in self.retired or f.role is FileRole.TAKEOVER:
            # A fork, or a buddy's file taken over: durable now, and no name
            # here shows this content.
            self.drop(f)
        self._signal_space()
        self.prune()
        return True

    def journal_snapshot(self, f: CachedFile) -> Snapshot:
        """A PENDING file's content as its journal record lists it (after a rename)."""
        return self._snapshot(f, f.version)

    def _snapshot(self, f: CachedFile, version: str) -> Snapshot:
        pages = {p: Page(pg.state, pg.slot, pg.fill, pg.gen, pg.chunk) for p, pg in f.pages.items()}
        return Snapshot(f, version, f.content_gen, f.size, pages, f.base, seq=f.seq)

    def _changed(self, f: CachedFile, p: int, page: Page) -> None:
        """Page ``p`` now holds new content: DIRTY, with a fresh generation."""
        if page.state is not PageState.DIRTY:
            page.state = PageState.DIRTY
            page.chunk = None
            f.dirty_count += 1
            self._own_page_dirtied()
        page.gen = next(self._gen)
        f.content_gen = page.gen
        if f.role is FileRole.LOCAL and f.state is not FileState.UNLINKED:
            self.on_page_changed(f, p)
