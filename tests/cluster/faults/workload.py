"""The trials' workload: writers on several nodes at once, readers on others,
and an operator's ``ckptfs flush`` and ``evict`` at random moments.

Each actor is a thread bound to nodes; it tells the oracle about every
operation before it starts and when it ends, and checks every read whole.
Every operation runs through :meth:`Workload.op`, which records it as in
flight: the trial calls one that is still running :data:`OP_BOUND` seconds
after it began a hang. Data is random bytes from a per-actor generator
seeded from the trial's seed, never periodic.
"""

from __future__ import annotations

import errno
import os
import random
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from ckptfs.fs.store.manifest import ManifestError, read_manifest

from .cluster import Cluster
from .oracle import ABSENT, Oracle, digest

T = TypeVar("T")
# No workload operation may take longer than this (seconds): longer than any
# fault lasts (at most 6 s) plus the peers' timeout and a daemon's restart.
OP_BOUND = 30.0
MiB = 1 << 20


class EventLog:
    """The trial's events, with their times since the trial began."""

    def __init__(self) -> None:
        self.t0 = time.monotonic()
        self.lines: list[str] = []
        self._lock = threading.Lock()

    def add(self, text: str) -> None:
        with self._lock:
            self.lines.append(f"{time.monotonic() - self.t0:8.3f} {text}")


@dataclass
class InFlight:
    node: str
    what: str
    t0: float


