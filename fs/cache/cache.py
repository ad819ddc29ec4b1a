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

import errno
import itertools
import logging
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import trio
from ckptfs.fs.cache.journal import Journal, chunks_of
from ckptfs.fs.cache.transitions import move, start
from ckptfs.fs.content.arena import Arena
from ckptfs.fs.content.cachedfile import CachedFile, ChunkMap, Page, Snapshot
from ckptfs.fs.content.state import FileRole, FileState, MirrorState, PageState
from ckptfs.fs.interrupts import Interrupted, interruptible
from ckptfs.fs.read.frames import FrameCache
from ckptfs.fs.read.readahead import ReadAhead
from ckptfs.fs.read.readsource import RangeReader
from ckptfs.fs.read.remoteread import RemoteReader, WriterMovedOn
from ckptfs.fs.store.blocking import BackingIO, Call, on_loop_later, run_cpu
from ckptfs.fs.store.chunkstore import ChunkStore, chunk_hash
from ckptfs.fs.store.manifest import Chunk, Manifest, new_id

if TYPE_CHECKING:
    from ckptfs.fs.store.backing import PlainFile

log = logging.getLogger("ckptfs.cache")

# (holders, file_id, version, offset, length) -> verified bytes; OSError if none serves.
# (holders, file_id, version, offset, length, buffer to receive into or None)
# -> verified bytes; OSError if no holder serves them.
PeerFetch = Callable[
    [list[str], str, str, int, int, bytearray | None], Awaitable[bytes | memoryview]
]
MAX_IDLE_FILES = 4096
PRUNE_SLACK = 1024
# The largest file ckptfs accepts (16 TiB): larger sizes and offsets get EFBIG.
# Memory does not depend on it (page tables are sparse); it bounds what a
# hostile or mistaken truncate can ask of the chunk list and the store.
MAX_FILE_SIZE = 1 << 44
BACKPRESSURE_WARN_SECONDS = 60.0
MAX_GONE_MIRRORS = 65536
# Renames of mirrors not held yet (a rename crossing a close's first page:
# rare), each path up to a request's meta size: bounded apart.
MAX_EARLY_PATHS = 1024
BACKPRESSURE_POLL = 1.0  # seconds between looks for space, besides being woken


class FileLost(OSError):
    """The bytes of a file are gone: its holders and the backing store lack them."""

    def __init__(self, message: str) -> None:
        super().__init__(errno.EIO, message)


class HoldersFailed(OSError):
    """No holder served bytes of a file pending on other nodes. Either it is
    lost, or its writer moved on (published it as durable, or rewrote,
    replaced or removed it): only its manifest tells, which the caller reads
    (Filesystem.read), then :meth:`Cache.declare_lost` if it is lost."""

    def __init__(self, path: str, version: str, reason: str, *, moved_on: bool = False) -> None:
        super().__init__(errno.EIO, f"{path}: {reason}")
        self.version = version
        self.reason = reason
        # A holder said its writer is changing the file (WriterMovedOn).
        self.moved_on = moved_on


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


def _bytes_here(f: CachedFile) -> bool:
    """Whether ``f``'s bytes may be in this node's RAM or store frames at
    all: not once it is lost, nor for a file pending on another node (its
    bytes come from its holders)."""
    return not f.lost and f.role is not FileRole.REMOTE


