"""Flush drain rate and interference: ckptfs's flusher against the backing disk's own speed.

    python -m ckptfs.tools.bench.bench_flush [--size-gib 2] [--runs 3] [--capped-runs 1]
                                             [--workers 1,2,4] [--bandwidths 0,200MiB,100MiB]
                                             [--parts disk,store,flush] [--workdir DIR]

Everything lives under --workdir on the local disk (default under /var/tmp):
the backing directory of a ckptfs mount of its own (own run and cache
directories, RAM cache in /dev/shm) and the plain files of the disk baselines.
Every file is --size-gib of random bytes (numpy, not a repeating pattern),
stamped with a per-write counter every 64 KiB so that no chunk deduplicates
against an earlier write.

- disk: the backing disk's own rate, --runs times in rotated order: one file
  written in 4 MiB pieces then fsync (file and directory), the reference; the
  same with O_DIRECT (the device without the page cache); and the same bytes
  as 4 MiB chunk files through ``ChunkStore.put`` (hash, write, fsync,
  rename, directory fsync: what the flusher does per chunk) from 1 thread and
  from 4 threads. CPU seconds per GiB are this process's utime + stime.
- store (not in the default --parts): chunk-file writes ckptfs does not do
  today, to size proposals: buffered or O_DIRECT, fsyncs per chunk or all at
  the end of the file (every file, then every directory), 1 or 4 threads; and
  16 MiB chunk files through ``ChunkStore.put``.
- flush: for every flush.workers x flush.bandwidth (set through
  CKPTFS_FLUSH_WORKERS and CKPTFS_FLUSH_BANDWIDTH, one mount each, durability
  local), --runs times (--capped-runs with a bandwidth cap): the file is
  written through the mount, then the time from close to durable (``flush
  --wait`` on the control socket, no CLI process) is measured twice, alone
  and while a 1-thread CPU "training loop" (torch: a matmul and an SGD-like
  update of --train-params-mib of parameters, in its own process) runs. The
  loop's steps/s while the flush drains is compared with its steps/s alone,
  measured for --train-seconds before the write and again after the drain.
  With an unlimited bandwidth every run also writes the plain file + fsync
  beside the drains, and the drain rate is reported against those paired
  runs as well. The daemon's CPU seconds per GiB flushed come from /proc/<pid>/stat (utime +
  stime, all threads; the pid from the run directory's .pid file).

The training loop is stopped (SIGSTOP) except while it is measured, and the
write through the mount happens with it stopped, as a synchronous checkpoint
save does. Before every timed step the page cache is dropped (and, with
--rewarm-gib, memory touched and freed). It prints measured numbers; it
asserts no thresholds.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import shutil
import signal
import statistics
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from ckptfs.fs.config import parse_size
from ckptfs.fs.daemon.preflight import run_files
from ckptfs.fs.store.chunkstore import ChunkStore, chunk_hash
from ckptfs.tools.bench.benchlib import (
    GIB,
    MIB,
    BenchError,
    Layout,
    Rewarm,
    cpu_busy_s,
    drop_page_cache,
    fsync_path,
    machine,
    markdown_lines,
    meminfo,
    mount,
    print_lines,
    process_cpu_s,
    run_mounted,
    safety_margin,
    stat_json,
    table_lines,
    unmount,
)
from ckptfs.tools.control import exchange

PIECE = 4 * MIB  # write size of the plain-file baseline and of writes into the mount
CHUNK = 4 * MIB  # the chunk store's default chunk_size
STAMP_EVERY = 64 << 10  # a per-write counter every this many bytes: nothing dedups
DRAIN_TIMEOUT = 900.0
ONE_FILE = "one file, 4 MiB writes, fsync"  # the reference: the disk's own rate

# The training loop, in its own process: one thread, a matmul and an SGD-like
# update per step; the step count is published in an 8-byte shared counter.
TRAINER = r"""
import mmap, os, struct, sys
import torch
torch.set_num_threads(1)
torch.set_num_interop_threads(1)
n_mat, n_param = int(sys.argv[2]), int(sys.argv[3])
fd = os.open(sys.argv[1], os.O_RDWR)
counter = mmap.mmap(fd, 8)
a, b = torch.randn(n_mat, n_mat), torch.randn(n_mat, n_mat)
p, g = torch.randn(max(1, n_param)), torch.randn(max(1, n_param))
for _ in range(5):
    a @ b
