"""Randomized operation sequences give the same results on the mount as on a plain directory.

One mount serves the whole test; every hypothesis example works in fresh
subdirectories of the mount and of a reference directory. Flushes and
evictions are mixed in, so reads come from RAM, from chunks in the backing
store, and from partially re-cached pages.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from ckptfs.tools.control import request
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

NAMES = st.sampled_from(["a", "b", "c", "d.pt", "e.json"])
DIRS = st.sampled_from(["", "x", "x/y", "z"])
SIZES = st.sampled_from(
    [0, 1, 100, 4095, 4096, 65536, (1 << 20) - 1, 1 << 20, (1 << 20) + 7, 3 << 20]
)
OFFSETS = st.sampled_from([0, 1, 4096, 1 << 20, (1 << 20) - 5, 2 << 20, 5 << 20])
STEPS = {"count": 0}


def outcome(fn, *args):
    try:
        return ("ok", fn(*args))
    except OSError as exc:
        return ("err", exc.errno)


def blob(seed: int, size: int) -> bytes:
    return (seed.to_bytes(4, "little") * (size // 4 + 1))[:size]


class FsModel(RuleBasedStateMachine):
    mount = None  # set by the test

    @initialize()
    def setup(self) -> None:
        STEPS["count"] += 0
        self.example = f"ex{STEPS.setdefault('examples', 0)}"
        STEPS["examples"] += 1
        self.real = self.mount.mnt / self.example
        self.ref = self.mount.root / "reference" / self.example
        self.real.mkdir()
        self.ref.mkdir(parents=True)

    def both(self, fn, *rel: str):
        STEPS["count"] += 1
        rel = tuple(r.lstrip("/") for r in rel)
        a = outcome(fn, *[self.real / r for r in rel])
        b = outcome(fn, *[self.ref / r for r in rel])
        assert a == b, (fn.__name__, rel, a, b)
        return a

    @rule(d=DIRS, name=NAMES, size=SIZES, seed=st.integers(0, 1 << 30))
    def write_file(self, d, name, size, seed):
        data = blob(seed, size)
        self.both(lambda p: p.write_bytes(data), f"{d}/{name}")

    @rule(d=DIRS, name=NAMES, off=OFFSETS, size=SIZES, seed=st.integers(0, 1 << 30))
    def pwrite(self, d, name, off, size, seed):
        data = blob(seed, size)

        def op(p: Path) -> int:
            fd = os.open(p, os.O_WRONLY | os.O_CREAT, 0o644)
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

    @rule(d=DIRS, name=NAMES, seed=st.integers(0, 1 << 30))
    def unlink_while_open(self, d, name, seed):
        data = blob(seed, 70_000)

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
        assert reply["ok"], reply
        if evict:
            assert request(self.mount.mnt, {"op": "evict", "path": self.example})["ok"]

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

    def teardown(self):
        if hasattr(self, "real"):
            for p in (self.real, self.ref):
                shutil.rmtree(p, ignore_errors=False)


def test_random_operations_match_a_plain_directory(mounted, monkeypatch):
    monkeypatch.setenv("CKPTFS_RUN_DIR", str(mounted.run_dir))
    FsModel.mount = mounted
    STEPS["count"] = 0
    runner = FsModel.TestCase
    runner.settings = settings(
        max_examples=14,
        stateful_step_count=50,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    runner().runTest()
    assert STEPS["count"] >= 500, STEPS
    assert os.listdir(mounted.mnt) == []
