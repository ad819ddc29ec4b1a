"""A ckptfs Core driven without FUSE, with every background await steppable.

The Core (cache, journal, flusher, spiller, filesystem logic, recovery) runs
on a trio loop in a thread of its own. Every backing-store call made by a
background task (flusher, spiller) waits at a gate until the test lets one
through, so a flush or a spill can be stopped at any await while foreground
operations (writes, truncates, commits, reads) run. Backing-store calls run
inline on the loop and the journal writes inline too, so the interleaving is
decided by the gate alone.
"""

from __future__ import annotations

import contextvars
import errno
import os
import random
import shutil
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import trio
import trio.testing
from ckptfs.fs.config import Config
from ckptfs.fs.daemon.core import Core
from ckptfs.fs.namespace.inodes import ROOT
from ckptfs.fs.namespace.posix import Caller
from ckptfs.fs.store.blocking import BackingIO, Call
from ckptfs.fs.store.chunkstore import ChunkStore
from ckptfs.fs.store.manifest import read_manifest

BACKGROUND: contextvars.ContextVar[str | None] = contextvars.ContextVar("bg", default=None)


class Gate:
    """Backing-store and journal calls wait here for a permit.

    Background calls (flusher, spiller, journal task) and foreground calls
    (the operation under test) have separate permits, so the test decides how
    many background steps happen at each await of a foreground operation.
    """

    def __init__(self) -> None:
        self.waiting = {"bg": 0, "fg": 0}
        self.labels: list[str] = []  # what the waiting background calls are
        self._permits = {"bg": 0, "fg": 0}
        self._event = trio.Event()
        self._crashed = False

    def crash(self) -> None:
        """The Core crashed: no call of it reaches the store or the journal
        any more (a shielded cleanup's write fails at once rather than wait
        for a permit nobody will grant)."""
        self._crashed = True
        self._event.set()

    async def through(self, what: str = "") -> None:
        side = "fg" if BACKGROUND.get() is None else "bg"
        self.waiting[side] += 1
        if side == "bg":
            self.labels.append(what)
        try:
            while self._crashed or not self._permits[side]:
                if self._crashed:
                    raise OSError(errno.EIO, f"{what or 'a call'}: the Core crashed")
                await self._event.wait()
            self._permits[side] -= 1
        finally:
            self.waiting[side] -= 1
            if side == "bg":
                self.labels.remove(what)

    def grant(self, side: str, n: int = 1) -> None:
        self._permits[side] += n
        self._event.set()
        self._event = trio.Event()


class InlineIO(BackingIO):
    def __init__(self, gate: Gate) -> None:
        super().__init__(timeout=600)
        self.gate = gate

    async def run(self, fn: Callable[..., Any], *args: object, **kw: Any) -> Any:
        await self.gate.through(kw.get("what", ""))
        if kw.get("with_call"):
            return fn(kw.get("call") or Call(kw.get("late")), *args)
        return fn(*args)


def _in_background(name: str, fn: Callable[[], Awaitable[None]]) -> Callable[[], Awaitable[None]]:
    async def task() -> None:
        BACKGROUND.set(name)
        await fn()

    return task


class Deadlock(AssertionError):
    pass


