"""The RAM write-back cache: file contents in arena slots under a budget.

The cache owns every transition of a file's state (:class:`FileState`) and of
its pages (:class:`PageState`); docs/STATES.md lists them, with the awaits
each crosses and what a crash leaves behind. It also owns slot allocation,
LRU eviction of clean bytes, backpressure when the budget is full of bytes
that are not durable, and spilling of dirty pages of files still being
written (so a file larger than the cache can be written). It knows nothing of
FUSE or inodes; the backing namespace is the filesystem's.

Two rules make the transitions safe across awaits:

- A change (write, truncate) moves the file to MODIFIED *before* its first
  await, and assigns a new generation to every page it changes at the moment
  it changes it. A snapshot taken earlier is therefore recognisably stale.
- A published version's journal record lists slots; those slots are never
  changed or reused while the record can still be adopted: a change first
  waits until the record is dropped; a durable, superseded or unlinked
  version's record is rejected by recovery, so it may be dropped lazily.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import trio
from ckptfs.fs.cache.journal import Journal, Key, chunks_of
from ckptfs.fs.cache.lifecycle import Lifecycle
from ckptfs.fs.cache.memory import Memory
from ckptfs.fs.cache.mirrors import Mirroring
from ckptfs.fs.cache.reading import PeerFetch, Reading
from ckptfs.fs.cache.transitions import move, start
from ckptfs.fs.cache.unconfirmed import Unconfirmed
from ckptfs.fs.cache.writing import Writing
from ckptfs.fs.content.arena import Arena
from ckptfs.fs.content.cachedfile import CachedFile, ChunkMap, Page
from ckptfs.fs.content.state import FileRole, FileState, MirrorState, PageState
from ckptfs.fs.read.frames import FrameCache
from ckptfs.fs.read.readahead import ReadAhead
from ckptfs.fs.read.readsource import RangeReader
from ckptfs.fs.read.remoteread import RemoteReader
from ckptfs.fs.store.blocking import BackingIO, run_cpu
from ckptfs.fs.store.chunkstore import ChunkStore
from ckptfs.fs.store.manifest import Chunk, Manifest

if TYPE_CHECKING:
    from ckptfs.fs.store.entries import PlainFile

log = logging.getLogger("ckptfs.cache")

MAX_IDLE_FILES = 4096
PRUNE_SLACK = 1024
BACKPRESSURE_POLL = 1.0  # seconds between looks for space, besides being woken


class Cache(Lifecycle, Mirroring, Memory, Reading, Writing):
    """The cache of one mount. This module holds its registry of files and
    the changes the namespace makes to them; its other parts, one module
    each, are lifecycle.py (changes, publishing, flushing, durability),
    mirrors.py (buddy mirroring), memory.py (slots, eviction, backpressure,
    spilling), reading.py and writing.py. Every state change goes through
    transitions.py."""

    def __init__(
        self,
        arena: Arena,
        store: ChunkStore,
        io: BackingIO,
        journal: Journal,
        *,
        node: str,
        hash_threads: int = 2,
    ) -> None:
        self.arena = arena
        self.store = store
        self.io = io
        self.journal = journal
        self.node = node
        self.page_size = arena.slot_size
        self.frames = FrameCache(arena, store, io)
        # Set when this node has peers: reads of files pending elsewhere.
        self._peer_fetch: PeerFetch | None = None
        self.remote = RemoteReader(self._no_peers)  # pipelined reads through peer_fetch
        # Every read resolves its range through the reader (fs/read/readsource.py);
        # sequential readers make the read-ahead fetch the next chunks early.
        self.reader = RangeReader(arena, self.frames, self.try_alloc)
        self.readahead = ReadAhead(
            self.frames, self.try_alloc, arena.capacity, busy=lambda: self.waiting_writers > 0
        )
        # The current content of every file id this node knows of.
        self.files: dict[str, CachedFile] = {}
        # Journal records of a crashed daemon that recovery could not check
        # against the store (recovery.py): their slots are held until each
        # is adopted (confirm) or found stale (discard_unconfirmed).
        self.unconfirmed = Unconfirmed()
        # Content that no name refers to any more but is still held: open
        # handles of an unlinked or replaced file, or a version being
        # rewritten that still owes the backing store (a fork, see truncate).
        self.retired: set[CachedFile] = set()
        # Set by the filesystem: whether an inode still points at a file.
        self.unreference: Callable[[CachedFile], None] = lambda f: None
        # Set by the daemon: a LOCAL file became PENDING and needs flushing.
        self.on_pending: Callable[[CachedFile], None] = lambda f: None
        # Set by the daemon at durability buddy: a page of a LOCAL file
        # changed (stream it to the buddy); a version the buddy mirrors needs
        # no mirror any more (mirror_id, version; version "" = any).
        self.on_page_changed: Callable[[CachedFile, int], None] = lambda f, p: None
        self.on_mirror_done: Callable[[str, str], None] = lambda mid, version: None
        # The buddy side: other nodes' files mirrored here, by mirror id, and
        # the share of the arena they may take.
        self.mirrors: dict[str, CachedFile] = {}
        self.mirror_quota = arena.nslots // 2
        self.mirror_slots = 0
        # Slots handed out for mirrored pages being received straight into
        # them (reserve_mirror_slots); they count against the quota.
        self.mirror_reserved = 0
        # Mirror ids whose content the writer abandoned for good: a page of
        # one still in flight must not bring it back (bounded, oldest out).
        self._gone_mirrors: dict[str, None] = {}
        # Paths that writers' renames announced for mirror ids not held here
        # yet, by (writer, mirror id) (bounded, oldest out): see mirror_rename.
        self._early_paths: dict[tuple[str, str], str] = {}
        # Mirrors kept for handles here that read their version (FileRole.KEPT),
        # by (file id, version); they count as mirrored RAM until dropped.
        self.kept_mirrors: dict[tuple[str, str], CachedFile] = {}
        self.mirrors_kept = 0  # how many were, since the daemon started
        # Versions whose mirror here was dropped (bounded, oldest out): an
        # open here of one that nothing holds here any more is sent back.
        self._dropped_versions: dict[tuple[str, str], None] = {}
        # Takeovers under way (a dead writer's mirrors are looked at one by
        # one across store reads before each becomes TAKEOVER): an unmount
        # waits for them to end, or it could miss files turned over later.
        self._takeovers = 0
        self._takeovers_idle = trio.Event()
        self._takeovers_idle.set()
        self.hash_limiter = trio.CapacityLimiter(hash_threads)
        self._gen = itertools.count(1)
        self._space_event = trio.Event()
        self.need_space = trio.Event()
        self.dirty_pages = 0
        # The most pages at once since this daemon started: this node's own
        # not yet durable pages, and other nodes' pages mirrored here. What a
        # node needs in RAM is the sum (its arena holds clean pages too,
        # which eviction takes back).
        self.peak_own_dirty = 0
        self.peak_mirrored = 0
        self.waiting_writers = 0
        self.backpressure_events = 0
        self.backpressure_seconds = 0.0
        self.evicted_bytes = 0
        self.spilled_bytes = 0
        self._bp_logged = False
        self.backpressure_poll = BACKPRESSURE_POLL
        # Files that hold slots, least recently used first: eviction looks at
        # these only, not at every file the cache knows.
        self._resident: dict[CachedFile, None] = {}

    # ----- registry -------------------------------------------------------
    def all_files(self) -> Iterator[CachedFile]:
        yield from list(self.files.values())
        yield from list(self.retired)

    def new_file(
        self, file_id: str, version: str, path: str, mode: int, uid: int, gid: int
    ) -> CachedFile:
        now = time.time_ns()
        f = CachedFile(file_id, version, path, 0, mode, uid, gid, now, now, self.page_size)
        f.content_gen = next(self._gen)
        self._register(f)
        return f

    def _fetchable(self, m: Manifest) -> bool:
        return self.peer_fetch is not None and any(h != self.node for h in m.holders)

    def with_id(self, file_id: str) -> list[CachedFile]:
        """Everything this node has of ``file_id``: its content, versions
        retired but still held, and mirrors of it (taken over or not)."""
        return [
            f
            for f in [
                self.files.get(file_id),
                *self.retired,
                *self.mirrors.values(),
                *self.kept_mirrors.values(),
            ]
            if f is not None and f.file_id == file_id
        ]

    def held_version(
        self, file_id: str, version: str, writer: str | None = None
    ) -> CachedFile | None:
        """The content of exactly that published version, if this node holds it
        (for a peer's read): never a version being changed here. With
        ``writer`` (the first holder the version's manifest names), a buddy's
        mirror counts only if that writer sent it: another node's commit may
        claim any file id and version."""
        for f in self.with_id(file_id):
            if (
                f.version == version
                and f.role is not FileRole.REMOTE
                and f.state in (FileState.PENDING, FileState.DURABLE)
                and (writer is None or f.role is FileRole.LOCAL or f.origin == writer)
            ):
                return f
        return None

    def holds(self, file_id: str, version: str) -> bool:
        """Whether the bytes of the published ``version`` of ``file_id`` are
        here, or a newer version is being written here (its close publishes
        it): what `ckptfs check` asks the holders a pending manifest names. A
        file that was being written when its daemon died is neither."""
        if self.held_version(file_id, version) is not None:
            return True
        f = self.files.get(file_id)
        return (
            f is not None
            and f.role is FileRole.LOCAL
            and f.state in (FileState.MODIFIED, FileState.PUBLISHING)
        )

    def changing(self, file_id: str, *, writer_alive: Callable[[str], bool]) -> bool:
        """Whether this node's content of ``file_id`` is being changed (its
        writer here rewrites it in place, or a buddy's mirror of it takes
        changed pages from a writer still alive). Asked for a peer's read of
        a version ``held_version`` refused: that version's bytes are being
        overwritten and will not be served again, so the reader answers
        ESTALE, not "lost". A mirror whose writer died mid-change is not
        "changing": that version is lost (the takeover drops the mirror)."""
        return any(
            f is not None
            and f.file_id == file_id
            and f.role is not FileRole.REMOTE
            and f.state in (FileState.MODIFIED, FileState.PUBLISHING)
            and (f.role is not FileRole.MIRROR or writer_alive(f.origin))
            for f in [self.files.get(file_id), *self.mirrors.values()]
        )

    def _register(self, f: CachedFile) -> None:
        old = self.files.get(f.file_id)
        if old is not None and old is not f:
            self._retire(old)
        self.files[f.file_id] = f

    def load(self, m: Manifest, path: str, uid: int, gid: int) -> CachedFile:
        """The cached file for the manifest at ``path`` (close-to-open: the
        manifest wins unless our copy is newer than what it names)."""
        f = self.files.get(m.file_id)
        kept = self.unconfirmed.get((m.file_id, m.version)) if m.state == "pending" else None
        if (
            kept is not None
            and path in (kept.get("path"), kept.get("renamed_from"))
            and (not m.holders or m.holders[0] == self.node)
            and (f is None or f.role is FileRole.REMOTE)
        ):
            # A crashed daemon's version that recovery could not check: this
            # manifest, just read at its path, confirms it. Its bytes are in
            # our slots. (Not over a file of that id being changed here.)
            f = self.confirm((m.file_id, m.version), m, path, (uid, gid))
            log.info("recovered %s (%d bytes) from the cache at its open; flushing it",
                     path, f.size)  # fmt: skip
            return f
        if (
            f is not None
            and f.state is FileState.LOST
            and f.role is FileRole.REMOTE
            and f.version == m.version
            and self._fetchable(m)
        ):
            # Its holders may be back (or it was a passing failure): try them again.
            move(f, FileState.PENDING)
            f.lost_reason = ""
        if (
            f is not None
            and f.role is FileRole.REMOTE
            and f.version == m.version
            and m.state == "durable"
            and f.state in (FileState.PENDING, FileState.LOST)
        ):
            # Made durable meanwhile (by its writer or a takeover): read the
            # chunks now, not the holders.
            move(f, FileState.DURABLE)
            f.role, f.lost_reason = FileRole.LOCAL, ""
            self.remote.forget(f.file_id)
            f.base, f.chunking, f.holders = (
                ChunkMap.of(m.chunks, m.size),
                m.chunking,
                list(m.holders),
            )
            self._notify(f)
        if f is not None and (
            f.modified or (f.version == m.version and not f.unlinked) or f.supersedes(m)
        ):
            f.path = path
            f.seq = max(f.seq, m.seq)  # (our next version goes after any we saw)
            if not f.modified and f.version == m.version:
                f.mode, f.uid, f.gid = m.mode & 0o7777, uid, gid
                f.mtime_ns, f.atime_ns = m.mtime_ns, m.atime
            return f
        nf = CachedFile(
            m.file_id, m.version, path, m.size, m.mode & 0o7777, uid, gid, m.mtime_ns, m.atime,
            self.page_size,
        )  # fmt: skip
        nf.content_gen = next(self._gen)
        nf.holders = list(m.holders)
        nf.seq = m.seq
        nf.chunking = m.chunking
        if m.state == "durable" or (m.size == 0 and not self._fetchable(m)):
            # An empty pending one that no peer serves (its writer died
            # between its create and its close) has no bytes to lose: it is
            # an empty file, as `ckptfs check` says, to read or write.
            start(nf, FileState.DURABLE)
            nf.base = ChunkMap.of(m.chunks, m.size)
        elif self._fetchable(m):
            # Pending elsewhere: its holders serve its bytes (peer reads).
            nf.role = FileRole.REMOTE
            start(nf, FileState.PENDING)
        else:
            # Pending elsewhere, and no peer of ours holds it: lost here.
            nf.role = FileRole.REMOTE
            holders = ", ".join(m.holders) or "none"
            start(nf, FileState.LOST)
            nf.lost_reason = (
                f"not durable yet and no reachable holder has its bytes (holders: {holders})"
            )
            log.error("%s is lost: %s", path, nf.lost_reason)
        self._register(nf)
        return nf

    def adopt(self, record: dict[str, Any], holders: list[str] | None = None) -> CachedFile:
        """A PENDING file rebuilt from a journal record (recovery after a crash);
        ``holders``: those its pending manifest names."""
        f = CachedFile(
            record["file_id"], record["version"], record["path"], record["size"],
            record["mode"], record.get("uid", 0), record.get("gid", 0), record["mtime_ns"],
            record.get("atime_ns", record["mtime_ns"]), self.page_size,
        )  # fmt: skip
        start(f, FileState.PENDING)
        f.holders = [self.node]
        f.seq = int(record.get("seq", 0))
        dirty = {int(p): entry for p, entry in record["dirty"].items()}
        # [slot, fill, generation]; records of older daemons have no generation.
        gens = {p: int(entry[2]) for p, entry in dirty.items() if len(entry) > 2}
        # Generations only grow within a mirror id: this process's go on
        # above the crashed one's (and above the buddy's floor for it).
        top = max([int(record.get("newest_gen", 0)), *gens.values()])
        self._gen = itertools.count(max(next(self._gen), top + 1))
        if (
            record.get("mirror_id")
            and len(gens) == len(dirty)
            and holders
            and set(holders) - {self.node}
        ):
            # The buddy acknowledged every page of this version at these
            # generations before the crash (only then does a manifest name
            # it): its copy is this file's mirror still.
            f.mirror_id, f.holders = str(record["mirror_id"]), list(holders)
            f.mirror = MirrorState.ACKED
        f.chunking = record.get("chunking", "fixed")
        f.content_gen = next(self._gen)
        for p, (slot, fill, *_) in dirty.items():
            gen = gens[p] if p in gens else next(self._gen)
            f.pages[p] = Page(PageState.DIRTY, slot, fill, gen)
            f.ram_count += 1
            f.dirty_count += 1
            self._own_page_dirtied()
            self._resident[f] = None
        for p, (off, length, digest, fill) in record["spilled"].items():
            f.pages[int(p)] = Page(PageState.SPILLED, -1, fill, next(self._gen))
            f.pages[int(p)].chunk = Chunk(off, length, digest)
        f.base = ChunkMap.of(chunks_of(record["base"]), record["base_end"])
        self._register(f)
        return f

    def confirm(
        self, key: Key, m: Manifest, path: str, owner: tuple[int, int] | None = None
    ) -> CachedFile:
        """Adopt the unconfirmed record ``key``: ``m`` at ``path`` names it
        pending. Its attributes are the manifest's now (a chmod elsewhere
        while it was kept stays); kept records that share a slot with it
        are let go: the slot is this version's."""
        record, _ = self.unconfirmed.pop(key)
        for dropped in self.unconfirmed.let_go_sharing(record):
            log.warning("not recovering %s: its cache slots hold %s", dropped.get("path"), path)
        f = self.adopt({**record, "path": path}, m.holders)
        f.mode, f.mtime_ns, f.atime_ns = m.mode & 0o7777, m.mtime_ns, m.atime
        if owner is not None:
            f.uid, f.gid = owner
        self.on_pending(f)
        return f

    async def discard_unconfirmed(self, key: Key, why: str, *, held: bool = False) -> None:
        """The unconfirmed record ``key`` is stale: its slots go back (those
        no other kept record lists). ``held``: the caller holds its journal
        lock. If the journal cannot drop it, it stays kept."""
        record, free = self.unconfirmed.pop(key)
        try:
            await self._release_record(key, free, held=held)
        except BaseException:
            self.unconfirmed.add(key, record)
            raise
        log.info("%s (%d bytes), kept from before a crash, is let go: %s",
                 record.get("path"), record.get("size", 0), why)  # fmt: skip

    async def release_let_go(self) -> None:
        """Drop the records let go at an adoption, then free their own slots."""
        while self.unconfirmed.letting_go:
            key, _, free = self.unconfirmed.letting_go[0]
            await self._release_record(key, free)
            self.unconfirmed.letting_go.pop(0)

    async def _release_record(self, key: Key, free: set[int], *, held: bool = False) -> None:
        # The record first: it may not outlive its bytes.
        await (self.journal.drop_held(key) if held else self.journal.drop(key))
        for slot in free:
            self.arena.release(slot)
        self._signal_space()

    def drop(self, f: CachedFile) -> None:
        """Forget content nobody needs any more; its slots go back to the arena."""
        if self.mirrors.get(f.mirror_id) is f:
            del self.mirrors[f.mirror_id]
            self.mirror_slots -= f.ram_count
        elif f.role is FileRole.KEPT and self.kept_mirrors.get((f.file_id, f.version)) is f:
            del self.kept_mirrors[(f.file_id, f.version)]
            self.mirror_slots -= f.ram_count
        self._release_pages(f, list(f.pages))
        self._resident.pop(f, None)
        self.retired.discard(f)
        if self.files.get(f.file_id) is f:
            del self.files[f.file_id]

    # ----- what the namespace changes of a file ----------------------------
    # Names, handles, attributes and inode references: set here, so that
    # every change of a CachedFile is the cache's (docs/STATES.md).
    def move_path(self, f: CachedFile, path: str) -> None:
        """``f`` is now at ``path`` (a rename here or elsewhere, a create)."""
        f.path = path

    def repath(self, old: str, new: str) -> list[CachedFile]:
        """Files at or under ``old`` move under ``new`` (a rename here): a
        dead buddy's file taken over here too, since this node publishes it
        at its path. The files moved."""
        moved = []
        for f in [*self.all_files(), *self.taken_over()]:
            if f.path == old or f.path.startswith(old + "/"):
                f.path = new + f.path[len(old) :]
                moved.append(f)
        return moved

    def opened(self, f: CachedFile, writable: bool) -> None:
        """A handle of ``f`` opened (writable: it may write)."""
        f.handles += 1
        f.writers += writable

    def closed(self, f: CachedFile, writable: bool) -> None:
        """A handle of ``f`` closed; the caller then lets it go (let_go) or
        commits it."""
        f.handles -= 1
        f.writers -= writable

    @contextmanager
    def writing(self, f: CachedFile) -> Iterator[None]:
        """``f`` counts a writer for as long as the block runs (a copy of a
        plain file into it): no commit publishes it half copied."""
        f.writers += 1
        try:
            yield
        finally:
            f.writers -= 1

    def set_attributes(
        self,
        f: CachedFile,
        *,
        mode: int | None = None,
        uid: int | None = None,
        gid: int | None = None,
        atime_ns: int | None = None,
        mtime_ns: int | None = None,
    ) -> None:
        """chmod, chown, utimes, a kill of setuid bits: published with the
        content at the next commit."""
        if mode is not None:
            f.mode = mode & 0o7777
        if uid is not None:
            f.uid = uid
        if gid is not None:
            f.gid = gid
        if atime_ns is not None:
            f.atime_ns = atime_ns
        if mtime_ns is not None:
            f.mtime_ns = mtime_ns

    def replacing_plain(self, f: CachedFile, plain: PlainFile | None) -> None:
        """``f`` was copied from the plain file ``plain``, which stays in the
        store until ``f``'s first publish (None: published, it is gone)."""
        f.replaces_plain = plain

    def inode_attached(self, f: CachedFile, ino: int, unlinked: bool) -> None:
        """Inode ``ino`` reads ``f``; an unlinked one keeps ``f`` for the
        kernel's last uses of it."""
        f.ino = ino
        f.orphan_inodes += unlinked

    def inode_unlinked(self, f: CachedFile) -> bool:
        """An inode reading ``f`` lost its name: ``f`` is kept for it until
        FORGET. False if ``f`` is gone already (retired and dropped, its
        bytes released): there is nothing to keep."""
        if self.gone(f):
            return False
        f.orphan_inodes += 1
        return True

    def gone(self, f: CachedFile) -> bool:
        """Whether ``f`` was retired and dropped: no name, no reader, and its
        pages back in the arena. Nothing may read it any more."""
        return f.unlinked and f not in self.retired

    def inode_detached(self, f: CachedFile) -> None:
        """An unlinked inode no longer reads ``f`` (FORGET, or it reads
        another file now): ``f`` goes if nothing else reads it."""
        f.orphan_inodes -= 1
        self.let_go(f)

    def flushed(self, f: CachedFile, length: int) -> None:
        """The flusher stored (or found stored) ``length`` more bytes of ``f``."""
        f.flushed_bytes += length

    def let_go(self, f: CachedFile) -> None:
        """A handle or an inode of ``f`` is gone: an unlinked file nothing can
        read any more is dropped, and so is a mirror kept for its readers."""
        if f.unlinked and not self._referenced(f):
            self.drop(f)
        if self.kept_mirrors:
            self._release_kept(f.file_id, f.version)

    def _read_here(self, file_id: str, version: str) -> bool:
        """Whether a handle here reads that version of ``file_id`` (one
        pending elsewhere when it was opened, or made durable since)."""
        return any(
            f is not None
            and f.file_id == file_id
            and f.version == version
            and f.role in (FileRole.REMOTE, FileRole.LOCAL)
            and f.handles > 0
            for f in [self.files.get(file_id), *self.retired]
        )

    def _release_kept(self, file_id: str, version: str) -> None:
        kept = self.kept_mirrors.get((file_id, version))
        if kept is not None and not self._read_here(file_id, version):
            self.drop(kept)

    def dropped_here(self, f: CachedFile) -> bool:
        """Whether ``f`` is a version pending elsewhere whose mirror this node
        had and dropped (its writer let go of it) before a handle here held
        it: its holders may not serve it any more, so an open of it is sent
        back to look at the name again."""
        return (
            f.role is FileRole.REMOTE
            and (f.file_id, f.version) in self._dropped_versions
            and self.held_version(f.file_id, f.version) is None
        )

    @staticmethod
    def _referenced(f: CachedFile) -> bool:
        """Whether anything may still read ``f``: an open handle, or an inode
        whose name was removed but which the kernel still knows (a path walk
        that resolved the name before may open it)."""
        return f.handles > 0 or f.orphan_inodes > 0

    def prune(self) -> int:
        """Forget the oldest idle entries beyond MAX_IDLE_FILES: durable, no RAM,
        not open. They are only metadata, rebuilt from the manifest on the
        next open; an inode the kernel still holds lets go of its file
        (``unreference``). Without this the daemon's heap grew with every file
        ever written: a job writing 100,000 small files, or a long job one per
        checkpoint file forever."""
        if len(self.files) <= MAX_IDLE_FILES + PRUNE_SLACK:
            return 0  # amortized: a sort only every PRUNE_SLACK new files
        idle = [
            f
            for f in self.files.values()
            if f.state is FileState.DURABLE
            and not f.handles
            and not f.orphan_inodes
            and not f.ram_count
        ]
        excess = len(idle) - MAX_IDLE_FILES
        if excess <= 0:
            return 0
        for f in sorted(idle, key=lambda f: f.last_access)[:excess]:
            del self.files[f.file_id]
            self.unreference(f)
        return excess

    async def run_cpu(self, fn: Callable[..., Any], *args: object) -> Any:
        return await run_cpu(fn, *args, limiter=self.hash_limiter)

    def stats(self) -> dict[str, Any]:
        return {
            "capacity": self.arena.capacity,
            "used": self.arena.used_slots * self.page_size,
            "dirty": self.dirty_pages * self.page_size,
            "peak": {
                "used": self.arena.peak_used * self.page_size,
                "own_dirty": self.peak_own_dirty * self.page_size,
                "mirrored": self.peak_mirrored * self.page_size,
            },
            "page_size": self.page_size,
            "frames": self.frames.slots_held * self.page_size,
            "waiting_writers": self.waiting_writers,
            "unconfirmed": len(self.unconfirmed),
            "backpressure_events": self.backpressure_events,
            "backpressure_seconds": round(self.backpressure_seconds, 3),
            "evicted_bytes": self.evicted_bytes,
            "spilled_bytes": self.spilled_bytes,
            **self.frames.stats(),
            "readahead": self.readahead.stats(),
            "remote_reads": self.remote.stats(),
        }
