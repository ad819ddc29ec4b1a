"""Restore through ckptfs against the plain disk and tmpfs: cold loads, RAM reads, many readers.

    python -m ckptfs.tools.bench.bench_restore [--size-gib 2] [--runs 3] [--workdir DIR]
                                               [--parts load,ram,multi]

Mounts ckptfs through the CLI (backing directory on the local disk under
--workdir, RAM cache in /dev/shm, its own run directory) and measures, each
step --runs times with the medians reported:

- load: ``torch.load`` of a GPT-like state dict of about --size-gib, cold
  (``ckptfs evict`` and the kernel page cache dropped) against ``torch.load``
  of the same bytes as a plain file on the same disk with its page cache
  dropped; the two alternate within each run.
- ram: sequential ``os.read`` in 4 MiB pieces of a file of --read-gib held in
  the ckptfs cache (durable, so no flush runs; kernel page cache dropped)
  against the same read from tmpfs; and the same file evicted (read from its
  chunks on disk) against the plain file on disk.
- multi: --readers processes, each reading its own --reader-mib file in 4 MiB
  pieces, all started at once, cold (evicted, page cache dropped) against the
  same on plain files; and the same number reading one evicted file. Reports
  the bytes the daemon read from the backing store (``chunk_bytes_read`` in
  ``ckptfs stat --json``, and ``read_bytes`` of /proc/<daemon>/io) against
  the bytes the readers got.

Memory is touched and freed once before the runs and again (--rewarm-gib)
right before every timed step: on a VM, first-touch faults would otherwise
land on whichever step allocates new pages first. The daemon's memory outside
the arena (RssAnon) is printed after every part. It prints measured numbers;
it asserts no thresholds.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckptfs.tools.bench.benchlib import (
    GIB,
    MIB,
    BenchError,
    Layout,
    Rewarm,
    build_state_dict,
    ckptfs,
    drop_page_cache,
    fsync_path,
    machine,
    meminfo,
    mount,
    print_lines,
    run_mounted,
    safety_margin,
    save,
    stat_json,
    table_lines,
    timed,
    touch_memory,
)

PIECE = 4 * MIB  # the read size of the sequential readers
PARTS = ("load", "ram", "multi")
# A reader process: waits for "go" on stdin so that all start together, reads
# its file sequentially, prints the bytes it got.
READER = """
import os, sys
sys.stdin.readline()
fd = os.open(sys.argv[1], os.O_RDONLY)
total = 0
while True:
    n = len(os.read(fd, int(sys.argv[2])))
    if not n:
        break
    total += n
os.close(fd)
print(total, flush=True)
"""


@dataclass
class Bench:
    layout: Layout
    rewarm: Rewarm
    daemon_pid: int = 0
    rows: list[tuple[str, str, list[float], int]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def record(self, part: str, label: str, seconds: list[float], nbytes: int) -> None:
        self.rows.append((part, label, seconds, nbytes))
        med = statistics.median(seconds)
        print(f"  {label}: median {med:.3f}s ({nbytes / 1e9 / med:.2f} GB/s)")


# ----- helpers ---------------------------------------------------------------------------


def evict(layout: Layout, path: Path) -> None:
    ckptfs(layout, "evict", str(path))


def cold_mount(layout: Layout, path: Path) -> Callable[[], None]:
    def prepare() -> None:
        evict(layout, path)
        drop_page_cache()

    return prepare


def daemon_read_bytes(pid: int) -> int:
    """Bytes the daemon made the block layer read (all its threads)."""
    with open(f"/proc/{pid}/io") as io:
        for line in io:
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    return 0


def daemon_counters(bench: Bench) -> dict[str, int]:
    cache = stat_json(bench.layout, bench.layout.mountpoint)["cache"]
    return {
        "chunk_bytes_read": cache.get("chunk_bytes_read", 0),
        "chunk_reads": cache.get("chunk_reads", 0),
        "disk_read_bytes": daemon_read_bytes(bench.daemon_pid),
    }


def daemon_memory(bench: Bench) -> str:
    mem = stat_json(bench.layout, bench.layout.mountpoint).get("memory", {})
    return (
        f"daemon RSS {mem.get('rss', 0) / MIB:.0f} MiB, outside the arena (RssAnon) "
        f"{mem.get('anon', 0) / MIB:.0f} MiB"
    )


def write_random(path: Path, size: int, seed: int) -> None:
    """``size`` random bytes (distinct per seed, so nothing deduplicates), fsynced."""
    rng = random.Random(seed)
    with open(path, "wb") as out:
        left = size
        while left:
            n = min(64 * MIB, left)
            out.write(rng.randbytes(n))
            left -= n
        out.flush()
        os.fsync(out.fileno())


def copy_plain(src: Path, dst: Path) -> None:
    shutil.copyfile(src, dst)
    fsync_path(dst)
    fsync_path(dst.parent, directory=True)


def read_sequential(path: Path) -> int:
    fd = os.open(path, os.O_RDONLY)
    total = 0
    try:
        while n := len(os.read(fd, PIECE)):
            total += n
    finally:
        os.close(fd)
    return total


def timed_read(path: Path, prepare: Callable[[], None], rewarm: Rewarm) -> float:
    prepare()
    rewarm()
    seconds, got = timed(lambda: read_sequential(path))
    if got != path.stat().st_size:
        raise BenchError(f"read {got} bytes of {path}, expected {path.stat().st_size}")
    return seconds


def parallel_read(paths: list[Path]) -> float:
    """Start one reader process per path, let them go at once; wall time until all end."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", READER, str(p), str(PIECE)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for p in paths
    ]
    try:
        time.sleep(0.5)  # let the interpreters start before the clock does
        start = time.perf_counter()
        for proc in procs:
            assert proc.stdin is not None
            proc.stdin.write("go\n")
            proc.stdin.flush()
        outputs = [proc.communicate(timeout=900)[0] for proc in procs]
        seconds = time.perf_counter() - start
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for proc, out, path in zip(procs, outputs, paths, strict=True):
        if proc.returncode != 0 or int(out.strip() or -1) != path.stat().st_size:
            raise BenchError(f"a reader of {path} failed ({proc.returncode}): {out!r}")
    return seconds