class Harness:
    """One Core on a loop in a thread; ``call`` runs a foreground coroutine to
    completion, letting background calls through one at a time while it waits."""

    def __init__(self, root: Path, cache_slots: int = 24, slot_size: int = 4096) -> None:
        self.root = root
        self.backing = root / "backing"
        self.cache_root = root / "cache"
        self.backing.mkdir(parents=True, exist_ok=True)
        (self.backing / ".ckptfs" / "chunks").mkdir(parents=True, exist_ok=True)
        self.slot_size = slot_size
        self.config = Config(node="model", backing=self.backing, cache_size=cache_slots * slot_size)
        self.config.chunk_size = 3 * slot_size  # chunks straddle pages
        self.config.flush_workers = 1  # others wait in the queue, unpinned
        self.config.cache_prefault = False
        self.config.flush_settle = 0.0  # background steps run the flusher at once
        self.core: Core | None = None
        self.gate: Gate | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._ready = threading.Event()
        self._stop: trio.Event | None = None
        self._scope: trio.CancelScope | None = None
        self._thread = threading.Thread(target=trio.run, args=(self._main,), daemon=True)
        self._thread.start()
        self._ready.wait(30)

    async def _main(self) -> None:
        self._token = trio.lowlevel.current_trio_token()
        self._stop = trio.Event()
        self._ready.set()
        await self._stop.wait()

    def call(
        self, fn: Callable[..., Awaitable[Any]], *args: Any, schedule: list[int] | None = None
    ) -> Any:
        """Run ``fn(*args)`` on the loop to completion. At its n-th pause (a
        backing-store or journal call) ``schedule[n]`` background steps run
        first; whenever it is blocked (backpressure), background steps run."""
        return trio.from_thread.run(
            self._pumped, fn, args, list(schedule or []), trio_token=self._token
        )

    async def _settle(self) -> None:
        await trio.testing.wait_all_tasks_blocked(cushion=0.0002)

    async def _pumped(
        self, fn: Callable[..., Awaitable[Any]], args: tuple[Any, ...], schedule: list[int]
    ) -> Any:
        done: dict[str, Any] = {}

        async def op() -> None:
            try:
                done["value"] = await fn(*args)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                done["error"] = exc

        gate = self.gate
        assert gate is not None
        async with trio.open_nursery() as nursery:
            nursery.start_soon(op)
            idle = 0
            while True:
                await self._settle()
                if done:
                    break
                if gate.waiting["fg"]:
                    for _ in range(schedule.pop(0) if schedule else 0):
                        if not gate.waiting["bg"]:
                            break
                        gate.grant("bg")
                        await self._settle()
                    gate.grant("fg")
                    idle = 0
                elif gate.waiting["bg"]:
                    gate.grant("bg")
                    idle = 0
                else:
                    idle += 1
                    if idle > 400:
                        nursery.cancel_scope.cancel()
                        raise Deadlock(f"{getattr(fn, '__name__', fn)} made no progress")
                    await trio.sleep(0.005)  # timers (backpressure polling) may be due
        if "error" in done:
            raise done["error"]
        return done.get("value")

    def direct(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> Any:
        """Run ``fn(*args)`` on the loop with no pumping (it grants what it needs)."""
        return trio.from_thread.run(fn, *args, trio_token=self._token)

    async def background_steps(self, steps: int) -> None:
        """Let background tasks take up to ``steps`` gated calls, nothing else running."""
        assert self.gate is not None
        for _ in range(steps):
            await self._settle()
            if not self.gate.waiting["bg"]:
                return
            self.gate.grant("bg")
        await self._settle()

    async def background_until(self, label: str, limit: int = 60) -> None:
        """Let background tasks run until one waits at a call whose label starts
        with ``label`` (e.g. the flusher about to write a durable manifest)."""
        assert self.gate is not None
        for _ in range(limit):
            await self._settle()
            if any(w.startswith(label) for w in self.gate.labels) or not self.gate.waiting["bg"]:
                return
            self.gate.grant("bg")

    async def journal_run(self, fn: Callable[..., Any], *args: Any) -> Any:
        assert self.gate is not None
        await self.gate.through(f"journal {getattr(fn, '__name__', '')}")
        return fn(*args)

    # ----- the Core's life ------------------------------------------------------
    def start(self) -> None:
        self.gate = Gate()
        self.call(self._start)

    async def _start(self) -> None:
        assert self.gate is not None
        core = Core(
            self.config,
            self.cache_root,
            io=InlineIO(self.gate),
            journal_runner=self.journal_run,
            slot_size=self.slot_size,
        )
        core.cache.backpressure_poll = 0.005
        # Every background task's calls are background steps.
        for owner, name in (
            (core.flusher, "_worker"),
            (core.cache, "run_spiller"),
            (core.journal, "run"),
            (core.fs, "retry_commits"),
        ):
            setattr(owner, name, _in_background(name, getattr(owner, name)))
        self._scope = trio.CancelScope()
        started = trio.Event()
        failure: list[BaseException] = []

        async def host() -> None:
            assert self._scope is not None
            with self._scope:
                try:
                    async with trio.open_nursery() as nursery:
                        await core.start(nursery, prefault=False)
                        started.set()
                        await trio.sleep_forever()
                except BaseException as exc:
                    failure.append(exc)
                    started.set()
                    raise

        assert self._stop is not None
        trio.lowlevel.spawn_system_task(host)
        await started.wait()
        if failure:
            raise failure[0]
        self.core = core

    def crash(self) -> None:
        """Kill the Core as a crash would: nothing finishes, nothing is cleaned up."""
        trio.from_thread.run(self._crash, trio_token=self._token)

    async def _crash(self) -> None:
        assert self._scope is not None and self.core is not None and self.gate is not None
        self._scope.cancel()
        self.gate.crash()
        await trio.testing.wait_all_tasks_blocked()
        self.core.arena.close()
        self.core.backing.close()
        self.core = None

    def stop_clean(self) -> None:
        """As after a clean unmount: everything durable, the cache directory removed."""
        self.crash()
        shutil.rmtree(self.cache_root)

    def close(self) -> None:
        if self.core is not None:
            try:
                self.crash()
            except Exception:  # noqa: BLE001 - best effort at teardown
                pass
        if self._token is not None and self._stop is not None:
            trio.from_thread.run_sync(self._stop.set, trio_token=self._token)
        self._thread.join(10)

    # ----- looking at the backing store ------------------------------------------
    def manifests(self) -> dict[str, Any]:
        out = {}
        for name in os.listdir(self.backing):
            path = self.backing / name
            if name.startswith(".") or not path.is_file():
                continue
            m = read_manifest(path)
            if m is not None:
                out[name] = m
        return out

    def corrupt_chunks(self) -> list[str]:
        """Stored chunks whose bytes do not match their name."""
        from ckptfs.fs.store.chunkstore import chunk_hash

        bad = []
        for path in (self.backing / ".ckptfs" / "chunks").rglob("*"):
            named = path.is_file() and "." not in path.name  # not a temporary
            if named and chunk_hash(path.read_bytes()) != path.name:
                bad.append(path.name)
        return bad

    def reassemble(self, m: Any) -> bytes:
        store = ChunkStore(self.backing)
        out = bytearray(m.size)
        for c in m.chunks:
            out[c.offset : c.end] = store.get(c.hash, c.length)
        return bytes(out)


def errno_of(exc: BaseException) -> int:
    return getattr(exc, "errno", None) or errno.EIO


def audit(core: Core) -> list[str]:
    """Problems with the cache's internal consistency (empty when all is well)."""
    from ckptfs.fs.content.state import FileState, PageState

    cache = core.cache
    problems = []
    dirty_total = 0
    slots: dict[int, str] = {}
    for f in cache.all_files():
        dirty = sum(1 for p in f.pages.values() if p.state is PageState.DIRTY)
        ram = sum(1 for p in f.pages.values() if p.in_ram)
        dirty_total += dirty
        if (dirty, ram) != (f.dirty_count, f.ram_count):
            problems.append(
                f"{f.path}: counters {f.dirty_count}/{f.ram_count}, pages {dirty}/{ram}"
            )
        for p, page in f.pages.items():
            if page.in_ram:
                if page.slot in slots:
                    problems.append(f"{f.path}: slot {page.slot} also used by {slots[page.slot]}")
                slots[page.slot] = f"{f.path} page {p}"
        if f.state is FileState.DURABLE:
            if any(p.state is not PageState.CLEAN for p in f.pages.values()):
                problems.append(f"{f.path}: durable with dirty or spilled pages")
            for p, page in f.pages.items():
                start = p * cache.page_size
                end = min(start + cache.page_size, f.size)
                ram = cache.arena.read(page.slot, 0, max(0, min(page.fill, end - start)))
                ram += bytes(max(0, end - start - len(ram)))
                base = bytearray()
                for off, length, chunk in f.base.pieces(start, end):
                    if chunk is None:
                        base += bytes(length)
                    else:
                        data = cache.store.get(chunk.hash, chunk.length)
                        base += data[off - chunk.offset : off - chunk.offset + length]
                if ram != bytes(base):
                    problems.append(f"{f.path}: clean page {p} differs from its durable chunks")
    if dirty_total != cache.dirty_pages:
        problems.append(f"dirty page total {cache.dirty_pages}, pages say {dirty_total}")
    # An unlinked file is kept exactly while a handle or an orphaned inode can read it.
    orphans: dict[int, int] = {}
    for inode in core.fs.inodes.by_ino.values():
        if inode.file is not None and inode.unlinked:
            orphans[id(inode.file)] = orphans.get(id(inode.file), 0) + 1
    for f in cache.all_files():
        if f.orphan_inodes != orphans.get(id(f), 0):
            problems.append(
                f"{f.path}: counts {f.orphan_inodes} orphaned inodes, {orphans.get(id(f), 0)} exist"
            )
        if f.unlinked and not f.handles and not f.orphan_inodes:
            problems.append(f"{f.path}: unlinked and unreferenced, but still held")
    for frame in cache.frames.frames.values():
        for slot in frame.slots:
            if slot in slots:
                problems.append(f"frame slot {slot} also used by {slots[slot]}")
            slots[slot] = f"frame {frame.chunk.hash[:8]}"
    return problems


# ----- what a process does through the harness ---------------------------------------

CALLER = Caller(0, 0)  # root
SIZE = 5 * 4096 + 17  # pages of the harness's 4 KiB slots, the last one partial


def save(h: Harness, name: str, data: bytes) -> int:
    """torch.save: create, write, close. Returns the inode (one lookup held)."""
    fs = h.core.fs
    fh, attr = h.call(fs.create, ROOT, name, 0o644, os.O_WRONLY, CALLER)
    h.call(fs.write, fh, 0, data)
    h.call(fs.flush, fh)
    h.call(fs.release, fh)
    return attr.ino


def read_inode(h: Harness, ino: int) -> bytes:
    """The whole file of inode ``ino``, through an open of its own."""
    fs = h.core.fs
    fh, _ = h.call(fs.open, ino, os.O_RDONLY, CALLER)
    try:
        out = bytearray()
        while piece := h.call(fs.read, fh, len(out), 5000):
            out += piece
        return bytes(out)
    finally:
        h.call(fs.release, fh)


def read_handle(h: Harness, fh: int) -> bytes:
    """The whole file open at handle ``fh``, from its start."""
    out = bytearray()
    while piece := h.call(h.core.fs.read, fh, len(out), 5000):
        out += piece
    return bytes(out)


def name_reads(h: Harness, name: str) -> bytes:
    """What the name reads now, through a fresh lookup."""
    return read_inode(h, h.call(h.core.fs.lookup, ROOT, name).ino)


def saved(h: Harness, name: str, data: bytes) -> None:
    """Written, closed and flushed."""
    save(h, name, data)
    h.direct(h.background_steps, 100)
    assert read_manifest(h.backing / name).state == "durable"


def opened(h: Harness, name: str, data: bytes | None = None) -> tuple[int, int]:
    """Saved, looked up and opened for reading: (inode, handle)."""
    saved(h, name, random.randbytes(SIZE) if data is None else data)
    ino = h.call(h.core.fs.lookup, ROOT, name).ino
    fh, _ = h.call(h.core.fs.open, ino, os.O_RDONLY, CALLER)
    return ino, fh


def close(h: Harness, *fhs: int) -> None:
    """close() of each handle: FLUSH, then RELEASE."""
    for fh in fhs:
        h.call(h.core.fs.flush, fh)
        h.call(h.core.fs.release, fh)


T = TypeVar("T")


def inline(h: Harness, fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` on the loop, synchronously, as the session's reader runs it."""
    return trio.from_thread.run_sync(fn, *args, trio_token=h._token)


def read_now_copied(h: Harness, fh: int, off: int, size: int) -> bytes | None:
    """``FileSystem.read_now`` as a reader runs it, its views copied before
    the loop runs on (they are valid until its next await)."""

    def read() -> bytes | None:
        got = h.core.fs.read_now(fh, off, size)
        return None if got is None else b"".join(got) if isinstance(got, list) else bytes(got)

    return inline(h, read)
