"""Randomized operation sequences give the same results on the mount as on a plain directory.

One mount with a small cache (16 MiB, files up to 6 MiB: writers wait for
space and dirty pages are spilled) serves the whole test; every hypothesis
example works in fresh subdirectories of the mount and of a reference
directory on local disk. Data is random (never periodic, so a misplaced byte
shows). Descriptors opened O_WRONLY and O_RDWR are held open across steps
(written, read, truncated, fsynced, renamed and unlinked under), flushes and
evictions are mixed in, and at the end of every example every file is
compared byte for byte.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from ckptfs.tools.control import request
from data import rand
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

MiB = 1 << 20
NAMES = st.sampled_from(["a", "b", "c", "d.pt", "e.json"])
DIRS = st.sampled_from(["", "x", "x/y", "z"])
SIZES = st.sampled_from([0, 1, 100, 4095, 4096, 65536, MiB - 1, MiB, MiB + 7, 3 * MiB, 6 * MiB - 3])
OFFSETS = st.sampled_from([0, 1, 4096, MiB, MiB - 5, 2 * MiB, 5 * MiB + 11])
STEPS = {"count": 0, "examples": 0}
FLAGS = {
    "w": os.O_WRONLY | os.O_CREAT | os.O_TRUNC,
    "w-keep": os.O_WRONLY | os.O_CREAT,
    "rw": os.O_RDWR | os.O_CREAT,
    "rw-trunc": os.O_RDWR | os.O_CREAT | os.O_TRUNC,
    "r": os.O_RDONLY,
}


def outcome(fn, *args):
    try:
        return ("ok", fn(*args))
    except OSError as exc:
        return ("err", exc.errno)


@dataclass
class Held:
    real: int
    ref: int
    mode: str


class FsModel(RuleBasedStateMachine):
    mount = None  # set by the test

    @initialize()
    def setup(self) -> None:
        self.example = f"ex{STEPS['examples']}"
        STEPS["examples"] += 1
        self.real = self.mount.mnt / self.example
        self.ref = self.mount.root / "reference" / self.example
        self.real.mkdir()
        self.ref.mkdir(parents=True)
        self.held: list[Held] = []

    def both(self, fn, *rel: str):
        STEPS["count"] += 1
        rel = tuple(r.lstrip("/") for r in rel)
        a = outcome(fn, *[self.real / r for r in rel])
        b = outcome(fn, *[self.ref / r for r in rel])
        assert a == b, (fn.__name__, rel, a, b)
        return a

    def on_held(self, h: Held, fn):
        """``fn(fd)`` on both descriptors; same outcome on both sides."""
        STEPS["count"] += 1
        a = outcome(fn, h.real)
        b = outcome(fn, h.ref)
        assert a == b, (fn, h.mode, a, b)
        return a

    # ----- whole-file and path operations ----------------------------------------
    @rule(d=DIRS, name=NAMES, size=SIZES, seed=st.integers(0, 1 << 30))
    def write_file(self, d, name, size, seed):
        data = rand(size, seed)
        self.both(lambda p: p.write_bytes(data), f"{d}/{name}")

    @rule(d=DIRS, seed=st.integers(0, 1 << 30))
    def checkpoint_burst(self, d, seed):
        """Three 6 MiB files at once, more than the cache holds while the store is slow."""
        for i, name in enumerate(("a", "b", "c")):
            data = rand(6 * MiB, seed + i)
            self.both(lambda p, data=data: p.write_bytes(data), f"{d}/{name}")

    @rule(
        d=DIRS,
        name=NAMES,
        off=OFFSETS,
        size=SIZES,
        seed=st.integers(0, 1 << 30),
        mode=st.sampled_from(["w-keep", "rw"]),
    )
    def pwrite(self, d, name, off, size, seed, mode):
        data = rand(size, seed)

        def op(p: Path) -> int:
            fd = os.open(p, FLAGS[mode], 0o644)
            try:
                return os.pwrite(fd, data, off)
            finally:
                os.close(fd)

        self.both(op, f"{d}/{name}")

    @rule(d=DIRS, name=NAMES, size=SIZES)
    def truncate(self, d, name, size):
        self.both(lambda p: os.truncate(p, size), f"{d}/{name}")

    @rule(d=DIRS, name=NAMES, d2=DIRS, name2=NAMES)
    def rename(self, d, name, d2, name2):
        self.both(os.rename, f"{d}/{name}", f"{d2}/{name2}")

    @rule(d=DIRS, name=NAMES)
    def unlink(self, d, name):
        self.both(os.unlink, f"{d}/{name}")

    @rule(d=DIRS)
    def mkdir(self, d):
        if d:
            self.both(os.mkdir, d)

    @rule(d=DIRS)
    def rmdir(self, d):
        if d:
            self.both(os.rmdir, d)

    @rule(d=DIRS, name=NAMES, off=OFFSETS, size=SIZES)
    def read(self, d, name, off, size):
        def op(p: Path) -> bytes:
            with open(p, "rb") as f:
                f.seek(off)
                return f.read(size)

        self.both(op, f"{d}/{name}")

    # ----- descriptors held across steps ----------------------------------------------
    @precondition(lambda self: len(self.held) < 4)
    @rule(d=DIRS, name=NAMES, mode=st.sampled_from(sorted(FLAGS)))
    def open_held(self, d, name, mode):
        rel = f"{d}/{name}".lstrip("/")
        a = outcome(os.open, self.real / rel, FLAGS[mode], 0o644)
        b = outcome(os.open, self.ref / rel, FLAGS[mode], 0o644)
        STEPS["count"] += 1
        assert a[0] == b[0] and (a[0] == "ok" or a == b), (rel, mode, a, b)
        if a[0] == "ok":
            self.held.append(Held(a[1], b[1], mode))

    @precondition(lambda self: any(h.mode != "r" for h in self.held))
    @rule(data=st.data(), off=OFFSETS, size=SIZES, seed=st.integers(0, 1 << 30))
    def held_pwrite(self, data, off, size, seed):
        h = data.draw(st.sampled_from([h for h in self.held if h.mode != "r"]))
        payload = rand(size, seed)
        self.on_held(h, lambda fd: os.pwrite(fd, payload, off))

    @precondition(lambda self: any(h.mode.startswith(("rw", "r")) for h in self.held))
    @rule(data=st.data(), off=OFFSETS, size=SIZES)
    def held_pread(self, data, off, size):
        h = data.draw(st.sampled_from([h for h in self.held if h.mode.startswith(("rw", "r"))]))
        self.on_held(h, lambda fd: os.pread(fd, size, off))

    @precondition(lambda self: any(h.mode != "r" for h in self.held))
    @rule(data=st.data(), size=SIZES)
    def held_ftruncate(self, data, size):
        h = data.draw(st.sampled_from([h for h in self.held if h.mode != "r"]))
        self.on_held(h, lambda fd: os.ftruncate(fd, size))

    @precondition(lambda self: bool(self.held))
    @rule(data=st.data())
    def held_fsync(self, data):
        h = data.draw(st.sampled_from(self.held))
        self.on_held(h, os.fsync)

    @precondition(lambda self: bool(self.held))
    @rule(data=st.data())
    def held_close(self, data):
        h = data.draw(st.sampled_from(self.held))
        self.held.remove(h)
        self.on_held(h, os.close)

    @rule(d=DIRS, name=NAMES, seed=st.integers(0, 1 << 30))
    def unlink_while_open(self, d, name, seed):
        data = rand(70_000, seed)

        def op(p: Path) -> bytes:
            p.write_bytes(data)
            with open(p, "rb") as f:
                os.unlink(p)
                return f.read()

        self.both(op, f"{d}/{name}")

    @rule(evict=st.booleans())
    def flush_and_evict(self, evict):
        STEPS["count"] += 1
        reply = request(
            self.mount.mnt,
            {"op": "flush", "path": self.example, "wait": True, "timeout": 60},
            timeout=90,
        )
        # Files held open for writing are committed too; all of it becomes durable.
        assert reply["ok"], reply
        if evict:
            assert request(self.mount.mnt, {"op": "evict", "path": self.example})["ok"]

    # ----- checks -------------------------------------------------------------------
    @invariant()
    def same_tree(self):
        if not hasattr(self, "real"):
            return
        for dirpath, dirnames, filenames in os.walk(self.ref):
            rel = Path(dirpath).relative_to(self.ref)
            real_dir = self.real / rel
            assert sorted(os.listdir(real_dir)) == sorted(dirnames + filenames), rel
            for name in filenames:
                assert (real_dir / name).stat().st_size == (Path(dirpath) / name).stat().st_size

    def same_contents(self) -> None:
        for dirpath, _, filenames in os.walk(self.ref):
            rel = Path(dirpath).relative_to(self.ref)
            for name in filenames:
                expected = (Path(dirpath) / name).read_bytes()
                assert (self.real / rel / name).read_bytes() == expected, rel / name

    def teardown(self):
        if not hasattr(self, "real"):
            return
        for h in self.held:
            os.close(h.real)
            os.close(h.ref)
        self.same_contents()
        for p in (self.real, self.ref):
            shutil.rmtree(p, ignore_errors=False)


def test_random_operations_match_a_plain_directory(mounts, monkeypatch):
    m = mounts()
    # A slow store (16 MiB/s): bytes that are not durable pile up past the cache.
    m.mount(cache_size="16MiB", env={"CKPTFS_FLUSH_BANDWIDTH": "16MiB"})
    m.allowed_log = ["backpressure", "has waited"]
    monkeypatch.setenv("CKPTFS_RUN_DIR", str(m.run_dir))
    FsModel.mount = m
    STEPS.update(count=0, examples=0)
    runner = FsModel.TestCase
    runner.settings = settings(
        max_examples=24,
        stateful_step_count=110,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    # Hypothesis shrinks and stops early at random, so one run's step count varies
    # (1844 in one CI run); more runs, each with new random examples, make up the floor.
    for _ in range(4):
        runner().runTest()
        if STEPS["count"] >= 2000:
            break
    assert STEPS["count"] >= 2000, STEPS
    assert os.listdir(m.mnt) == []
    s = m.stat()
    assert s["cache"]["backpressure_events"] > 0 and s["cache"]["spilled_bytes"] > 0, s["cache"]