def wait_durable(layout: Layout) -> None:
    ckptfs(layout, "flush", str(layout.mountpoint), "--wait", timeout=1800)


# ----- parts -------------------------------------------------------------------------------


def part_load(args: argparse.Namespace, bench: Bench) -> None:
    import torch

    layout = bench.layout
    size = int(args.size_gib * GIB)
    seconds, sd = timed(lambda: build_state_dict(size))
    print(f"load: built a {size / GIB:.2f} GiB state dict in {seconds:.1f}s")
    mnt_file = layout.mountpoint / "model.pt"
    disk_file = layout.disk / "model.pt"
    save(sd, mnt_file, "mount")
    wait_durable(layout)
    copy_plain(mnt_file, disk_file)  # the same bytes, as a plain file on the same disk
    nbytes = disk_file.stat().st_size

    def load(path: Path, prepare: Callable[[], None], check: bool) -> float:
        prepare()
        bench.rewarm()
        seconds, loaded = timed(lambda: torch.load(path, weights_only=True))
        ok = not check or all(torch.equal(sd[k], loaded[k]) for k in sd)
        del loaded
        gc.collect()
        if not ok:
            raise BenchError(f"torch.load of {path} returned different tensors")
        return seconds

    mount_s: list[float] = []
    disk_s: list[float] = []
    before = daemon_counters(bench)
    for i in range(args.runs):
        order = [("mount", mnt_file), ("disk", disk_file)]
        for name, path in order if i % 2 == 0 else order[::-1]:
            prepare = cold_mount(layout, path) if name == "mount" else drop_page_cache
            t = load(path, prepare, check=i == 0)
            (mount_s if name == "mount" else disk_s).append(t)
            print(f"  run {i + 1}: {name} {t:.3f}s")
    after = daemon_counters(bench)
    bench.record(
        "load", "torch.load from ckptfs, cold (evicted + page cache dropped)", mount_s, nbytes
    )
    bench.record("load", "torch.load of the plain file on disk, page cache dropped", disk_s, nbytes)
    read = after["chunk_bytes_read"] - before["chunk_bytes_read"]
    bench.notes.append(
        f"load: file {nbytes / 1e9:.2f} GB; ckptfs cold / plain disk = "
        f"{statistics.median(mount_s) / statistics.median(disk_s):.2f}x (time); chunk bytes "
        f"read per cold load {read / args.runs / 1e9:.2f} GB; {daemon_memory(bench)}"
    )
    mnt_file.unlink()
    disk_file.unlink()


