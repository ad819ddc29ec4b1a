"""The cache journal: which arena slots hold which pending version, on tmpfs.

One record per version that this node published as pending and still owes
the backing store. It is saved *before* the pending manifest is published and
dropped before the file's bytes change again (or lazily, once it is durable or
superseded), so after a daemon crash a new daemon can adopt closed-but-not-
durable files from the arena. A record is only trusted if the manifest at its
path still names its file id and version as pending (see recovery.py).

Records are keyed by (file id, version): a version being rewritten can keep
its record while the rewrite is in progress. Every file operation runs in a
worker thread, and the operations on one key are ordered by a lock, so a drop
never overtakes the save it undoes.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import os
import threading
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import trio
from ckptfs.fs.content.cachedfile import Snapshot
from ckptfs.fs.content.state import PageState
from ckptfs.fs.store.beneath import check_rel
from ckptfs.fs.store.chunkstore import is_digest
from ckptfs.fs.store.manifest import Chunk, is_file_id

log = logging.getLogger("ckptfs.journal")
Key = tuple[str, str]
KEPT_ORDERS = 1 << 16  # keys whose latest write or removal is remembered
# Runs a blocking function off the loop (tests pass one that runs it inline).
ThreadRunner = Callable[..., Awaitable[Any]]


def record_of(snap: Snapshot) -> dict[str, Any]:
    """The journal record of a snapshot: enough to rebuild the file from the arena."""
    f = snap.file
    return {
        "file_id": f.file_id,
        "version": snap.version,
        "seq": snap.seq,
        "path": f.path,
        "size": snap.size,
        "mode": f.mode,
        "uid": f.uid,
        "gid": f.gid,
        "mtime_ns": f.mtime_ns,
        "atime_ns": f.atime_ns,
        "chunking": f.chunking,
        # The buddy's name for this content and each page's generation: a
        # daemon that recovers the version goes on with the buddy's copy.
        "mirror_id": f.mirror_id,
        "newest_gen": snap.newest_gen(),  # the buddy's floor for it (Snapshot.newest_gen)
        "dirty": {
            str(p): [pg.slot, pg.fill, pg.gen]
            for p, pg in snap.pages.items()
            if pg.state is PageState.DIRTY
        },
        "spilled": {
            str(p): [pg.chunk.offset, pg.chunk.length, pg.chunk.hash, pg.fill]
            for p, pg in snap.pages.items()
            if pg.state is PageState.SPILLED and pg.chunk is not None
        },
        "base": [[c.offset, c.length, c.hash] for c in snap.base.chunks],
        "base_end": snap.base.end,
    }


def chunks_of(items: list[list[Any]]) -> list[Chunk]:
    return [Chunk(int(o), int(n), str(h)) for o, n, h in items]


def _is_int(value: object, lo: int = 0, hi: int = 1 << 63) -> bool:
    return type(value) is int and lo <= value < hi


def _chunks_ok(items: object) -> bool:
    return isinstance(items, list) and all(
        isinstance(c, list) and len(c) == 3 and _is_int(c[0]) and _is_int(c[1]) and is_digest(c[2])
        for c in items
    )


def check_record(record: object) -> str | None:
    """Why a journal record cannot be adopted as it is, or None. The journal
    is the daemon's own (a private directory), but a record is checked
    before recovery acts on it like anything else read back: a torn or
    foreign one must cost its file, not the mount."""
    if not isinstance(record, dict):
        return "not a JSON object"
    if not is_file_id(record.get("file_id")) or not is_file_id(record.get("version")):
        return "bad file id or version"
    try:
        check_rel(record["path"])
        if "renamed_from" in record:
            check_rel(record["renamed_from"])
    except (KeyError, TypeError, ValueError, AttributeError):
        return "bad path"
    if not _is_int(record.get("seq", 0)):
        return "bad seq"
    if not _is_int(record.get("size")) or not _is_int(record.get("mode")):
        return "bad size or mode"
    if not _is_int(record.get("mtime_ns"), -(1 << 63) * 10**9, (1 << 63) * 10**9):
        return "bad mtime"
    dirty, spilled = record.get("dirty"), record.get("spilled")
    if not isinstance(dirty, dict) or not isinstance(spilled, dict):
        return "bad page tables"
    for page, entry in dirty.items():
        if not page.isdigit() or not isinstance(entry, list) or len(entry) not in (2, 3):
            return "bad dirty page"
        if not all(_is_int(x) for x in entry):
            return "bad dirty page"
    for page, entry in spilled.items():
        if not page.isdigit() or not _chunks_ok([entry[:3]]) or not _is_int(entry[3]):
            return "bad spilled page"
    if not _chunks_ok(record.get("base")) or not _is_int(record.get("base_end")):
        return "bad chunk map"
    return None


class Journal:
    def __init__(self, directory: Path, run_sync: ThreadRunner | None = None) -> None:
        self.dir = directory
        self._run_sync = run_sync or trio.to_thread.run_sync
        self.dir.mkdir(parents=True, exist_ok=True)
        self._locks: dict[Key, trio.Lock] = {}
        self._later_send, self._later_recv = trio.open_memory_channel[Key](math.inf)
        # The order of the writes and removals of each key, as their threads
        # began them (see _write). A store call the loop gave up on goes on
        # in its thread with no lock held: its write must not land after a
        # newer one, nor bring back a removed record. Bounded: a call is
        # given up within the backing-store timeout, and keys older than
        # KEPT_ORDERS newer ones are long past theirs.
        self._order = itertools.count(1)
        self._landed: OrderedDict[Key, int] = OrderedDict()
        self._order_lock = threading.Lock()

    async def run_sync(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await self._run_sync(fn, *args)

    def _path(self, key: Key) -> Path:
        return self.dir / f"{key[0]}.{key[1]}.json"

    def _lock(self, key: Key) -> trio.Lock:
        return self._locks.setdefault(key, trio.Lock())

    def _release_lock(self, key: Key, lock: trio.Lock) -> None:
        if not lock.locked() and lock.statistics().tasks_waiting == 0:
            self._locks.pop(key, None)

    async def save(self, record: dict[str, Any]) -> None:
        key = (record["file_id"], record["version"])
        lock = self._lock(key)
        async with lock:
            await self._run_sync(self._write, key, record)
        self._release_lock(key, lock)

    @asynccontextmanager
    async def locked(self, key: Key) -> AsyncIterator[None]:
        """Held around a save done elsewhere (write_now in a backing-store call)."""
        lock = self._lock(key)
        async with lock:
            yield
        self._release_lock(key, lock)

    def write_now(self, key: Key, record: dict[str, Any]) -> None:
        """Blocking save, for a thread that holds ``lock(key)``."""
        self._write(key, record)

    async def drop(self, key: Key) -> None:
        """Remove a record and wait until it is gone (before bytes it lists change)."""
        lock = self._lock(key)
        async with lock:
            await self._run_sync(self._remove, key)
        self._release_lock(key, lock)

    async def drop_held(self, key: Key) -> None:
        """``drop`` for a caller that holds ``locked(key)``."""
        await self._run_sync(self._remove, key)

    def drop_later(self, key: Key) -> None:
        """Remove a record soon; for records recovery would reject anyway."""
        self._later_send.send_nowait(key)

    async def run(self) -> None:
        """Background task: carry out drop_later requests, all those queued
        at once in one thread call (a directory of small files would
        otherwise pay a thread round trip per file)."""
        async for key in self._later_recv:
            batch = {key: None}
            while True:
                try:
                    batch[self._later_recv.receive_nowait()] = None
                except trio.WouldBlock:
                    break
            await self._drop_many(list(batch))

    async def _drop_many(self, keys: list[Key]) -> None:
        async with AsyncExitStack() as stack:
            # Sorted: a fixed order, so two batches can never wait for each other.
            locks = [(key, self._lock(key)) for key in sorted(keys)]
            for _, lock in locks:
                await stack.enter_async_context(lock)
            failed = await self._run_sync(self._remove_many, keys)
        for key, lock in locks:
            self._release_lock(key, lock)
        for key, exc in failed:
            log.error("could not remove cache journal record %s: %s", self._path(key), exc)

    def _remove_many(self, keys: list[Key]) -> list[tuple[Key, OSError]]:
        failed = []
        for key in keys:
            try:
                self._remove(key)
            except OSError as exc:
                failed.append((key, exc))
        return failed

    def _begin(self) -> int:
        with self._order_lock:
            return next(self._order)

    def _land(self, key: Key, order: int, act: Callable[[], None]) -> bool:
        """``act`` (a replace or a removal of the key's record) unless a
        write or removal begun after ``order`` landed first; True if done."""
        with self._order_lock:
            if self._landed.get(key, 0) > order:
                return False
            self._landed[key] = order
            self._landed.move_to_end(key)
            while len(self._landed) > KEPT_ORDERS:
                self._landed.popitem(last=False)
            act()
            return True

    def _write(self, key: Key, record: dict[str, Any]) -> None:
        order = self._begin()
        path = self._path(key)
        # A name of its own per write: two writes of one key (one of them a
        # call given up on) never write into each other's temporary file.
        tmp = path.with_name(f"{path.name}.{order}.tmp")
        tmp.write_text(json.dumps(record))
        if not self._land(key, order, lambda: os.replace(tmp, path)):
            tmp.unlink(missing_ok=True)  # a newer write or a removal came first

    def _remove(self, key: Key) -> None:
        order = self._begin()
        self._land(key, order, lambda: self._path(key).unlink(missing_ok=True))

    def load(self) -> list[dict[str, Any]]:
        """Every record (blocking; at startup, in a thread)."""
        records = []
        for path in sorted(self.dir.glob("*.json")):
            try:
                record = json.loads(path.read_text())
                why = check_record(record)
                if why is not None:
                    raise ValueError(why)
                records.append(record)
            except (OSError, ValueError, TypeError, IndexError) as exc:
                log.error("cache journal %s is unreadable (%s); ignoring it", path, exc)
                path.unlink(missing_ok=True)
        for path in self.dir.glob("*.tmp"):
            path.unlink(missing_ok=True)  # a save interrupted by the crash
        return records

    def remove_now(self, key: Key) -> None:
        """Blocking removal, for recovery (in a thread, before the loop serves)."""
        self._remove(key)