print("ready", flush=True)
steps = 0
while True:
    c = a @ b
    p.add_(g, alpha=-1e-3)
    steps += 1
    struct.pack_into("Q", counter, 0, steps)
"""


# ----- helpers -----------------------------------------------------------------------------


def cpu_seconds() -> float:
    """This process's utime + stime so far (all threads)."""
    t = os.times()
    return t.user + t.system


def process_memory(pid: int) -> dict[str, int]:
    out: dict[str, int] = {}
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssAnon"):
                out[key] = int(value.split()[0]) * 1024
    return out


_LIBC = ctypes.CDLL(None, use_errno=True)
_LIBC.sync_file_range.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
SYNC_FILE_RANGE_WRITE = 2


def sync_file_range_write(fd: int, length: int) -> None:
    """Start writeback of the first ``length`` bytes of ``fd`` without waiting."""
    if _LIBC.sync_file_range(fd, 0, length, SYNC_FILE_RANGE_WRITE) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def fsync_dir(path: Path) -> None:
    fsync_path(path, directory=True)


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def fmt(value: float, spec: str) -> str:
    return "-" if value != value else format(value, spec)  # NaN: not measured


def size_label(rate: int) -> str:
    return "unlimited" if not rate else f"{rate / MIB:g} MiB/s"


# ----- the bytes -----------------------------------------------------------------------------