def part_ram(args: argparse.Namespace, bench: Bench) -> None:
    layout = bench.layout
    size = int(args.read_gib * GIB)
    mnt_file = layout.mountpoint / "seq.bin"
    tmpfs_file = layout.tmpfs / "seq.bin"
    disk_file = layout.disk / "seq.bin"
    print(f"ram: writing a {size / GIB:.2f} GiB random file through the mount ...")
    write_random(mnt_file, size, seed=1)
    wait_durable(layout)
    shutil.copyfile(mnt_file, tmpfs_file)
    copy_plain(mnt_file, disk_file)
    runs: dict[str, list[float]] = {k: [] for k in ("mount", "tmpfs", "cold", "disk")}
    for i in range(args.runs):
        # The file is in the cache as written; only the kernel's copy is dropped.
        runs["mount"].append(timed_read(mnt_file, drop_page_cache, bench.rewarm))
        runs["tmpfs"].append(timed_read(tmpfs_file, lambda: None, bench.rewarm))
        print(f"  run {i + 1}: cache {runs['mount'][-1]:.3f}s, tmpfs {runs['tmpfs'][-1]:.3f}s")
    before = daemon_counters(bench)
    for i in range(args.runs):
        runs["cold"].append(timed_read(mnt_file, cold_mount(layout, mnt_file), bench.rewarm))
        runs["disk"].append(timed_read(disk_file, drop_page_cache, bench.rewarm))
        print(f"  run {i + 1}: evicted {runs['cold'][-1]:.3f}s, disk {runs['disk'][-1]:.3f}s")
    after = daemon_counters(bench)
    bench.record(
        "ram", "os.read 4 MiB, file in the ckptfs cache, page cache dropped", runs["mount"], size
    )
    bench.record("ram", "os.read 4 MiB from tmpfs", runs["tmpfs"], size)
    bench.record("ram", "os.read 4 MiB, evicted: from chunks on disk", runs["cold"], size)
    bench.record("ram", "os.read 4 MiB, plain file on disk, page cache dropped", runs["disk"], size)
    read = after["chunk_bytes_read"] - before["chunk_bytes_read"]
    bench.notes.append(
        f"ram: chunk bytes read per evicted read {read / args.runs / size:.3f}x the file; "
        f"{daemon_memory(bench)}"
    )
    for p in (mnt_file, tmpfs_file, disk_file):
        p.unlink()


def part_multi(args: argparse.Namespace, bench: Bench) -> None:
    layout = bench.layout
    n, size = args.readers, args.reader_mib * MIB
    print(f"multi: writing {n} random files of {args.reader_mib} MiB through the mount ...")
    mnt_files = [layout.mountpoint / f"shard-{i}.bin" for i in range(n)]
    disk_files = [layout.disk / f"shard-{i}.bin" for i in range(n)]
    for i, path in enumerate(mnt_files):
        write_random(path, size, seed=100 + i)
    wait_durable(layout)
    for src, dst in zip(mnt_files, disk_files, strict=True):
        copy_plain(src, dst)
    total = n * size
    runs: dict[str, list[float]] = {k: [] for k in ("mount", "disk", "same")}
    ratios: dict[str, list[float]] = {"mount": [], "same": []}
    disk_ratios: dict[str, list[float]] = {"mount": [], "same": []}

    def measured(key: str, paths: list[Path], got: int) -> None:
        evict(layout, layout.mountpoint)
        drop_page_cache()
        bench.rewarm()
        before = daemon_counters(bench)
        runs[key].append(parallel_read(paths))
        after = daemon_counters(bench)
        ratios[key].append((after["chunk_bytes_read"] - before["chunk_bytes_read"]) / got)
        disk_ratios[key].append((after["disk_read_bytes"] - before["disk_read_bytes"]) / got)

    for i in range(args.runs):
        measured("mount", mnt_files, total)
        drop_page_cache()
        bench.rewarm()
        runs["disk"].append(parallel_read(disk_files))
        measured("same", [mnt_files[0]] * n, size)
        print(
            f"  run {i + 1}: ckptfs {runs['mount'][-1]:.3f}s (chunk bytes read "
            f"{ratios['mount'][-1]:.3f}x), disk {runs['disk'][-1]:.3f}s, "
            f"{n} readers of one file {runs['same'][-1]:.3f}s ({ratios['same'][-1]:.3f}x)"
        )
    label = f"{n} processes x {args.reader_mib} MiB"
    bench.record(
        "multi", f"{label}, ckptfs cold (evicted + page cache dropped)", runs["mount"], total
    )
    bench.record("multi", f"{label}, plain files on disk, page cache dropped", runs["disk"], total)
    bench.record(
        "multi",
        f"{n} processes reading one {args.reader_mib} MiB file, ckptfs cold",
        runs["same"],
        n * size,
    )
    med = statistics.median
    bench.notes.append(
        f"multi: backing bytes read / bytes of the distinct files: chunk reads "
        f"{med(ratios['mount']):.3f}x, daemon disk reads {med(disk_ratios['mount']):.3f}x "
        f"({n} files); one file read by {n}: chunk reads {med(ratios['same']):.3f}x, disk "
        f"{med(disk_ratios['same']):.3f}x of the file; wall time ckptfs / disk "
        f"{med(runs['mount']) / med(runs['disk']):.2f}x; {daemon_memory(bench)}"
    )
    for p in mnt_files + disk_files:
        p.unlink()


