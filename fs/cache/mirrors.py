"""Buddy mirroring, as the cache sees it: the writer's mirror state, and on
the buddy, mirrored pages, commits, renames, drops and takeovers of a dead
writer's files. A part of :class:`ckptfs.fs.cache.cache.Cache`."""

from __future__ import annotations

import errno
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import trio
from ckptfs.fs.cache.transitions import move
from ckptfs.fs.content.cachedfile import CachedFile, ChunkMap, Page
from ckptfs.fs.content.state import FileRole, FileState, MirrorState, PageState
from ckptfs.fs.store.manifest import Chunk, Manifest

if TYPE_CHECKING:
    pass

log = logging.getLogger("ckptfs.cache")

MAX_GONE_MIRRORS = 65536
# Renames of mirrors not held yet (a rename crossing a close's first page:
# rare), each path up to a request's meta size: bounded apart.
MAX_EARLY_PATHS = 1024


def _remember(
    seen: dict[Any, Any], key: Any, value: Any = None, limit: int = MAX_GONE_MIRRORS
) -> None:
    """Adds ``key`` to a bounded record of mirrors (oldest out)."""
    seen.pop(key, None)
    seen[key] = value
    if len(seen) > limit:
        del seen[next(iter(seen))]


def _move_mirror(f: CachedFile, path: str) -> None:
    """Mirror ``f`` is at ``path`` now; the takeover also looks at the last
    few paths it had (a rename that failed, a message that crossed another)."""
    if f.path and f.path != path:
        f.prior_paths = [*f.prior_paths[-3:], f.path]
    f.path = path


def _adds_nothing(f: CachedFile, p: int, gen: int, fill: int) -> bool:
    """Whether page ``p`` of mirror ``f`` arriving at (``gen``, ``fill``) adds
    nothing. The writer's generations only grow within a mirror id, so it
    adds nothing if it is:

    - at or below the floor of the last commit: bytes that commit listed or
      superseded (a batch pinned before a truncate or a rewrite, arriving late
      after a retry or on a replaced connection), even for a page the commit
      dropped or holds spilled, which the checks below cannot see;
    - older than the generation held (a late copy);
    - the same bytes again (a generation is one content of the page; a resync
      to a buddy that kept its mirrors sends them again).

    Any of these turning a committed mirror back into MODIFIED would lose a
    version the writer was told is held here."""
    if gen <= f.mirror_floor:
        return True
    page = f.pages.get(p)
    return page is not None and (
        page.gen > gen or (page.gen == gen and page.in_ram and page.fill >= fill)
    )


