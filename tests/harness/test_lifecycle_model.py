"""A stateful model test of a file's lifecycle, without FUSE.

Hypothesis drives the real cache, journal, flusher, spiller, filesystem logic
and crash recovery (lifecycle_harness.py) through random sequences of: opens
(creating, truncating, and reopening without truncation), writes of random
non-periodic bytes at random offsets, truncates, reads, fsync and close
(commits), unlink and rename, steps of the background flush and spill stopped
at any await, eviction, and daemon restarts (a clean one after draining, and
a crash that recovers from the journal). The cache is small, so backpressure,
spilling and eviction happen all the time.

The kernel's side of inodes is modelled too: every lookup is counted and
forgotten (FORGET) once the inode has no name, handle or path walk left; a
path walk resolves a name and opens the inode later, after any of the other
steps (an unlink or a rename over the name included): it must read the bytes
of the file it resolved, as on any POSIX filesystem.

After every step:
- every name reads back exactly its reference bytes (or EIO if, after a
  crash, its last version was legitimately lost);
- every durable manifest in the backing store names exactly the bytes that
  were published under its version: never anything else.
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from ckptfs.fs.content.state import FileState
from ckptfs.fs.namespace.inodes import ROOT
from ckptfs.fs.namespace.posix import SetAttr
from data import rand
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)
from lifecycle_harness import CALLER, Harness, audit, errno_of, read_now_copied

PS = 4096
NAMES = st.sampled_from(["a", "b"])
OFFSETS = st.sampled_from([0, 1, PS - 3, PS, 2 * PS + 100, 5 * PS - 1, 9 * PS, 12 * PS + 7])
SIZES = st.sampled_from([1, 100, PS - 1, PS, PS + 1, 3 * PS + 5, 7 * PS])
TRUNCS = st.sampled_from([0, 1, PS // 2, PS, 2 * PS + 9, 6 * PS, 14 * PS + 3])
MODES = st.sampled_from(["w", "rw", "rw-new", "r"])
# Background steps (flusher, spiller) let through at each await of a foreground operation.
SCHED = st.lists(st.integers(0, 4), max_size=6)
LABELS = st.sampled_from(
    ["write manifest", "read manifest", "flush of", "plan of", "spill of", "journal"]
)
WRITES = st.lists(st.tuples(OFFSETS, SIZES, st.integers(0, 1 << 30)), min_size=1, max_size=3)
STEPS = {"count": 0, "restarts": 0, "crashes": 0}
_TMP: list[Path] = []


@dataclass(eq=False)
class RefFile:
    data: bytearray = field(default_factory=bytearray)
    lost: bool = False


@dataclass
class OpenHandle:
    fh: int
    ino: int
    ref: RefFile
    writable: bool


@dataclass(eq=False)
class Walk:
    """A path walk that resolved a name to an inode and has not opened it yet."""

    ino: int
    ref: RefFile


class LifecycleModel(RuleBasedStateMachine):
    @initialize()
    def setup(self) -> None:
        root = _TMP[0] / f"ex{STEPS.setdefault('examples', 0)}"
        STEPS["examples"] += 1
        self.h = Harness(root)
        self.h.start()
        self.names: dict[str, RefFile] = {}
        self.handles: list[OpenHandle] = []
        self.versions: dict[tuple[str, str], bytes] = {}
        self._kernel_reset()

    def _kernel_reset(self) -> None:
        """A new FUSE session: the kernel knows no inodes."""
        self.lookups: dict[int, int] = {}  # inode -> lookups not yet forgotten
        self.ino_of: dict[str, int] = {}  # name -> the inode the kernel has for it
        self.walks: list[Walk] = []

    def teardown(self) -> None:
        if hasattr(self, "h"):
            self.h.close()

    # ----- helpers ------------------------------------------------------------------
    @property
    def fs(self):  # noqa: ANN201 - the current FileSystem
        assert self.h.core is not None
        return self.h.core.fs

    def _record_version(self, ino: int, ref: RefFile) -> None:
        """After a commit: the version now published names these bytes."""
        inode = self.fs.inodes.get(ino)
        f = inode.file if inode is not None else None
        if f is not None and f.state in (FileState.PENDING, FileState.DURABLE):
            self.versions.setdefault((f.file_id, f.version), bytes(ref.data))
            assert self.versions[(f.file_id, f.version)] == bytes(ref.data)

    def _lookup(self, name: str) -> int:
        ino = self.h.call(self.fs.lookup, ROOT, name).ino
        self._looked_up(name, ino)
        return ino

    def _looked_up(self, name: str, ino: int) -> None:
        self.lookups[ino] = self.lookups.get(ino, 0) + 1
        self.ino_of[name] = ino

    def _kernel_forgets(self) -> None:
        """FORGET every inode with no name, open handle or path walk left."""
        held = set(self.ino_of.values())
        held |= {h.ino for h in self.handles} | {w.ino for w in self.walks}
        for ino in [i for i in self.lookups if i not in held]:
            count = self.lookups.pop(ino)
            self.h.direct(self._forget, ino, count)

    async def _forget(self, ino: int, count: int) -> None:
        self.fs.forget(ino, count)

    def _read_all(self, name: str) -> bytes:
        ino = self._lookup(name)
        fh, _ = self.h.call(self.fs.open, ino, os.O_RDONLY, CALLER)
        try:
            out = bytearray()
            while True:
                piece = self.h.call(self.fs.read, fh, len(out), 3 * PS + 11)
                if not piece:
                    return bytes(out)
                out += piece
        finally:
            self.h.call(self.fs.release, fh)

    # ----- rules --------------------------------------------------------------------
    @precondition(lambda self: len(self.handles) < 4)
    @rule(name=NAMES, mode=MODES, sched=SCHED)
    def open(self, name: str, mode: str, sched: list[int]) -> None:
        STEPS["count"] += 1
        ref = self.names.get(name)
        if mode == "r" and ref is None:
            return
        if ref is None:
            flags = os.O_WRONLY if mode == "w" else os.O_RDWR
            fh, attr = self.h.call(self.fs.create, ROOT, name, 0o644, flags, CALLER, schedule=sched)
            ref = self.names[name] = RefFile()
            self.versions[(self.fs.handles[fh].file.file_id, self.fs.handles[fh].file.version)] = (
                b""
            )
            self._looked_up(name, attr.ino)
            self.handles.append(OpenHandle(fh, attr.ino, ref, True))
            return
        ino = self._lookup(name)
        flags = {"w": os.O_WRONLY | os.O_TRUNC, "rw": os.O_RDWR, "rw-new": os.O_RDWR, "r": 0}[mode]
        try:
            fh, _ = self.h.call(self.fs.open, ino, flags, CALLER, schedule=sched)
        except OSError as exc:
            assert ref.lost and flags & os.O_ACCMODE and not flags & os.O_TRUNC, exc
            assert errno_of(exc) == errno.EIO
            return
        assert not (ref.lost and flags & os.O_ACCMODE and not flags & os.O_TRUNC)
        if flags & os.O_TRUNC:
            ref.data = bytearray()
            ref.lost = False
        self.handles.append(OpenHandle(fh, ino, ref, mode != "r"))

    @precondition(lambda self: any(h.writable for h in self.handles))
    @rule(data=st.data(), off=OFFSETS, size=SIZES, seed=st.integers(0, 1 << 30), sched=SCHED)
    def write(self, data: st.DataObject, off: int, size: int, seed: int, sched: list[int]) -> None:
        STEPS["count"] += 1
        h = data.draw(st.sampled_from([h for h in self.handles if h.writable]))
        if h.ref.lost:
            with pytest.raises(OSError):
                self.h.call(self.fs.write, h.fh, off, rand(size, seed))
            return
        self._write(h, off, size, seed, sched)

    @precondition(lambda self: any(h.writable for h in self.handles))
    @rule(data=st.data(), size=TRUNCS, sched=SCHED)
    def truncate(self, data: st.DataObject, size: int, sched: list[int]) -> None:
        STEPS["count"] += 1
        h = data.draw(st.sampled_from([h for h in self.handles if h.writable]))
        if h.ref.lost and size:
            with pytest.raises(OSError):
                self.h.call(self.fs.setattr, h.ino, SetAttr(size=size), CALLER)
            return
        self.h.call(self.fs.setattr, h.ino, SetAttr(size=size), CALLER, schedule=sched)
        h.ref.lost = False
        if size < len(h.ref.data):
            del h.ref.data[size:]
        else:
            h.ref.data += bytes(size - len(h.ref.data))

    @precondition(lambda self: bool(self.handles))
    @rule(data=st.data(), off=OFFSETS, size=SIZES)
    def read(self, data: st.DataObject, off: int, size: int) -> None:
        STEPS["count"] += 1
        h = data.draw(st.sampled_from(self.handles))
        if h.ref.lost:
            return
        got = self.h.call(self.fs.read, h.fh, off, size)
        assert got == bytes(h.ref.data[off : off + size]), (off, size)

    @precondition(lambda self: bool(self.handles))
    @rule(data=st.data(), off=OFFSETS, size=SIZES)
    def read_now(self, data: st.DataObject, off: int, size: int) -> None:
        """A READ's fast path (answered inline) at whatever point the
        background work stands: it declines, or gives exactly the bytes the
        file has."""
        STEPS["count"] += 1
        h = data.draw(st.sampled_from(self.handles))
        if h.ref.lost:
            return  # (the async read's EIO)
        got = read_now_copied(self.h, h.fh, off, size)
        if got is not None:
            assert got == bytes(h.ref.data[off : off + size]), (off, size)

    @precondition(lambda self: any(h.writable for h in self.handles))
    @rule(data=st.data(), sched=SCHED)
    def fsync(self, data: st.DataObject, sched: list[int]) -> None:
        STEPS["count"] += 1
        h = data.draw(st.sampled_from([h for h in self.handles if h.writable]))
        self.h.call(self.fs.fsync, h.fh, schedule=sched)
        self._record_version(h.ino, h.ref)

    @precondition(lambda self: bool(self.handles))
    @rule(data=st.data(), sched=SCHED)
    def close(self, data: st.DataObject, sched: list[int]) -> None:
        STEPS["count"] += 1
        h = data.draw(st.sampled_from(self.handles))
        self.handles.remove(h)
        self.h.call(self.fs.flush, h.fh, schedule=sched)
        if h.writable:
            self._record_version(h.ino, h.ref)
        self.h.call(self.fs.release, h.fh)
        self._kernel_forgets()

    @rule(name=NAMES, sched=SCHED)
    def unlink(self, name: str, sched: list[int]) -> None:
        STEPS["count"] += 1
        if name not in self.names:
            return
        self.h.call(self.fs.unlink, ROOT, name, schedule=sched)
        del self.names[name]
        self.ino_of.pop(name, None)
        self._kernel_forgets()

    @rule(a=NAMES, b=NAMES, sched=SCHED)
    def rename(self, a: str, b: str, sched: list[int]) -> None:
        STEPS["count"] += 1
        if a not in self.names or a == b:
            return
        self.h.call(self.fs.rename, ROOT, a, ROOT, b, 0, schedule=sched)
        self.names[b] = self.names.pop(a)
        self.ino_of.pop(b, None)
        if a in self.ino_of:
            self.ino_of[b] = self.ino_of.pop(a)
        self._kernel_forgets()

    @rule(steps=st.integers(1, 12))
    def background(self, steps: int) -> None:
        """Let the flusher and spiller take a few steps (each: one backing-store call)."""
        STEPS["count"] += 1
        self.h.direct(self.h.background_steps, steps)

    @rule(name=NAMES, mode=st.sampled_from(["w", "rw"]), writes=WRITES, sched=SCHED)
    def save(
        self, name: str, mode: str, writes: list[tuple[int, int, int]], sched: list[int]
    ) -> None:
        """A whole save (open, writes, close), like one torch.save."""
        STEPS["count"] += 1
        self._held_save(name, mode, writes, sched, keep=False)

    @rule(
        name=NAMES,
        label=LABELS,
        writes=WRITES,
        sched=SCHED.filter(lambda s: bool(s)),
        keep=st.booleans(),
    )
    def rewrite_during_flush(
        self,
        name: str,
        label: str,
        writes: list[tuple[int, int, int]],
        sched: list[int],
        keep: bool,
    ) -> None:
        """Reopen without truncation while background work stands at a named
        await, and write (the race of a write with a flush)."""
        STEPS["count"] += 1
        ref = self.names.get(name)
        if ref is None or ref.lost or len(self.handles) >= 4:
            return
        ino = self._lookup(name)
        fh, _ = self.h.call(self.fs.open, ino, os.O_RDWR, CALLER)
        handle = OpenHandle(fh, ino, ref, True)
        self.handles.append(handle)
        self.h.direct(self.h.background_until, label)
        for off, size, seed in writes:
            self._write(handle, off, size, seed, sched)
        if not keep:
            self.handles.remove(handle)
            self.h.call(self.fs.flush, fh, schedule=sched)
            self._record_version(ino, ref)
            self.h.call(self.fs.release, fh)
            self._kernel_forgets()

    def _held_save(
        self, name: str, mode: str, writes: list[tuple[int, int, int]], sched: list[int], keep: bool
    ) -> None:
        ref = self.names.get(name)
        if ref is not None and ref.lost and mode == "rw":
            return
        if ref is None:
            fh, attr = self.h.call(self.fs.create, ROOT, name, 0o644, os.O_WRONLY, CALLER)
            ref = self.names[name] = RefFile()
            f = self.fs.handles[fh].file
            self.versions[(f.file_id, f.version)] = b""
            ino = attr.ino
            self._looked_up(name, ino)
        else:
            ino = self._lookup(name)
            flags = os.O_WRONLY | os.O_TRUNC if mode == "w" else os.O_RDWR
            fh, _ = self.h.call(self.fs.open, ino, flags, CALLER, schedule=sched)
            if mode == "w":
                ref.data, ref.lost = bytearray(), False
        handle = OpenHandle(fh, ino, ref, True)
        for off, size, seed in writes:
            self._write(handle, off, size, seed, sched)
        if keep:
            self.handles.append(handle)
            return
        self.h.call(self.fs.flush, fh, schedule=sched)
        self._record_version(ino, ref)
        self.h.call(self.fs.release, fh)
        self._kernel_forgets()

    def _write(self, h: OpenHandle, off: int, size: int, seed: int, sched: list[int]) -> None:
        payload = rand(size, seed)
        assert self.h.call(self.fs.write, h.fh, off, payload, schedule=sched) == size
        if off > len(h.ref.data):
            h.ref.data += bytes(off - len(h.ref.data))
        h.ref.data[off : off + size] = payload

    @precondition(lambda self: len(self.walks) < 3)
    @rule(name=NAMES)
    def walk(self, name: str) -> None:
        """A path walk (open, stat, torch.load) resolves a name to its inode."""
        STEPS["count"] += 1
        ref = self.names.get(name)
        if ref is None:
            return
        self.walks.append(Walk(self._lookup(name), ref))

    @precondition(lambda self: bool(self.walks))
    @rule(data=st.data(), sched=SCHED)
    def open_walked(self, data: st.DataObject, sched: list[int]) -> None:
        """The walk opens the inode it resolved, whatever happened to the name
        since (rewritten, unlinked, renamed over): the bytes of that file."""
        STEPS["count"] += 1
        w = data.draw(st.sampled_from(self.walks))
        self.walks.remove(w)
        try:
            fh, _ = self.h.call(self.fs.open, w.ino, os.O_RDONLY, CALLER, schedule=sched)
            try:
                out = bytearray()
                while piece := self.h.call(self.fs.read, fh, len(out), 3 * PS + 11):
                    out += piece
            finally:
                self.h.call(self.fs.release, fh)
        except OSError as exc:
            assert w.ref.lost and errno_of(exc) == errno.EIO, exc
        else:
            assert not w.ref.lost
            assert bytes(out) == bytes(w.ref.data), "a walked inode read other bytes"
        self._kernel_forgets()

    @rule(label=LABELS)
    def background_until(self, label: str) -> None:
        """Run background tasks up to a named await, e.g. the flusher about to
        publish a durable manifest, so the next operation lands right there."""
        STEPS["count"] += 1
        self.h.direct(self.h.background_until, label)

    @rule(sched=SCHED)
    def spill(self, sched: list[int]) -> None:
        STEPS["count"] += 1
        assert self.h.core is not None
        self.h.call(self.h.core.cache.relieve_pressure, schedule=sched)

    @rule()
    def evict(self) -> None:
        STEPS["count"] += 1
        assert self.h.core is not None
        self.h.core.evict("")

    @rule()
    def drain_and_restart(self) -> None:
        """Close everything, wait until all is durable (umount), start cold (mount)."""
        STEPS["count"] += 1
        STEPS["restarts"] += 1
        for h in list(self.handles):
            self.handles.remove(h)
            self.h.call(self.fs.flush, h.fh)
            if h.writable:
                self._record_version(h.ino, h.ref)
            self.h.call(self.fs.release, h.fh)
        assert self.h.core is not None
        result = self.h.call(self.h.core.drain, "", None)
        assert result["ok"], result
        assert self.h.core.all_durable()
        self.h.stop_clean()
        self._kernel_reset()
        self.h.start()
        for name, ref in self.names.items():
            if ref.lost:
                m = self.h.manifests()[name]
                assert m.state == "pending"  # lost and never rewritten

    @rule()
    def crash_and_recover(self) -> None:
        """The daemon dies (SIGKILL) at an arbitrary await; a new one adopts the journal."""
        STEPS["count"] += 1
        STEPS["crashes"] += 1
        assert self.h.core is not None
        cache = self.h.core.cache
        safe = {  # closed, published, unchanged: these must come back
            (f.file_id, f.version)
            for f in cache.all_files()
            if f.state in (FileState.PENDING, FileState.DURABLE)
        }
        self.handles.clear()
        self.h.crash()
        self._kernel_reset()
        self.h.start()
        manifests = self.h.manifests()
        for name, ref in self.names.items():
            m = manifests[name]
            key = (m.file_id, m.version)
            assert key in self.versions, f"{name}: manifest names an unknown version"
            expected = self.versions[key]
            try:
                got = self._read_all(name)
            except OSError as exc:
                assert errno_of(exc) == errno.EIO
                assert m.state == "pending" and key not in safe, f"{name} lost although safe"
                ref.lost = True
                continue
            assert got == expected, f"{name}: wrong bytes after recovery"
            ref.data = bytearray(expected)
            ref.lost = False

    # ----- invariants ---------------------------------------------------------------
    @invariant()
    def names_read_back_their_bytes(self) -> None:
        if not hasattr(self, "h") or self.h.core is None:
            return
        assert sorted(self.names) == sorted(self.h.manifests())
        for name, ref in self.names.items():
            if ref.lost:
                with pytest.raises(OSError) as exc:
                    self._read_all(name)
                assert errno_of(exc.value) == errno.EIO
                continue
            assert self._read_all(name) == bytes(ref.data), name

    @invariant()
    def every_stored_chunk_matches_its_name(self) -> None:
        if hasattr(self, "h"):
            assert not self.h.corrupt_chunks()

    @invariant()
    def cache_is_consistent(self) -> None:
        if hasattr(self, "h") and self.h.core is not None:
            assert not self.h.direct(self._audit), self.h.direct(self._audit)

    async def _audit(self) -> list[str]:
        assert self.h.core is not None
        return audit(self.h.core)

    @invariant()
    def durable_manifests_name_published_bytes(self) -> None:
        if not hasattr(self, "h"):
            return
        for name, m in self.h.manifests().items():
            if m.state == "durable":
                key = (m.file_id, m.version)
                assert key in self.versions, f"{name}: durable manifest of an unknown version"
                assert self.h.reassemble(m) == self.versions[key], f"{name}: wrong durable bytes"


def test_file_lifecycle_model(tmp_path: Path) -> None:
    _TMP[:] = [tmp_path]
    STEPS.update(count=0, restarts=0, crashes=0, examples=0)
    runner = LifecycleModel.TestCase
    runner.settings = settings(
        max_examples=int(os.environ.get("CKPTFS_MODEL_EXAMPLES", "60")),
        stateful_step_count=50,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    runner().runTest()
    assert STEPS["count"] >= 1500, STEPS
    assert STEPS["crashes"] >= 10 and STEPS["restarts"] >= 10, STEPS