class Cache:
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
        if f is not None and (f.modified or (f.version == m.version and not f.unlinked)):
            f.path = path
            f.seq = max(f.seq, m.seq)  # (our next version goes after any we saw)
            if not f.modified:
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
        if m.state == "durable":
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

    def inode_unlinked(self, f: CachedFile) -> None:
        """An inode reading ``f`` lost its name (kept until FORGET)."""
        f.orphan_inodes += 1

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

    def publish_failed(self, snap: Snapshot, name_gone: bool) -> None:
        f = snap.file
        f.publishing = None
        # Never published, so recovery would reject it: no need to wait.
        self.journal.drop_later((f.file_id, snap.version))
        if f.state is FileState.PUBLISHING:
            move(f, FileState.MODIFIED)
        if name_gone:
            log.info("%s no longer names the file being written; dropping its content", f.path)
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

    # ----- buddy mirroring: the writer's side ---------------------------------
    def set_mirror(self, f: CachedFile, state: MirrorState) -> None:
        """Record whether ``f``'s buddy holds its content (peer/mirror/mirror.py decides)."""
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
    ) -> list[int]:
        """The writer published (or is about to publish) ``manifest`` for the
        content streamed under ``mid``: ``ram`` lists (gen, fill) per page the
        buddy must hold, ``spilled`` the pages already in chunks, ``floor``
        the writer's newest generation for the content at its snapshot.
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

    # ----- memory ---------------------------------------------------------
    def _touch(self, f: CachedFile) -> None:
        f.last_access = time.monotonic()
        if f.ram_count:
            self._resident.pop(f, None)
            self._resident[f] = None

    def _free_slot(self, slot: int) -> None:
        self.arena.release(slot)
        self._signal_space()

    def _signal_space(self) -> None:
        self._space_event.set()
        self._space_event = trio.Event()

    def _drop_page(self, f: CachedFile, p: int) -> None:
        page = f.pages.pop(p)
        if page.in_ram:
            self.arena.release(page.slot)
            f.ram_count -= 1
        if page.state is PageState.DIRTY:
            f.dirty_count -= 1
            self.dirty_pages -= 1

    def _release_pages(self, f: CachedFile, pages: list[int]) -> int:
        freed = 0
        for p in pages:
            if p in f.pages:
                freed += f.pages[p].in_ram
                self._drop_page(f, p)
        if freed:
            self._signal_space()
        return freed

    def _clean_pages(self, f: CachedFile) -> list[int]:
        return [
            p
            for p, pg in f.pages.items()
            if pg.state is PageState.CLEAN and not self.arena.pinned(pg.slot)
        ]

    def _evict_one(self) -> bool:
        """Free the least recently used clean bytes: a chunk frame or a file's clean pages."""
        frame = self.frames.oldest()
        victim: CachedFile | None = None
        gone: list[CachedFile] = []
        for f in self._resident:
            if not f.ram_count:
                gone.append(f)
            elif f.ram_count > f.dirty_count and self._clean_pages(f):
                victim = f
                break
        for f in gone:
            del self._resident[f]
        if frame is not None and (victim is None or frame.last_access <= victim.last_access):
            freed = self.frames.evict(frame)
        elif victim is not None:
            freed = self._release_pages(victim, self._clean_pages(victim))
            if victim.state is FileState.DURABLE:
                log.debug("evicted %s (%d MiB)", victim.path, freed * self.page_size >> 20)
        else:
            return False
        self.evicted_bytes += freed * self.page_size
        self._signal_space()
        return freed > 0

    def try_alloc(self) -> int | None:
        """A free slot, evicting clean bytes if needed; None rather than wait."""
        while True:
            slot = self.arena.alloc()
            if slot is not None or not self._evict_one():
                return slot

    async def alloc_for_write(self, f: CachedFile) -> int:
        """A free slot for a write to ``f``; waits (backpressure) rather than fail."""
        slot = self.try_alloc()
        if slot is not None:
            return slot
        self.backpressure_events += 1
        self.waiting_writers += 1
        start = time.monotonic()
        warned = False
        try:
            while slot is None:
                waited = time.monotonic() - start
                if not self._bp_logged:
                    self._bp_logged = True
                    log.info(
                        "backpressure: cache full (%d MiB, %d MiB not durable); "
                        "writes to %s wait for the flusher",
                        self.arena.capacity >> 20,
                        self.dirty_pages * self.page_size >> 20,
                        f.path,
                    )
                if waited > BACKPRESSURE_WARN_SECONDS and not warned:
                    warned = True
                    log.warning(
                        "a write to %s has waited %.0fs for cache space; the backing store "
                        "is not keeping up (health %s)",
                        f.path,
                        waited,
                        self.io.health,
                    )
                self.need_space.set()
                with interruptible(f"write to {f.path} waiting for cache space"):
                    with trio.move_on_after(self.backpressure_poll):
                        await self._space_event.wait()
                slot = self.try_alloc()
        finally:
            self.waiting_writers -= 1
            self.backpressure_seconds += time.monotonic() - start
            if not self.waiting_writers:
                self._bp_logged = False
        return slot

    def evict(self, f: CachedFile) -> int:
        """Drop the RAM copy of a durable file; returns bytes freed."""
        if f.state is not FileState.DURABLE or f.writers:
            return 0
        freed = self._release_pages(f, self._clean_pages(f)) * self.page_size
        self.evicted_bytes += freed
        if freed:
            log.debug("evicted %s (%d MiB)", f.path, freed >> 20)
            self.prune()
        return freed

    def evict_frames(self) -> int:
        freed = 0
        while (frame := self.frames.oldest()) is not None:
            freed += self.frames.evict(frame)
        if freed:
            self._signal_space()
        return freed * self.page_size

    # ----- reading ------------------------------------------------------------
    async def read(
        self,
        f: CachedFile,
        off: int,
        size: int,
        *,
        view_ok: bool = False,
        into: bytearray | None = None,
    ) -> bytes | memoryview:
        """Bytes of ``f``; ``view_ok`` and ``into``: see RangeReader.read."""
        if f.lost:
            raise FileLost(f"{f.path}: bytes lost ({f.lost_reason or 'no holder'})")
        self._touch(f)
        end = min(off + size, f.size)
        if end <= off:
            return b""
        if f.role is FileRole.REMOTE:
            # Pending elsewhere, or such a version retired here (a newer one
            # was loaded, or it was removed) while handles still read it: its
            # bytes are only on its holders, never in this node's RAM or chunks.
            return await self._read_remote(f, off, end)
        # Before this read waits for its own chunk, so the next ones overlap it.
        self.readahead.observe(f, off, end)
        return await self.reader.read(f, off, end, view_ok=view_ok, into=into)

    def read_now(self, f: CachedFile, off: int, size: int) -> list[memoryview] | bytes | None:
        """Bytes of ``f`` as views of the arena, if none needs a wait; None if
        one does (``read`` then waits for it)."""
        if not _bytes_here(f):
            return None
        end = min(off + size, f.size)
        views = self.reader.read_now(f, off, end, frames_ok=True) if end > off else []
        if views is None:
            return None
        self._touch(f)
        if not views:
            return b""
        self.readahead.observe(f, off, end)
        return views

    def copy_in_ram(self, f: CachedFile, off: int, end: int) -> bytes | None:
        """A copy of bytes [off, end) of ``f`` if every one is in RAM (or a
        hole) now, else None. Not a read: no read pattern is observed."""
        if not _bytes_here(f):
            return None
        views = self.reader.read_now(f, off, min(end, f.size), frames_ok=False)
        return None if views is None else b"".join(views)

    async def read_held(
        self,
        file_id: str,
        version: str,
        off: int,
        size: int,
        *,
        into: bytearray | None = None,
        writer: str | None = None,
    ) -> bytes | memoryview | None:
        """Bytes of exactly that version if this node holds it (for a peer, or
        for a mirror read here; ``writer``: see held_version); None if not. A
        read that waits for a chunk resolves the rest of its range again
        afterwards, from whatever the file holds then: if it changed
        meanwhile (a rewrite, a fork, a mirrored page), the bytes would mix
        versions, so it is read again from the version's current holder, or
        refused."""
        for _attempt in range(3):
            f = self.held_version(file_id, version, writer)
            if f is None:
                return None
            gen = f.content_gen
            data = await self.read(f, off, size, into=into)
            if self.held_version(file_id, version, writer) is f and f.content_gen == gen:
                return data
        return None

    async def _read_remote(self, f: CachedFile, off: int, end: int) -> bytes | memoryview:
        """Bytes of a file pending on other nodes, from a holder (verified there
        and here by hash). HoldersFailed if no holder serves them."""
        assert self.peer_fetch is not None
        version = f.version
        writer = f.holders[0] if f.holders else ""
        held = self.held_version(f.file_id, version, writer)
        if held is not None and held is not f:
            data = await self.read_held(f.file_id, version, off, end - off, writer=writer)
            if data is not None:  # mirrored here, from its writer
                return data
        sequential = f.read_pattern.observe(off, end) is not None
        try:
            return await self.remote.read(
                list(f.holders), f.file_id, version, f.size, off, end, sequential=sequential
            )
        except Interrupted:
            raise  # the caller's stop signal, not a holder's failure
        except WriterMovedOn as exc:
            raise HoldersFailed(f.path, version, str(exc), moved_on=True) from None
        except OSError as exc:
            raise HoldersFailed(f.path, version, str(exc)) from None

    def declare_lost(self, f: CachedFile, failed: HoldersFailed) -> FileLost:
        """``f`` is still pending elsewhere at the version no holder served:
        LOST here, EIO with the reason, until its manifest changes or a
        holder is back (load). The error to raise."""
        if (
            f.state is FileState.PENDING
            and f.role is FileRole.REMOTE
            and f.version == failed.version
        ):
            move(f, FileState.LOST)
            f.lost_reason = f"not durable yet and no holder served it: {failed.reason}"
            self._notify(f)
            log.error("%s is lost here: %s", f.path, f.lost_reason)
        return FileLost(f"{f.path}: {failed.reason}")

    @property
    def peer_fetch(self) -> PeerFetch | None:
        return self._peer_fetch

    @peer_fetch.setter
    def peer_fetch(self, fetch: PeerFetch | None) -> None:
        self._peer_fetch = fetch
        self.remote.fetch = fetch or self._no_peers

    @staticmethod
    async def _no_peers(*args: object) -> bytes:
        raise OSError(errno.EHOSTUNREACH, "no peers to read a file pending elsewhere from")

    async def chunk_bytes(self, chunk: Chunk, start: int, count: int, what: str) -> bytes:
        """Verified bytes of a stored chunk, through a frame when there is room."""
        return await self.reader.chunk_bytes(chunk, start, count, what)

    # ----- writing --------------------------------------------------------------
    async def write(self, f: CachedFile, off: int, data: bytes) -> int:
        end = off + len(data)
        if end > MAX_FILE_SIZE:
            raise OSError(errno.EFBIG, f"{f.path}: writing up to {end} bytes exceeds the maximum")
        async with f.lock:
            await self._begin_change(f)
            ps = self.page_size
            view = memoryview(data)
            pos = off
            while pos < end:
                p, o = divmod(pos, ps)
                n = min(ps - o, end - pos)
                page = f.pages.get(p)
                try:
                    if page is None or not page.in_ram:
                        await self._page_in(f, p, o, n)
                        continue  # look again: the page table may have moved meanwhile
                    if self.arena.pinned(page.slot):
                        await self._copy_on_write(f, p, page)
                        continue
                except Interrupted:
                    if pos == off:
                        raise
                    break  # a short write: the pages before this one are written
                # No await from here to the end of this page.
                if o > page.fill:
                    self.arena.zero(page.slot, page.fill, o)
                self.arena.write(page.slot, o, view[pos - off : pos - off + n])
                page.fill = max(page.fill, o + n)
                self._changed(f, p, page)
                pos += n
                # Grown page by page: a later page may wait for memory, and the
                # spiller and readers must see the bytes already written.
                if pos > f.size:
                    f.size = pos
            f.mtime_ns = time.time_ns()
            self._touch(f)
        return pos - off

    async def _copy_on_write(self, f: CachedFile, p: int, page: Page) -> None:
        """Move page ``p`` to a new slot before writing it: its slot is pinned by a
        thread (flusher, spiller) that relies on those bytes not changing."""
        slot = await self.alloc_for_write(f)
        if f.pages.get(p) is not page or not page.in_ram or not self.arena.pinned(page.slot):
            self.arena.release(slot)  # moved or unpinned meanwhile: the caller looks again
            return
        self.arena.copy(page.slot, slot, page.fill)
        self.arena.release(page.slot)  # deferred until the last pin goes
        page.slot = slot

    async def _page_in(self, f: CachedFile, p: int, o: int, n: int) -> None:
        """Give page ``p`` a slot holding its current bytes before a write of [o, o+n).

        Only writes and truncates (under f.lock) add pages to a file, so page
        ``p`` is still not in RAM after the awaits here.
        """
        slot = await self.alloc_for_write(f)
        pstart = p * self.page_size
        existing = max(0, min(f.size, pstart + self.page_size) - pstart)
        fill = 0
        if existing and not (o == 0 and n >= existing):
            try:
                current = await self.reader.read(f, pstart, pstart + existing)
            except BaseException:
                self.arena.release(slot)
                raise
            self.arena.write(slot, 0, current)
            fill = len(current)
        old = f.pages.get(p)
        if old is not None and old.in_ram:
            self.arena.release(slot)
            return
        if old is not None:
            self._drop_page(f, p)  # a spilled page: its chunk is superseded
        # DIRTY at once: it is about to be written, and a page-in of a spilled
        # page holds bytes newer than the base.
        page = f.pages[p] = Page(PageState.CLEAN, slot, fill)
        f.ram_count += 1
        self._resident.setdefault(f, None)
        self._changed(f, p, page)

    async def truncate(self, f: CachedFile, size: int) -> None:
        if size > MAX_FILE_SIZE:
            raise OSError(errno.EFBIG, f"{f.path}: size {size} exceeds the maximum")
        async with f.lock:
            if size == 0 and f.owes_flush:
                self._fork(f)
            elif size == 0 and f.lost:
                if f.unlinked:  # a handle of the removed file rewrites it: nothing publishes it
                    f.unlinked_while_lost = False
                    self._content_here(f)
                else:
                    move(f, FileState.MODIFIED)
                    f.role = FileRole.LOCAL
                f.lost_reason, f.base = "", ChunkMap()
                self._notify(f)
            else:
                await self._begin_change(f)
            ps = self.page_size
            if size < f.size:
                first_gone = -(-size // ps)
                self._release_pages(f, [p for p in f.pages if p >= first_gone])
                boundary = size // ps
                page = f.pages.get(boundary)
                if size % ps and page is not None and page.fill > size - boundary * ps:
                    # A CLEAN page stays equal to the base, which is cut at the same
                    # place; a SPILLED page's chunk is read only up to its fill.
                    page.fill = size - boundary * ps
                    if page.state is PageState.DIRTY:
                        self._changed(f, boundary, page)
                f.base = f.base.truncated(size)
            f.content_gen = next(self._gen)
            f.size = size
            f.mtime_ns = time.time_ns()

    # ----- spilling under pressure -------------------------------------------
    async def relieve_pressure(self) -> bool:
        """Free memory for waiting writers; returns whether anything was freed."""
        if self._evict_one():
            return True
        # Spilling is for content no journal record lists (MODIFIED), or that
        # only open handles still read (UNLINKED).
        candidates = [
            f
            for f in self.all_files()
            if f.state in (FileState.MODIFIED, FileState.UNLINKED) and f.dirty_count
        ]
        if not candidates:
            return False
        f = max(candidates, key=lambda c: c.dirty_count)
        # Full pages first, lowest offsets first: the sequential writer is done with them.
        dirty = [p for p, pg in f.pages.items() if pg.state is PageState.DIRTY]
        pages = sorted(dirty, key=lambda p: (f.pages[p].fill < self.page_size, p))[:8]
        async with trio.open_nursery() as nursery:
            for p in pages:
                nursery.start_soon(self._spill_page, f, p)
        return True

    async def _spill_page(self, f: CachedFile, p: int) -> None:
        page = f.pages.get(p)
        if page is None or page.state is not PageState.DIRTY or not page.fill:
            return
        slot, gen = page.slot, page.gen
        length = page.fill  # a truncation clips fill, so it never runs past the size
        view = self.arena.slot_view(slot, 0, length)
        self.arena.pin(slot)

        def hash_and_store() -> str:
            digest = chunk_hash(view)
            self.store.put(digest, view)
            return digest

        call: Call[str] = Call(on_loop_later(self.arena.unpin, slot))
        try:
            digest = await self.io.run(hash_and_store, what=f"spill of {f.path}", call=call)
        finally:
            if not call.abandoned():
                view.release()
                self.arena.unpin(slot)
        current = f.pages.get(p)
        if (
            current is page
            and page.gen == gen
            and page.state is PageState.DIRTY
            and f.state in (FileState.MODIFIED, FileState.UNLINKED)
        ):
            self.arena.release(slot)
            page.slot = -1
            page.state = PageState.SPILLED
            page.chunk = Chunk(p * self.page_size, length, digest)
            page.fill = length
            f.ram_count -= 1
            f.dirty_count -= 1
            self.dirty_pages -= 1
            self.spilled_bytes += length
            self._signal_space()

    async def run_spiller(self) -> None:
        """The cache's background task (Core starts it): spills whenever writers
        wait for memory, and hosts the read-ahead's chunk reads."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self.readahead.run)
            self.remote.nursery = self.frames.nursery = nursery
            await self._spill_when_needed()

    async def _spill_when_needed(self) -> None:
        """Whenever writers wait for memory, spill until they don't."""
        while True:
            await self.need_space.wait()
            self.need_space = trio.Event()
            while self.waiting_writers:
                try:
                    progressed = await self.relieve_pressure()
                except Exception as exc:  # incl. ExceptionGroups: the spiller must live on
                    cause: BaseException = exc
                    while isinstance(cause, BaseExceptionGroup) and cause.exceptions:
                        cause = cause.exceptions[0]
                    log.warning("spilling dirty pages to the backing store failed: %s", cause)
                    progressed = False
                    await trio.sleep(1)
                if not progressed:
                    await trio.sleep(0.05)

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
            "backpressure_events": self.backpressure_events,
            "backpressure_seconds": round(self.backpressure_seconds, 3),
            "evicted_bytes": self.evicted_bytes,
            "spilled_bytes": self.spilled_bytes,
            **self.frames.stats(),
            "readahead": self.readahead.stats(),
            "remote_reads": self.remote.stats(),
        }