PART_RUNNERS: dict[str, Callable[[argparse.Namespace, Bench], None]] = {
    "load": part_load,
    "ram": part_ram,
    "multi": part_multi,
}


# ----- main -------------------------------------------------------------------------------


def warm_memory(limit: int) -> str:
    info = meminfo()
    # Room for what the parts still allocate: a state dict and its loaded
    # copy, a tmpfs copy (the cache is pre-faulted already).
    want = min(limit, max(0, info["MemAvailable"] - 6 * GIB - safety_margin()))
    touched, seconds = touch_memory(want, "MemAvailable", safety_margin())
    rate = f" ({touched / 1e9 / seconds:.2f} GB/s)" if touched and seconds else ""
    return f"memory warm-up: touched and freed {touched / GIB:.2f} GiB in {seconds:.1f}s{rate}"


def print_report(bench: Bench, args: argparse.Namespace, context: list[str]) -> None:
    print()
    print_lines(context)
    print()
    rows = []
    for part, label, seconds, nbytes in bench.rows:
        med = statistics.median(seconds)
        rows.append(
            (
                part,
                label,
                f"{med:.3f}",
                f"{nbytes / 1e9 / med:.2f}",
                f"{min(seconds):.3f}-{max(seconds):.3f}",
            )
        )
    print_lines(
        table_lines(("part", "measurement", "median s", "GB/s", "min-max s"), rows, align="llrrr")
    )
    print()
    print_lines(bench.notes, bullet="- ")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m ckptfs.tools.bench.bench_restore", description=__doc__.splitlines()[0]
    )
    p.add_argument("--size-gib", type=float, default=2.0, help="state dict size (default 2)")
    p.add_argument("--read-gib", type=float, default=2.0, help="ram part file size (default 2)")
    p.add_argument("--readers", type=int, default=8, help="multi part processes (default 8)")
    p.add_argument("--reader-mib", type=int, default=256, help="multi part file size (256)")
    p.add_argument("--runs", type=int, default=3, help="measured runs (default 3)")
    p.add_argument(
        "--parts", default=",".join(PARTS), help="comma-separated subset of " + ",".join(PARTS)
    )
    p.add_argument("--cache-size", default="3GiB", help="ckptfs cache size (default 3GiB)")
    p.add_argument("--config", help="ckptfs YAML config for the mount")
    p.add_argument(
        "--warm-gib",
        type=float,
        default=8.0,
        help="cap on the memory touched and freed once before the runs (default 8)",
    )
    p.add_argument(
        "--rewarm-gib",
        type=float,
        default=1.0,
        help="memory touched and freed before every timed step (default 1)",
    )
    p.add_argument(
        "--workdir",
        type=Path,
        default=Path(f"/var/tmp/ckptfs-bench-restore-{os.getpid()}"),
        help="local-disk directory for the backing dir and the disk baseline",
    )
    p.add_argument("--keep", action="store_true", help="keep --workdir's files afterwards")
    args = p.parse_args(argv)
    args.parts = [s for s in args.parts.split(",") if s]
    if unknown := set(args.parts) - set(PARTS):
        p.error(f"unknown part(s): {', '.join(sorted(unknown))}")
    if args.runs < 1 or args.readers < 1:
        p.error("--runs and --readers must be >= 1")
    return args


def benchmark(args: argparse.Namespace, layout: Layout) -> None:
    if os.geteuid() != 0:
        raise BenchError("must run as root (it drops the kernel page cache)")
    mount(layout, args.cache_size, args.config)
    status: dict[str, Any] = stat_json(layout, layout.mountpoint)
    bench = Bench(layout, Rewarm(int(args.rewarm_gib * GIB)), daemon_pid=int(status["pid"]))
    warm = warm_memory(int(args.warm_gib * GIB))
    print(warm)
    load_before = os.getloadavg()[0]
    for part in args.parts:
        PART_RUNNERS[part](args, bench)
    # Other work on the machine competes for the same cores: say how much.
    load = f"load average {load_before:.1f} at the start, {os.getloadavg()[0]:.1f} at the end"
    context = [
        f"machine: {machine()}; {args.runs} run(s) per step, medians; reads in "
        f"{PIECE // MIB} MiB pieces; page cache dropped with drop_caches",
        f"ckptfs: backing {layout.backing}, cache {status['cache']['capacity'] / GIB:.1f} GiB "
        f"in {layout.cache}, durability {status['durability']}",
        warm,
        load,
    ]
    print_report(bench, args, context)


def main(argv: list[str] | None = None) -> int:
    return run_mounted("bench_restore", parse_args(argv), benchmark)


if __name__ == "__main__":
    sys.exit(main())