class Payload:
    """``size`` random bytes, re-stamped before every write so that no chunk of
    one write equals a chunk of another (the stamps are 64 KiB apart, so they
    differ whatever the chunk boundaries)."""

    def __init__(self, size: int, seed: int = 0) -> None:
        words = -(-size // 8)
        rng = np.random.default_rng(seed)
        # Page-aligned (an anonymous mapping), as O_DIRECT writes need.
        self.buffer = mmap.mmap(-1, words * 8)
        self.array = np.frombuffer(self.buffer, dtype=np.int64)
        block = 8 * MIB
        for start in range(0, words, block):
            stop = min(words, start + block)
            self.array[start:stop] = rng.integers(0, 2**63, size=stop - start, dtype=np.int64)
        self.size = size
        self.view = memoryview(self.array).cast("B")[:size]
        self.writes = 0
        self._stamps = self.array[:: STAMP_EVERY // 8]

    def stamp(self) -> memoryview:
        self.writes += 1
        self._stamps[:] = np.arange(len(self._stamps), dtype=np.int64) + (self.writes << 40)
        return self.view


def write_fd(fd: int, data: memoryview, piece: int = PIECE) -> None:
    pos = 0
    while pos < len(data):
        pos += os.write(fd, data[pos : pos + piece])


# ----- disk and store baselines ------------------------------------------------------------


def disk_sequential(directory: Path, data: memoryview, direct: bool = False) -> None:
    """One file in 4 MiB writes (``direct``: O_DIRECT, from the page-aligned
    buffer), then fsync of the file and of its directory."""
    path = directory / f"seq-{time.monotonic_ns()}"
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0)
    fd = os.open(path, flags, 0o644)
    try:
        write_fd(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    fsync_dir(directory)


def chunk_ranges(size: int, chunk: int) -> list[tuple[int, int]]:
    return [(off, min(chunk, size - off)) for off in range(0, size, chunk)]


def in_threads(
    ranges: list[tuple[int, int]], threads: int, work: Callable[[int, int], None]
) -> None:
    """``work(off, length)`` for every range, from ``threads`` threads (1: inline)."""
    if threads <= 1:
        for off, length in ranges:
            work(off, length)
        return
    lock = threading.Lock()
    todo = iter(ranges)
    errors: list[BaseException] = []

    def loop() -> None:
        while True:
            with lock:
                item = next(todo, None)
            if item is None or errors:
                return
            try:
                work(*item)
            except BaseException as exc:
                errors.append(exc)
                return

    pool = [threading.Thread(target=loop) for _ in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    if errors:
        raise errors[0]


def store_put(store_dir: Path, data: memoryview, threads: int, chunk: int = CHUNK) -> None:
    """The flusher's store path without the daemon: hash + ChunkStore.put per chunk."""
    store = ChunkStore(store_dir)

    def put(off: int, length: int) -> None:
        piece = data[off : off + length]
        store.put(chunk_hash(piece), [piece])

    in_threads(chunk_ranges(len(data), chunk), threads, put)


def store_variant(
    store_dir: Path,
    data: memoryview,
    threads: int,
    *,
    direct: bool,
    deferred: bool,
    chunk: int = CHUNK,
) -> None:
    """Chunk files as ChunkStore.put lays them out (hash-named, two directory
    levels, written under a temporary name and renamed), written either with
    O_DIRECT straight from the page-aligned buffer (``direct``: no copy into
    the page cache) or buffered; and either fsynced one by one as put() does
    (file, then its directory) or, with ``deferred``, all at the end: every
    file, then every directory, which is all a manifest published after the
    last chunk needs."""
    store = ChunkStore(store_dir)
    finals: list[Path] = []
    lock = threading.Lock()
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | (os.O_DIRECT if direct else 0)

    def put(off: int, length: int) -> None:
        piece = data[off : off + length]
        final = store.path_for(chunk_hash(piece))
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.with_name(final.name + ".tmp")
        fd = os.open(tmp, flags, 0o444)
        try:
            write_fd(fd, piece, len(piece))  # lengths are whole pages here
            if not deferred:
                os.fdatasync(fd)
            elif not direct:
                # Start writeback now, so that the fsyncs at the end find the
                # pages on their way to the disk (no wait here).
                sync_file_range_write(fd, length)
        finally:
            os.close(fd)
        os.rename(tmp, final)
        if not deferred:
            fsync_dir(final.parent)
        with lock:
            finals.append(final)

    in_threads(chunk_ranges(len(data), chunk), threads, put)
    if not deferred:
        return
    for final in finals:
        fd = os.open(final, os.O_RDONLY | os.O_CLOEXEC)
        try:
            os.fdatasync(fd)
        finally:
            os.close(fd)
    for parent in dict.fromkeys(f.parent for f in finals):
        fsync_dir(parent)
    for parent in dict.fromkeys(f.parent.parent for f in finals):
        fsync_dir(parent)


@dataclass
class Step:
    label: str
    fn: Callable[[Path, memoryview], None]
    seconds: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)  # this process's CPU seconds


def disk_steps(parts: list[str]) -> list[Step]:
    steps = []
    if "disk" in parts:
        steps += [
            Step(ONE_FILE, lambda d, b: disk_sequential(d, b)),
            Step(
                "one file, O_DIRECT 4 MiB writes, fsync", lambda d, b: disk_sequential(d, b, True)
            ),
            Step("4 MiB chunk files, ChunkStore.put, 1 thread", lambda d, b: store_put(d, b, 1)),
            Step("4 MiB chunk files, ChunkStore.put, 4 threads", lambda d, b: store_put(d, b, 4)),
        ]
    if "store" in parts:
        for threads in (1, 4):
            steps += [
                Step(
                    f"4 MiB chunk files, buffered, fsyncs at the end, {threads} thread(s)",
                    lambda d, b, t=threads: store_variant(d, b, t, direct=False, deferred=True),
                ),
                Step(
                    f"4 MiB chunk files, O_DIRECT, fsyncs per chunk, {threads} thread(s)",
                    lambda d, b, t=threads: store_variant(d, b, t, direct=True, deferred=False),
                ),
                Step(
                    f"4 MiB chunk files, O_DIRECT, fsyncs at the end, {threads} thread(s)",
                    lambda d, b, t=threads: store_variant(d, b, t, direct=True, deferred=True),
                ),
            ]
        steps.append(
            Step(
                "16 MiB chunk files, ChunkStore.put, 1 thread",
                lambda d, b: store_put(d, b, 1, 16 * MIB),
            )
        )
    return steps


# ----- the training loop ---------------------------------------------------------------------


@dataclass
class Window:
    """The training loop over one stretch of time."""

    steps: int
    seconds: float
    other_cpu: float  # CPU seconds of the machine outside the loop and the daemon

    def __add__(self, other: Window) -> Window:
        return Window(
            self.steps + other.steps,
            self.seconds + other.seconds,
            self.other_cpu + other.other_cpu,
        )

    @property
    def rate(self) -> float:
        return self.steps / self.seconds

    @property
    def other_cores(self) -> float:
        return self.other_cpu / self.seconds


class Trainer:
    """The 1-thread training loop in its own process, stopped unless measured."""

    def __init__(self, counter_path: Path, n_mat: int, n_param: int) -> None:
        counter_path.write_bytes(bytes(8))
        fd = os.open(counter_path, os.O_RDWR)
        try:
            self.counter = mmap.mmap(fd, 8)
        finally:
            os.close(fd)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, "-c", TRAINER, str(counter_path), str(n_mat), str(n_param)],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        assert self.proc.stdout is not None
        if self.proc.stdout.readline().strip() != "ready":
            self.close()
            raise BenchError("the training loop process did not start")
        self.stop()

    def steps(self) -> int:
        return int(struct.unpack_from("Q", self.counter, 0)[0])

    def stop(self) -> None:
        os.kill(self.proc.pid, signal.SIGSTOP)

    def cont(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)

    @contextmanager
    def running(self, daemon: int) -> Iterator[Callable[[], Window]]:
        """Let the loop run; the yielded function returns the window so far."""
        busy0, mine0, daemon0 = cpu_busy_s(), process_cpu_s(self.proc.pid), process_cpu_s(daemon)
        n0, t0 = self.steps(), time.perf_counter()

        def sofar() -> Window:
            n, t = self.steps() - n0, time.perf_counter() - t0
            busy = cpu_busy_s() - busy0
            own = process_cpu_s(self.proc.pid) - mine0 + process_cpu_s(daemon) - daemon0
            return Window(n, t, busy - own)

        self.cont()
        try:
            yield sofar
        finally:
            self.stop()

    def alone(self, seconds: float, daemon: int) -> Window:
        with self.running(daemon) as sofar:
            time.sleep(seconds)
            return sofar()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()  # SIGKILL ends a stopped process too
            self.proc.wait()
        self.counter.close()


# ----- ckptfs --------------------------------------------------------------------------------


@dataclass
class Drain:
    seconds: float
    daemon_cpu: float  # daemon utime + stime over the drain
    stored: int  # growth of flush.bytes_stored
    anon: int  # daemon RssAnon right after
    alone: Window | None = None  # the training loop, alone (before + after) and flushing
    flushing: Window | None = None


@dataclass
class Cell:
    workers: int
    bandwidth: int
    alone: list[Drain] = field(default_factory=list)
    training: list[Drain] = field(default_factory=list)
    disk: list[float] = field(default_factory=list)  # paired plain file + fsync seconds
    hash_throughput: float = 0.0


class Mounted:
    def __init__(self, layout: Layout, cache_size: str) -> None:
        self.layout = layout
        self.cache_size = cache_size
        self.pid = 0

    def mount(self, workers: int, bandwidth: int) -> None:
        os.environ["CKPTFS_FLUSH_WORKERS"] = str(workers)
        os.environ["CKPTFS_FLUSH_BANDWIDTH"] = str(bandwidth)
        os.environ["CKPTFS_DURABILITY"] = "local"
        try:
            mount(self.layout, self.cache_size, None)
        finally:
            for key in ("CKPTFS_FLUSH_WORKERS", "CKPTFS_FLUSH_BANDWIDTH", "CKPTFS_DURABILITY"):
                os.environ.pop(key, None)
        pids = sorted(self.layout.run_dir.glob("*.pid"))
        if len(pids) != 1:
            raise BenchError(f"expected one .pid file in {self.layout.run_dir}, found {pids}")
        self.pid = int(pids[0].read_text().strip())
        status = self.status()
        if status.get("durability") != "local" or status["flush"]["bandwidth_cap"] != bandwidth:
            raise BenchError(f"the mount did not take the settings: {status['flush']}")

    def status(self) -> dict[str, Any]:
        return stat_json(self.layout, self.layout.mountpoint)

    def unmount_and_clear(self) -> None:
        unmount(self.layout)
        # The chunks of this mount's runs are of no further use: a new mount
        # starts on an empty backing directory.
        shutil.rmtree(self.layout.backing, ignore_errors=True)
        self.layout.backing.mkdir()

    def drain(self, name: str) -> None:
        """Wait on the control socket until everything under ``name`` is durable."""
        sock, _, _ = run_files(self.layout.run_dir, self.layout.mountpoint)
        payload = {"op": "flush", "path": name, "wait": True, "timeout": DRAIN_TIMEOUT}
        try:
            reply = json.loads(exchange(sock, payload, DRAIN_TIMEOUT + 30) or b"{}")
        except (OSError, ValueError) as exc:
            raise BenchError(f"flush --wait of {name}: {exc}") from None
        if not reply.get("ok"):
            raise BenchError(f"flush --wait of {name} failed: {reply}")

    def write_and_drain(
        self, data: memoryview, name: str, trainer: Trainer | None, train_seconds: float
    ) -> Drain:
        """Write ``name`` through the mount, then time close -> durable; with a
        trainer, its steps/s alone (before the write and after the drain) and
        while the flush drains."""
        path = self.layout.mountpoint / name
        alone = trainer.alone(train_seconds, self.pid) if trainer is not None else None
        before = self.status()["flush"]["bytes_stored"]
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            write_fd(fd, data)
        finally:
            os.close(fd)
        cpu0, t0 = process_cpu_s(self.pid), time.perf_counter()
        flushing = None
        if trainer is None:
            self.drain(name)
        else:
            with trainer.running(self.pid) as sofar:
                self.drain(name)
                flushing = sofar()
        seconds = time.perf_counter() - t0
        cpu = process_cpu_s(self.pid) - cpu0
        anon = process_memory(self.pid).get("RssAnon", 0)
        if trainer is not None and alone is not None:
            alone = alone + trainer.alone(train_seconds, self.pid)
        stored = self.status()["flush"]["bytes_stored"] - before
        path.unlink()  # frees the cache for the next run; the chunks stay on disk
        return Drain(seconds, cpu, stored, anon, alone, flushing)


# ----- the benchmark --------------------------------------------------------------------------


@dataclass
class Bench:
    args: argparse.Namespace
    layout: Layout
    payload: Payload
    rewarm: Rewarm
    steps: list[Step] = field(default_factory=list)
    cells: list[Cell] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def prepare(self) -> None:
        drop_page_cache("1")
        self.rewarm()

    def plain_dir(self, label: str) -> Path:
        d = self.layout.disk / label
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
        return d

    def run_step(self, step: Step) -> None:
        target = self.plain_dir("step")
        data = self.payload.stamp()
        self.prepare()
        c0, t0 = cpu_seconds(), time.perf_counter()
        step.fn(target, data)
        step.seconds.append(time.perf_counter() - t0)
        step.cpu.append(cpu_seconds() - c0)
        shutil.rmtree(target)

    def paired_disk(self) -> float:
        target = self.plain_dir("paired")
        data = self.payload.stamp()
        self.prepare()
        t0 = time.perf_counter()
        disk_sequential(target, data)
        seconds = time.perf_counter() - t0
        shutil.rmtree(target)
        return seconds


def run_disk(bench: Bench) -> None:
    steps = bench.steps
    if not steps:
        return
    print(f"disk and store baselines: {len(steps)} step(s) x {bench.args.runs} run(s) ...")
    # Untimed: the first large write of a run is often several times slower
    # on this VM (page-cache pages the host has to back again).
    seconds = bench.paired_disk()
    print(f"  untimed warm-up: one file + fsync {seconds:.2f}s")
    for r in range(bench.args.runs):
        shift = r % len(steps)
        for step in steps[shift:] + steps[:shift]:
            bench.run_step(step)
            s = step.seconds[-1]
            print(
                f"  run {r + 1}: {step.label}: {s:.2f}s ({bench.payload.size / 1e9 / s:.2f} GB/s)"
            )


def run_flush(bench: Bench, trainer: Trainer) -> None:
    args, layout = bench.args, bench.layout
    mounted = Mounted(layout, args.cache_size)
    for workers in args.workers:
        for bandwidth in args.bandwidths:
            cell = Cell(workers, bandwidth)
            bench.cells.append(cell)
            label = f"flush.workers {workers}, flush.bandwidth {size_label(bandwidth)}"
            print(f"{label}: mounting ...")
            mounted.mount(workers, bandwidth)
            try:
                kinds = ["alone", "training"] + (["disk"] if not bandwidth else [])
                for r in range(args.capped_runs if bandwidth else args.runs):
                    shift = r % len(kinds)
                    for kind in kinds[shift:] + kinds[:shift]:
                        name = f"ckpt-{workers}-{bandwidth}-{r}-{kind}.bin"
                        if kind == "disk":
                            cell.disk.append(bench.paired_disk())
                            s = cell.disk[-1]
                            print(f"  run {r + 1}: plain file + fsync {s:.2f}s")
                            continue
                        data = bench.payload.stamp()
                        bench.prepare()
                        drain = mounted.write_and_drain(
                            data, name, trainer if kind == "training" else None, args.train_seconds
                        )
                        (cell.training if kind == "training" else cell.alone).append(drain)
                        extra = ""
                        if drain.alone is not None and drain.flushing is not None:
                            extra = (
                                f", training loop {drain.alone.rate:.1f} -> "
                                f"{drain.flushing.rate:.1f} steps/s (other load "
                                f"{drain.alone.other_cores:.2f} -> "
                                f"{drain.flushing.other_cores:.2f} cores)"
                            )
                        print(
                            f"  run {r + 1}: drain {kind}: {drain.seconds:.2f}s "
                            f"({drain.stored / 1e9 / drain.seconds:.2f} GB/s stored), "
                            f"daemon CPU {drain.daemon_cpu:.2f}s{extra}"
                        )
                        if drain.stored != bench.payload.size:
                            bench.notes.append(
                                f"{label}, run {r + 1} ({kind}): stored {drain.stored} bytes "
                                f"of {bench.payload.size}"
                            )
                cell.hash_throughput = mounted.status()["flush"]["hash_throughput"]
            finally:
                mounted.unmount_and_clear()


# ----- report ----------------------------------------------------------------------------------


def disk_rows(bench: Bench, seq: float) -> list[list[str]]:
    size = bench.payload.size
    rows = []
    for step in bench.steps:
        med = median(step.seconds)
        rows.append(
            [
                step.label,
                f"{med:.2f}",
                f"{size / 1e9 / med:.2f}",
                f"{seq / med:.2f}",
                f"{median(step.cpu) / (size / GIB):.2f}",
                f"{min(step.seconds):.2f}-{max(step.seconds):.2f}",
            ]
        )
    return rows


def drain_rows(bench: Bench, seq: float) -> list[list[str]]:
    size = bench.payload.size
    rows = []
    for c in bench.cells:
        secs = [d.seconds for d in c.alone]
        med = median(secs)
        paired = (
            f"{median([disk / d.seconds for disk, d in zip(c.disk, c.alone, strict=False)]):.2f}"
            if c.disk
            else "-"
        )
        rows.append(
            [
                str(c.workers),
                size_label(c.bandwidth),
                f"{med:.2f}",
                f"{size / 1e9 / med:.2f}",
                fmt(seq / med, ".2f"),
                paired,
                f"{median([d.daemon_cpu for d in c.alone]) / (size / GIB):.2f}",
                f"{c.hash_throughput / 1e9:.1f}",
                f"{max(d.anon for d in c.alone + c.training) / MIB:.0f}",
                f"{min(secs):.2f}-{max(secs):.2f}",
            ]
        )
    return rows


def interference_rows(bench: Bench) -> list[list[str]]:
    size = bench.payload.size
    rows = []
    for c in bench.cells:
        pairs = [(d.alone, d.flushing) for d in c.training if d.alone and d.flushing]
        slow = [1 - f.rate / a.rate for a, f in pairs]
        rows.append(
            [
                str(c.workers),
                size_label(c.bandwidth),
                f"{median([a.rate for a, _ in pairs]):.1f}",
                f"{median([f.rate for _, f in pairs]):.1f}",
                f"{100 * median(slow):.1f}",
                f"{100 * min(slow, default=0):.1f}..{100 * max(slow, default=0):.1f}",
                f"{median([d.seconds for d in c.training]):.2f}",
                f"{median([d.seconds for d in c.alone]):.2f}",
                f"{median([d.daemon_cpu for d in c.training]) / (size / GIB):.2f}",
                f"{median([a.other_cores for a, _ in pairs]):.2f} / "
                f"{median([f.other_cores for _, f in pairs]):.2f}",
            ]
        )
    return rows


DISK_HEADER = ("write", "median s", "GB/s", "x one file", "CPU s/GiB", "min-max s")
DRAIN_HEADER = (
    "workers",
    "bandwidth",
    "drain s",
    "GB/s",
    "x disk",
    "x paired disk",
    "daemon CPU s/GiB",
    "hash GB/s/thread",
    "anon MiB",
    "min-max s",
)
INTERFERENCE_HEADER = (
    "workers",
    "bandwidth",
    "steps/s alone",
    "steps/s flushing",
    "slowdown %",
    "slowdown range %",
    "drain s (training)",
    "drain s (alone)",
    "daemon CPU s/GiB",
    "other load, cores",
)


def print_report(bench: Bench, context: list[str]) -> None:
    one_file = next((s for s in bench.steps if s.label == ONE_FILE), None)
    # The disk's rate: the one-file baseline, else the plain files paired with the drains.
    seq = median(one_file.seconds if one_file else [d for c in bench.cells for d in c.disk])
    tables = []
    if bench.steps:
        tables.append(
            (
                "Disk and store baselines (this process, no ckptfs; x one file = speed relative "
                "to one file + fsync; CPU = this process's utime + stime)",
                DISK_HEADER,
                disk_rows(bench, seq),
                "lrrrrr",
            )
        )
    if bench.cells:
        tables.append(
            (
                "Drain, close -> durable, nothing else running (x disk = drain rate / the "
                "one-file + fsync rate above; x paired disk = the same, against the plain "
                "file written in the same runs)",
                DRAIN_HEADER,
                drain_rows(bench, seq),
                "rlrrrrrrrr",
            )
        )
        tables.append(
            (
                "Interference: 1-thread training loop alone (before the write and after the "
                "drain) and while the flush drains; other load = CPU of everything but the "
                "loop and the daemon (other jobs; while flushing also the kernel's writeback "
                "for the flush), alone / flushing",
                INTERFERENCE_HEADER,
                interference_rows(bench),
                "rlrrrrrrrr",
            )
        )
    print()
    print_lines(context)
    for title, header, rows, align in tables:
        print(f"\n{title}\n")
        print_lines(table_lines(header, rows, align))
    if bench.notes:
        print()
        print_lines(bench.notes, bullet="- ")
    print("\nMarkdown:\n")
    print_lines(context, bullet="- ")
    for title, header, rows, align in tables:
        print(f"\n{title}\n")
        print_lines(markdown_lines(header, rows, align))


# ----- main ----------------------------------------------------------------------------------

PARTS = ("disk", "store", "flush")


def parse_list(text: str, parse: Callable[[str], int]) -> list[int]:
    return [parse(s.strip()) for s in text.split(",") if s.strip()]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m ckptfs.tools.bench.bench_flush", description=__doc__.splitlines()[0]
    )
    p.add_argument("--size-gib", type=float, default=2.0, help="file size (default 2)")
    p.add_argument(
        "--runs",
        type=int,
        default=3,
        help="runs of the disk baselines and of the unlimited-bandwidth settings (default 3)",
    )
    p.add_argument(
        "--capped-runs",
        type=int,
        default=1,
        help="runs of the settings with a flush.bandwidth cap (default 1: their drain time "
        "is the cap's)",
    )
    p.add_argument("--workers", default="1,2,4", help="flush.workers values (default 1,2,4)")
    p.add_argument(
        "--bandwidths",
        default="0,200MiB,100MiB",
        help="flush.bandwidth values, 0 = unlimited (default 0,200MiB,100MiB)",
    )
    p.add_argument(
        "--parts", default="disk,flush", help="comma-separated subset of " + ",".join(PARTS)
    )
    p.add_argument(
        "--train-seconds",
        type=float,
        default=1.5,
        help="training loop steps/s alone is measured this long before each write (default 1.5)",
    )
    p.add_argument("--train-matmul", type=int, default=512, help="matmul size (default 512)")
    p.add_argument(
        "--train-params-mib",
        type=float,
        default=32.0,
        help="fp32 parameters updated per step (default 32 MiB)",
    )
    p.add_argument("--cache-size", help="ckptfs cache size (default: 1.1 x size + 128MiB)")
    p.add_argument(
        "--rewarm-gib",
        type=float,
        default=0.0,
        help="memory touched and freed before every timed step (default 0: on a VM that "
        "reports freed pages to the host at once, re-touching warms nothing)",
    )
    p.add_argument(
        "--workdir",
        type=Path,
        default=Path(f"/var/tmp/ckptfs-bench-flush-{os.getpid()}"),
        help="local-disk directory for the backing dir and the disk baselines",
    )
    p.add_argument("--keep", action="store_true", help="keep --workdir's files afterwards")
    args = p.parse_args(argv)
    args.parts = [s for s in args.parts.split(",") if s]
    if unknown := set(args.parts) - set(PARTS):
        p.error(f"unknown part(s): {', '.join(sorted(unknown))}")
    if args.size_gib <= 0 or args.runs < 1 or args.capped_runs < 1:
        p.error("--size-gib must be > 0, --runs and --capped-runs >= 1")
    try:
        args.workers = parse_list(args.workers, int)
        args.bandwidths = parse_list(
            args.bandwidths, lambda s: 0 if s == "0" else parse_size(s, "--bandwidths")
        )
    except ValueError as exc:
        p.error(str(exc))
    if not args.workers or min(args.workers) < 1 or min(args.bandwidths, default=0) < 0:
        p.error("--workers must be >= 1 and --bandwidths >= 0")
    return args