@dataclass
class Workload:
    cluster: Cluster
    oracle: Oracle
    log: EventLog
    top: str  # the trial's directory, relative to every mount
    seed: str
    until: float  # no operation starts after this (monotonic)
    inflight: dict[int, InFlight] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)  # operations that failed (not failures)
    counts: dict[str, int] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def names(self) -> list[str]:
        return self.cluster.names

    def rng(self, actor: str) -> random.Random:
        return random.Random(f"{self.seed}:{actor}")

    def mnt(self, node: str) -> Path:
        return self.cluster.nodes[node].mnt

    def going(self) -> bool:
        return time.monotonic() < self.until

    # ----- one bounded, recorded operation ----------------------------------------------
    def op(self, node: str, what: str, fn: Callable[[], T]) -> tuple[bool, str, T | None]:
        """Run ``fn`` as one operation on ``node``: (ok, errno name, result)."""
        key = threading.get_ident()
        with self._lock:
            self.inflight[key] = InFlight(node, what, time.monotonic())
            self.counts[what.split()[0]] = self.counts.get(what.split()[0], 0) + 1
        try:
            return True, "", fn()
        except OSError as exc:
            name = errno.errorcode.get(exc.errno or 0, str(exc))
            with self._lock:
                self.errors.append(f"{what} on {node}: {name}")
            self.log.add(f"{node}: {what}: {name}")
            return False, name, None
        finally:
            with self._lock:
                self.inflight.pop(key, None)

    def overdue(self) -> list[str]:
        now = time.monotonic()
        with self._lock:
            return [
                f"HANG: {f.what} on {f.node} running for {now - f.t0:.1f}s (bound {OP_BOUND:g}s)"
                for f in self.inflight.values()
                if now - f.t0 > OP_BOUND
            ]

    # ----- files ----------------------------------------------------------------------
    def data(self, rng: random.Random) -> bytes:
        size = rng.choice(
            [0, rng.randint(1, 4096), rng.randint(4097, 300_000), rng.randint(300_001, 2 * MiB)]
        )
        return rng.randbytes(size)

    def holders(self, rel: str, size: int) -> tuple[str, ...] | None:
        """The holders the manifest at ``rel`` names now, read from the real
        store behind the stand-in (if it is the size just written)."""
        assert self.cluster.store is not None
        try:
            m = read_manifest(self.cluster.store.real / rel)
        except (OSError, ManifestError):
            return None
        return tuple(m.holders) if m is not None and m.size == size else None

    def write(self, node: str, rel: str, data: bytes, rng: random.Random) -> bool | None:
        """Write ``rel`` in place (truncating) through ``node``, in pieces of
        random sizes: whether it worked, None if ``node`` was down (not tried)."""
        gate = self.cluster.nodes[node].gate
        with gate.use() as up:
            if not up:
                return None
            op = self.oracle.begin("write", rel, node, digest(data), data=data)

            def run() -> None:
                with open(self.mnt(node) / rel, "wb") as f:
                    view, pos = memoryview(data), 0
                    while pos < len(data):
                        step = rng.randint(1, 1 << 20)
                        f.write(view[pos : pos + step])
                        pos += step

            ok, error, _ = self.op(node, f"write {rel} ({len(data)} B)", run)
            self.oracle.end(op, ok, error, self.holders(rel, len(data)) if ok else None)
            return ok

    def rename(self, node: str, old: str, new: str, kind: str, files: list[str]) -> bool:
        """``os.replace(old, new)`` through ``node``; ``files`` are the paths
        under ``old`` that it moves (``[old]`` for a file)."""
        gate = self.cluster.nodes[node].gate
        with gate.use() as up:
            if not up:
                return False
            pairs = [self.oracle.rename(f, new + f[len(old) :], node, kind) for f in files]
            ok, error, _ = self.op(
                node,
                f"{kind} {old} -> {new}",
                lambda: os.replace(self.mnt(node) / old, self.mnt(node) / new),
            )
            for a, b in pairs:
                self.oracle.end(a, ok, error)
                self.oracle.end(b, ok, error)
            return ok

    def remove_tree(self, node: str, rel: str, files: list[str]) -> None:
        gate = self.cluster.nodes[node].gate
        with gate.use() as up:
            if not up:
                return
            ops = [self.oracle.begin("unlink", f, node, ABSENT) for f in files]
            ok, error, _ = self.op(
                node, f"rmtree {rel}", lambda: shutil.rmtree(self.mnt(node) / rel)
            )
            for op in ops:
                self.oracle.end(op, ok, error)

    def read(self, node: str, rel: str) -> None:
        gate = self.cluster.nodes[node].gate
        with gate.use() as up:
            if not up:
                return
            ok, _, data = self.op(node, f"read {rel}", lambda: (self.mnt(node) / rel).read_bytes())
            # Judged only if no write in place began on this node meanwhile
            # (the reader chose the node before it did): a node's own
            # writer's bytes show before its close. Such nodes only ever
            # join, so still readable now means readable all along.
            if ok and data is not None and self.oracle.readable_on(rel, node):
                failure = self.oracle.check_read(rel, data, node)
                if failure:
                    self.log.add(failure)

    def mkdir(self, node: str, rel: str) -> bool:
        gate = self.cluster.nodes[node].gate
        with gate.use() as up:
            if not up:
                return False
            ok, _, _ = self.op(node, f"mkdir {rel}", lambda: os.mkdir(self.mnt(node) / rel))
            return ok

    # ----- actors -----------------------------------------------------------------------
    def pause(self, rng: random.Random, most: float = 0.05) -> None:
        time.sleep(rng.uniform(0, most))

    def rewriter(self, node: str, rel: str, actor: str) -> None:
        """Rewrites ``rel`` in place, again and again (another node does too)."""
        rng = self.rng(actor)
        while self.going():
            self.write(node, rel, self.data(rng), rng)
            self.pause(rng)

    def replacer(self, node: str, rel: str, actor: str) -> None:
        """torch.save's way: a temporary name, then ``os.replace`` over ``rel``."""
        rng = self.rng(actor)
        tmp = f"{rel}.tmp.{node}"
        while self.going():
            if self.write(node, tmp, self.data(rng), rng):
                self.rename(node, tmp, rel, "replace", [tmp])
            self.pause(rng)

    def megatron(self, actor: str) -> None:
        """Megatron's checkpoints: ranks on every node write their shards into
        ``iter_N.tmp``, one node renames it to ``iter_N`` and replaces the
        tracker file; checkpoints two back are removed."""
        rng = self.rng(actor)
        done: list[tuple[str, list[str]]] = []
        it = 0
        while self.going():
            it += 1
            tmp, final = f"{self.top}/iter_{it:03d}.tmp", f"{self.top}/iter_{it:03d}"
            if not self.mkdir(rng.choice(self.names), tmp):
                self.pause(rng, 0.2)
                continue
            shards = []
            for rank in range(rng.randint(2, len(self.names) + 1)):
                node = self.names[(it + rank) % len(self.names)]
                shard = f"{tmp}/shard_{rank}.pt"
                if self.write(node, shard, self.data(rng), rng) is not None:
                    shards.append(shard)
            renamer = rng.choice(self.names)
            if self.rename(renamer, tmp, final, "rename", shards):
                moved = [final + s[len(tmp) :] for s in shards]
                done.append((final, moved))
                tracker = f"{self.top}/latest.txt"
                if self.write(renamer, f"{tracker}.tmp.{renamer}", str(it).encode(), rng):
                    self.rename(renamer, f"{tracker}.tmp.{renamer}", tracker, "replace",
                                [f"{tracker}.tmp.{renamer}"])  # fmt: skip
            if len(done) > 2:
                old, files = done.pop(0)
                self.remove_tree(rng.choice(self.names), old, files)

    def reader(self, actor: str) -> None:
        rng = self.rng(actor)
        while self.going():
            paths = self.oracle.paths()
            if paths:
                rel = rng.choice(paths)
                nodes = [n for n in self.names if self.oracle.readable_on(rel, n)]
                if nodes:
                    self.read(rng.choice(nodes), rel)
            self.pause(rng)

    def operator(self, actor: str) -> None:
        """``ckptfs flush``, ``flush --wait`` and ``evict`` at random moments."""
        rng = self.rng(actor)
        while True:
            time.sleep(rng.uniform(0.2, 1.0))
            if not self.going():
                return
            node = rng.choice(self.names)
            if self.cluster.nodes[node].gate.state != "up":
                continue
            where = str(self.mnt(node) / self.top)
            args: list[str] = rng.choice(
                [["flush", where], ["flush", where, "--wait", "--timeout", "10"], ["evict", where]]
            )
            code, out = self.cluster.cli(node, *args, timeout=OP_BOUND)
            self.log.add(f"{node}: ckptfs {' '.join(args[:1] + args[2:])}: {code} "
                         f"{out.strip().splitlines()[-1] if out.strip() else ''}")  # fmt: skip
            if code == -1:
                with self._lock:
                    self.errors.append(f"HANG: ckptfs {args[0]} on {node}: {out}")

    def actors(self) -> list[tuple[str, Callable[..., Any], tuple[Any, ...]]]:
        """(name, function, args) of every actor of one trial."""
        n = self.names
        rng = self.rng("cast")
        a, b = rng.sample(n, 2)
        c = rng.choice([x for x in n if x not in (a, b)] or n)
        shared, model = f"{self.top}/shared.bin", f"{self.top}/model.pt"
        return [
            ("rewriter-a", self.rewriter, (a, shared, "rewriter-a")),
            ("rewriter-b", self.rewriter, (b, shared, "rewriter-b")),
            ("replacer-a", self.replacer, (c, model, "replacer-a")),
            ("replacer-b", self.replacer, (a, model, "replacer-b")),
            ("megatron", self.megatron, ("megatron",)),
            ("reader-1", self.reader, ("reader-1",)),
            ("reader-2", self.reader, ("reader-2",)),
            ("operator", self.operator, ("operator",)),
        ]