class Mirroring:
    """Buddy mirroring, as the cache sees it: the writer's mirror state, and on (see the module)."""

    # ----- buddy mirroring: the writer's side ---------------------------------
    def set_mirror(self, f: CachedFile, state: MirrorState) -> None:
        """Record whether ``f``'s buddy holds its content (peer/mirror/client.py decides)."""
        if f.mirror is not state:
            f.mirror = state
            if state is MirrorState.ACKED:
                f.mirrored_at = time.time()
            elif state is MirrorState.FALLBACK:
                f.mirrored_at = None  # the history must not say mirrored
            self._notify(f)

    # ----- buddy mirroring: the buddy's side ------------------------------------
    async def mirror_page(
        self, origin: str, mid: str, file_id: str, p: int, gen: int, data: memoryview, *,
        timeout: float, admit: Callable[[], bool] = lambda: True,
    ) -> bool:  # fmt: skip
        """Hold page ``p`` (writer's generation ``gen``) of a buddy's content.

        Waits up to ``timeout`` for room within the mirror quota and returns
        False if there is none (the writer retries: a full buddy slows it),
        or if ``admit()`` (whether the writer may still change its mirrors)
        says no once there is room.
        """
        f = self._mirror_for(origin, mid, file_id, file_id)
        if _adds_nothing(f, p, gen, len(data)):
            return True
        page = f.pages.get(p)
        if page is None or not page.in_ram or self.arena.pinned(page.slot):
            slot = await self._alloc_mirror(timeout)
            if slot is None:
                return False
            if self.mirrors.get(mid) is not f or f.role is not FileRole.MIRROR:
                self._free_slot(slot)  # dropped or taken over meanwhile
                return True
            if not admit():
                # Its writer was declared dead while this page waited: the
                # mirror is its takeover's, which flushes the committed
                # version (this page would make it uncommitted content).
                self._free_slot(slot)
                return False
            try:
                self.arena.write(slot, 0, data)
            except BaseException:
                self._free_slot(slot)
                raise
            self._hold_page(f, p, gen, slot, len(data))
            return True
        self.arena.write(page.slot, 0, data)
        page.fill, page.gen = len(data), gen
        self._mirror_changed(f)
        return True

    def reserve_mirror_slots(self, n: int) -> list[int] | None:
        """``n`` slots for mirrored pages to be received straight into, if the
        quota and the arena have room now (None: receive them elsewhere).
        Each is given back with ``mirror_page_into`` or ``unreserve_mirror_slot``."""
        if self.mirror_slots + self.mirror_reserved + n > self.mirror_quota:
            return None
        slots: list[int] = []
        while len(slots) < n:
            slot = self.try_alloc()
            if slot is None:
                for slot in slots:
                    self._free_slot(slot)
                return None
            slots.append(slot)
        self.mirror_reserved += n
        return slots

    def unreserve_mirror_slot(self, slot: int) -> None:
        self.mirror_reserved -= 1
        self._free_slot(slot)

    def mirror_page_into(
        self, origin: str, mid: str, file_id: str, p: int, gen: int, slot: int, fill: int
    ) -> None:
        """Hold page ``p`` (writer's generation ``gen``) of a buddy's content,
        whose ``fill`` bytes are in ``slot``, a reserved slot this takes (it
        keeps it as the page, or frees it). Raises OSError, before taking the
        slot, if the mirror is not the origin's to change."""
        f = self._mirror_for(origin, mid, file_id, file_id)
        self.mirror_reserved -= 1
        self._hold_page(f, p, gen, slot, fill)

    def _hold_page(self, f: CachedFile, p: int, gen: int, slot: int, fill: int) -> None:
        """Make ``slot`` page ``p`` of mirror ``f``, or free it if that adds
        nothing (see ``_adds_nothing``; checked here, after any wait for room,
        against the floor and pages as they are now)."""
        if _adds_nothing(f, p, gen, fill):
            self._free_slot(slot)
            return
        page = f.pages.get(p)
        if page is not None:
            self._drop_mirror_page(f, p)
        f.pages[p] = Page(PageState.DIRTY, slot, fill, gen)
        f.ram_count += 1
        f.dirty_count += 1
        self.dirty_pages += 1
        self.mirror_slots += 1
        self.peak_mirrored = max(self.peak_mirrored, self.mirror_slots)
        self._mirror_changed(f)

    def _mirror_changed(self, f: CachedFile) -> None:
        # The content differs from any version committed before.
        move(f, FileState.MODIFIED)
        f.content_gen = next(self._gen)

    def _mirror_for(self, origin: str, mid: str, file_id: str, what: str) -> CachedFile:
        """The mirror ``mid`` of ``origin``'s content, made on its first page or
        commit; refused if the writer dropped it for good or it is not theirs."""
        if mid in self._gone_mirrors:
            raise OSError(errno.ESTALE, f"mirror {mid} of {what} was dropped by its writer")
        f = self.mirrors.get(mid)
        if f is None:
            path = self._early_paths.pop((origin, mid), "")
            f = CachedFile(file_id, "", path, 0, 0o600, 0, 0, 0, 0, self.page_size)
            f.role, f.mirror_id, f.origin = FileRole.MIRROR, mid, origin
            self.mirrors[mid] = f
        if f.role is not FileRole.MIRROR or f.origin != origin:
            raise OSError(errno.EBUSY, f"mirror {mid} of {what} is not {origin}'s to change")
        return f

    async def _alloc_mirror(self, timeout: float) -> int | None:
        with trio.move_on_after(timeout):
            while self.mirror_slots + self.mirror_reserved >= self.mirror_quota:
                await self._space_event.wait()
            return await self.alloc_for_write_quietly()
        return None

    async def alloc_for_write_quietly(self) -> int:
        """A slot, waiting for space without the writers' backpressure log."""
        while (slot := self.try_alloc()) is None:
            self.need_space.set()
            with trio.move_on_after(self.backpressure_poll):
                await self._space_event.wait()
        return slot

    def _drop_mirror_page(self, f: CachedFile, p: int) -> None:
        page = f.pages.get(p)
        if page is not None and page.in_ram:
            self.mirror_slots -= 1
        self._drop_page(f, p)

    def mirror_commit(
        self,
        origin: str,
        mid: str,
        manifest: Manifest,
        path: str,
        uid: int,
        gid: int,
        ram: dict[int, tuple[int, int]],
        spilled: dict[int, tuple[Chunk, int]],
        base: ChunkMap,
        floor: int,
        incarnation: str = "",
    ) -> list[int]:
        """The writer published (or is about to publish) ``manifest`` for the
        content streamed under ``mid``: ``ram`` lists (gen, fill) per page the
        buddy must hold, ``spilled`` the pages already in chunks, ``floor``
        the writer's newest generation for the content at its snapshot,
        ``incarnation`` the writer daemon's that committed it.
        Returns the pages whose generation does not match (to send again);
        when none, the mirror is that version, PENDING, and serves it, and
        pages at or below ``floor`` arriving later add nothing. A commit
        older than the last one taken (a lower floor: it arrived late, on a
        replaced connection) is refused with ESTALE, changing nothing."""
        f = self._mirror_for(origin, mid, manifest.file_id, path)
        if floor < f.mirror_floor:
            raise OSError(
                errno.ESTALE,
                f"commit of {path} (mirror {mid}) at generation {floor} is older than "
                f"the one held, at {f.mirror_floor}: a late copy, not taken",
            )
        missing = [
            p
            for p, (gen, fill) in ram.items()
            if (page := f.pages.get(p)) is None
            or not page.in_ram
            or page.gen != gen
            or page.fill < fill
        ]
        if missing:
            return missing
        for p in [p for p in f.pages if p not in ram]:
            self._drop_mirror_page(f, p)
        for p, (_gen, fill) in ram.items():
            f.pages[p].fill = fill
        for p, (chunk, fill) in spilled.items():
            f.pages[p] = Page(PageState.SPILLED, -1, fill, 0, chunk)
        # A rename's message and a commit built before it may cross on the
        # way (a resync runs beside the job): which path is current is not
        # known here, so the takeover looks at both.
        _move_mirror(f, path)
        f.file_id, f.version, f.size = manifest.file_id, manifest.version, manifest.size
        f.seq = manifest.seq
        f.mode, f.uid, f.gid = manifest.mode & 0o7777, uid, gid
        f.mtime_ns, f.atime_ns = manifest.mtime_ns, manifest.atime
        f.chunking, f.base = manifest.chunking, base
        f.holders = list(manifest.holders)
        f.mirror_floor = floor
        f.origin_incarnation = incarnation
        move(f, FileState.PENDING)
        f.content_gen = next(self._gen)
        f.closed_at = time.time()
        self._notify(f)
        return []

    def mirror_rename(self, origin: str, mid: str, path: str) -> bool:
        """The writer is about to rename the file of mirror ``mid`` to
        ``path``; whether that mirror is held here.

        One not held yet is remembered with that path: a file closed while
        it is renamed may have its first page and its commit arrive after
        the rename's message, the commit naming the old path (read before
        the rename moved the file there). The takeover must know both."""
        f = self.mirrors.get(mid)
        if f is None:
            if mid not in self._gone_mirrors:
                _remember(self._early_paths, (origin, mid), path, MAX_EARLY_PATHS)
            return False
        if f.origin != origin:
            return False
        _move_mirror(f, path)
        return True

    def mirror_drop(self, origin: str, mid: str, version: str) -> bool:
        """The writer needs no mirror of ``mid`` at ``version`` any more
        (durable), or of any version (""; the content is gone or fell back).
        Either way the writer is done with ``mid`` (its next content gets a
        new id), so later pages of it are refused: a late one must not make
        a new mirror that nothing would ever drop. A drop of another
        writer's mirror changes nothing (not even its later pages)."""
        f = self.mirrors.get(mid)
        if f is not None and f.origin != origin:
            return False
        _remember(self._gone_mirrors, mid)
        self._early_paths.pop((origin, mid), None)
        if f is None or f.role is not FileRole.MIRROR:
            return False
        if version and (f.version != version or f.state is not FileState.PENDING):
            return False  # changed since: a later commit or drop settles it
        self._drop_mirror(f)
        return True

    def _drop_mirror(self, f: CachedFile) -> None:
        """The writer let go of mirror ``f``: dropped, unless handles here read
        its version (a REMOTE file opened while it was pending, read from
        this mirror): the writer may have replaced or removed it, and a
        read through those handles (a page of a torch.load(mmap=True)'s
        mapping) would find that version nowhere. Kept (KEPT) for them."""
        key = (f.file_id, f.version)
        if f.state is FileState.PENDING and f.role is FileRole.MIRROR:
            _remember(self._dropped_versions, key)
            if self._read_here(*key) and key not in self.kept_mirrors:
                self.mirrors.pop(f.mirror_id, None)
                f.role = FileRole.KEPT
                self.kept_mirrors[key] = f
                self.mirrors_kept += 1
                self._notify(f)
                return
        # Its pages go now: no decision made before (a takeover's look at
        # the manifest) may act on it after.
        move(f, FileState.UNLINKED)
        self.drop(f)

    def mirrors_of(self, origin: str) -> list[CachedFile]:
        return [f for f in self.mirrors.values() if f.origin == origin]

    def taken_over(self) -> list[CachedFile]:
        """Dead buddies' files this node took over: kept among the mirrors
        (no name of this node's file table is theirs), flushed from here."""
        return [f for f in self.mirrors.values() if f.role is FileRole.TAKEOVER]

    def begin_takeover(self) -> None:
        """A takeover is under way from now (called where a death is seen,
        before its task starts, so that no drain misses it): end_takeover."""
        if not self._takeovers:
            self._takeovers_idle = trio.Event()
        self._takeovers += 1

    def end_takeover(self) -> None:
        self._takeovers -= 1
        if not self._takeovers:
            self._takeovers_idle.set()

    @contextmanager
    def taking_over(self) -> Iterator[None]:
        """Held by a takeover from its first look to its last conversion."""
        self.begin_takeover()
        try:
            yield
        finally:
            self.end_takeover()

    @property
    def takeover_running(self) -> bool:
        return self._takeovers > 0

    async def takeovers_settled(self) -> None:
        """Returns when no takeover is under way."""
        while self._takeovers:
            await self._takeovers_idle.wait()

    def take_over(self, f: CachedFile) -> bool:
        """The writer of mirror ``f`` died: this node flushes it (fenced, at
        exactly its version). Content never committed is dropped: its close
        never returned."""
        if f.role is not FileRole.MIRROR or self.mirrors.get(f.mirror_id) is not f:
            return False  # dropped (its pages are gone), or not a mirror
        if f.state is not FileState.PENDING:
            self._drop_mirror(f)
            return False
        f.role = FileRole.TAKEOVER
        f.holders = [self.node]
        self._notify(f)
        self.on_pending(f)
        return True

    def mirrored_bytes(self) -> int:
        return self.mirror_slots * self.page_size

    def _own_page_dirtied(self) -> None:
        self.dirty_pages += 1
        self.peak_own_dirty = max(self.peak_own_dirty, self.dirty_pages - self.mirror_slots)