def benchmark(args: argparse.Namespace, layout: Layout) -> None:
    if os.geteuid() != 0:
        raise BenchError("must run as root (it drops the kernel page cache)")
    size = int(args.size_gib * GIB) // 4096 * 4096  # O_DIRECT variants need whole pages
    args.cache_size = args.cache_size or str(int(1.1 * size) + 128 * MIB)
    need = size + parse_size(args.cache_size, "--cache-size") + 2 * size + safety_margin()
    if meminfo()["MemAvailable"] < need:
        raise BenchError(f"needs about {need / GIB:.1f} GiB of available memory")
    start = time.perf_counter()
    load_before = os.getloadavg()[0]
    payload = Payload(size)
    rewarm = Rewarm(int(args.rewarm_gib * GIB))
    bench = Bench(args, layout, payload, rewarm, steps=disk_steps(args.parts))
    trainer = None
    try:
        run_disk(bench)
        if "flush" in args.parts:
            n_param = int(args.train_params_mib * MIB) // 4
            trainer = Trainer(layout.tmpfs / "trainer-steps", args.train_matmul, n_param)
            run_flush(bench, trainer)
    finally:
        if trainer is not None:
            trainer.close()
    load = f"load average {load_before:.1f} at the start, {os.getloadavg()[0]:.1f} at the end"
    context = [
        f"file: {size / GIB:.2f} GiB of random bytes; {args.runs} run(s) of the disk "
        f"baselines and of unlimited flushes, {args.capped_runs} of capped ones; medians; "
        "GB/s = 10^9 bytes/s",
        f"machine: {machine()}; {load}; whole benchmark {time.perf_counter() - start:.0f}s",
        f"backing disk: {layout.workdir} ({filesystem_of(layout.workdir)}); ckptfs cache "
        f"{args.cache_size} bytes in {layout.cache}, chunk_size 4 MiB, durability local",
        f"before every timed step: page cache dropped (sync + drop_caches), "
        f"{rewarm.size / GIB:.2f} GiB of memory touched and freed; {page_reporting()}",
        f"training loop: 1 thread, {args.train_matmul}^2 fp32 matmul + SGD update of "
        f"{args.train_params_mib:g} MiB of fp32 parameters per step; alone for "
        f"{args.train_seconds:g}s before the write and {args.train_seconds:g}s after the "
        "drain, stopped during the write",
    ]
    print_report(bench, context)


def page_reporting() -> str:
    """How soon this VM hands freed memory back to the host (each page handed back
    costs a host fault when it is next used: the page-cache pages of a write)."""
    params = Path("/sys/module/page_reporting/parameters")
    try:
        order = int((params / "page_reporting_order").read_text())
    except (OSError, ValueError):
        return "no free page reporting"
    delay = params / "min_free_ms"
    when = f", after {delay.read_text().strip()} ms" if delay.exists() else ""
    block = (os.sysconf("SC_PAGE_SIZE") << order) >> 20
    return f"free page reporting on (blocks of {block} MiB{when})"


def filesystem_of(path: Path) -> str:
    best, fstype = "", "?"
    real = os.path.realpath(path)
    with open("/proc/self/mounts") as mounts:
        for line in mounts:
            fields = line.split()
            mnt = fields[1]
            if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) > len(best):
                best, fstype = mnt, f"{fields[2]} on {fields[0]}"
    return fstype


def main(argv: list[str] | None = None) -> int:
    return run_mounted("bench_flush", parse_args(argv), benchmark)


if __name__ == "__main__":
    sys.exit(main())
