"""`ls -l` of a large directory through ckptfs against the backing directory itself.

    python -m ckptfs.tools.bench.bench_readdir [--files 20000] [--runs 5] [--workdir DIR]

Mounts ckptfs through the CLI, with its own run and cache directories, over a
backing directory under --workdir (by default a new directory in /dev/shm),
and fills two directories of --files small files each:

- ``plain``: plain files put in the backing directory directly (as a job
  that wrote to the backing store without ckptfs leaves them);
- ``written``: files written through the mount (create, write, close),
  flushed; the backing directory then holds their manifests.

and a third, ``side``, of --side plain files, that a probe thread stats one
new name at a time (every --probe-ms) while each ``ls -l`` runs: how long a
request about another file waits while the listing is served.

Each run, for each directory, times ``ls -l`` (``LC_ALL=C``, output to
/dev/null) through the mount:

- ``first after mount``: right after a remount (the daemon knows no inode);
- ``again``: right after that (the kernel's entries of the names are cached,
  every READDIRPLUS is answered again);
- ``after drop_caches``: after ``echo 2 > /proc/sys/vm/drop_caches`` (the
  kernel forgets every inode of the mount, and the daemon frees them);

and ``ls -l`` of the same directory in the backing directory (its plain
files, or the manifests the written files left), the probe statting the
backing directory's ``side`` files. Memory is touched and freed right before
every timed listing (--rewarm-mib). The report gives the median over --runs
of each listing's time, the ratio to the backing directory's, and the
median and largest over the runs of each run's slowest probe stat. It
prints measured numbers; it asserts no thresholds.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckptfs.tools.bench.benchlib import (
    MIB,
    BenchError,
    Layout,
    Rewarm,
    add_shm_workdir_options,
    ckptfs,
    drop_page_cache,
    machine,
    markdown_lines,
    mount,
    print_lines,
    run_in_shm_workdir,
    stat_json,
    table_lines,
    unmount,
)

FILE_BYTES = 1024  # each listed file's size
CACHE_SIZE = "512MiB"
FLUSH_TIMEOUT = 600.0
LS_TIMEOUT = 600.0
DIRS = ("plain", "written")
STEPS = ("first after mount", "again", "after drop_caches")


# ----- the probe ------------------------------------------------------------------------------


class Probe:
    """Stats one new name of ``paths`` every ``interval`` seconds, in a
    thread, while a listing runs; keeps each stat's latency. A name is not
    statted twice within a run, so the kernel has no fresh entry for it and
    each stat asks the filesystem."""

    def __init__(self, paths: list[Path], interval: float) -> None:
        self.paths = paths
        self.interval = interval
        self.next = 0
        self.latencies: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.error: OSError | None = None

    def __enter__(self) -> Probe:
        self.latencies = []
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(LS_TIMEOUT)
        if self.error is not None:
            raise BenchError(f"probe stat failed: {self.error}")

    def _run(self) -> None:
        while not self._stop.is_set():
            path = self.paths[self.next % len(self.paths)]
            self.next += 1
            start = time.perf_counter()
            try:
                os.stat(path)
            except OSError as exc:
                self.error = exc
                return
            self.latencies.append(time.perf_counter() - start)
            self._stop.wait(self.interval)


# ----- a listing ------------------------------------------------------------------------------


def ls_l(path: Path) -> float:
    """Seconds of ``ls -l path`` (C locale, output discarded)."""
    env = {**os.environ, "LC_ALL": "C"}
    start = time.perf_counter()
    try:
        done = subprocess.run(
            ["ls", "-l", "--color=never", str(path)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            env=env,
            timeout=LS_TIMEOUT,
            check=False,
        )
    except subprocess.TimeoutExpired:
        raise BenchError(f"ls -l {path} did not return within {LS_TIMEOUT:.0f}s") from None
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise BenchError(f"ls -l {path} failed: {done.stderr.decode(errors='replace').strip()}")
    return seconds


@dataclass
class Timings:
    seconds: list[float] = field(default_factory=list)
    worst_stat: list[float] = field(default_factory=list)  # each run's slowest probe stat


@dataclass
class Bench:
    layout: Layout
    args: argparse.Namespace
    rewarm: Rewarm
    mount_probe: Probe
    backing_probe: Probe
    results: dict[tuple[str, str], Timings] = field(default_factory=dict)

    def timed(self, key: tuple[str, str], path: Path, probe: Probe) -> None:
        self.rewarm()
        with probe:
            seconds = ls_l(path)
        t = self.results.setdefault(key, Timings())
        t.seconds.append(seconds)
        t.worst_stat.append(max(probe.latencies, default=0.0))

    def remount(self) -> None:
        unmount(self.layout)
        mount(self.layout, self.args.cache_size, self.args.config)


# ----- setting up ----------------------------------------------------------------------------


def fill(directory: Path, names: list[str]) -> None:
    """A file of FILE_BYTES at each name in ``directory`` (made if need be)."""
    directory.mkdir(parents=True, exist_ok=True)
    payload = b"x" * FILE_BYTES
    for name in names:
        with open(directory / name, "wb") as f:
            f.write(payload)


def prepare(bench: Bench) -> None:
    layout, args = bench.layout, bench.args
    names = [f"rank-{i:06d}.distcp" for i in range(args.files)]
    start = time.perf_counter()
    fill(layout.backing / "plain", names)
    fill(layout.backing / "side", [f"side-{i:06d}" for i in range(args.side)])
    fill(layout.mountpoint / "written", names)
    ckptfs(
        layout,
        *("flush", str(layout.mountpoint), "--wait", "--timeout", str(FLUSH_TIMEOUT)),
        timeout=FLUSH_TIMEOUT + 30,
    )
    print(
        f"made {args.files} plain files, {args.files} written through the mount (flushed) "
        f"and {args.side} side files in {time.perf_counter() - start:.1f}s"
    )


# ----- a run ---------------------------------------------------------------------------------


def one_run(bench: Bench, measured: bool) -> None:
    layout = bench.layout
    bench.remount()
    results = bench.results
    for d in DIRS:
        bench.timed((d, STEPS[0]), layout.mountpoint / d, bench.mount_probe)
        bench.timed((d, STEPS[1]), layout.mountpoint / d, bench.mount_probe)
        bench.timed((d, "backing"), layout.backing / d, bench.backing_probe)
    for d in DIRS:
        drop_page_cache("2")
        bench.timed((d, STEPS[2]), layout.mountpoint / d, bench.mount_probe)
    if not measured:
        results.clear()


# ----- the report -----------------------------------------------------------------------------


HEADER = (
    "directory",
    "listing",
    "ckptfs median s",
    "backing median s",
    "ratio",
    "ckptfs min-max s",
    "slowest stat ms (median, max)",
    "backing slowest stat ms",
)


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}"


def report_rows(results: dict[tuple[str, str], Timings]) -> list[list[str]]:
    rows = []
    for d in DIRS:
        base = results[(d, "backing")]
        base_med = statistics.median(base.seconds)
        for step in STEPS:
            t = results[(d, step)]
            med = statistics.median(t.seconds)
            rows.append(
                [
                    d,
                    step,
                    f"{med:.3f}",
                    f"{base_med:.3f}",
                    f"{med / base_med:.1f}x",
                    f"{min(t.seconds):.3f}-{max(t.seconds):.3f}",
                    f"{ms(statistics.median(t.worst_stat))}, {ms(max(t.worst_stat))}",
                    f"{ms(statistics.median(base.worst_stat))}, {ms(max(base.worst_stat))}",
                ]
            )
    return rows


def context(
    args: argparse.Namespace, layout: Layout, status: dict[str, Any], load: tuple[float, float]
) -> list[str]:
    return [
        f"machine: {machine()}, Python {sys.version.split()[0]}; load average (1 min) "
        f"{load[0]:.1f} at the start, {load[1]:.1f} at the end",
        f"ckptfs: durability {status['durability']}, backing dir {layout.backing}, cache "
        f"{status['cache']['capacity'] >> 20} MiB in {layout.cache}; the request thread's "
        f"reader: {status['fuse'].get('reader', 'python')}",
        f"{args.files} files of {FILE_BYTES} bytes per directory; `ls -l` with LC_ALL=C, "
        f"output to /dev/null; {args.runs} runs after an untimed warm-up run, medians; "
        f"{args.rewarm_mib} MiB of memory touched and freed before every listing",
        "first after mount: right after a remount; again: right after that; after "
        "drop_caches: after `echo 2 > /proc/sys/vm/drop_caches`; backing: `ls -l` of the "
        "same directory in the backing directory",
        f"slowest stat: a thread stats a new name of {args.side} side files every "
        f"{args.probe_ms} ms during each listing (through the mount, or in the backing "
        "directory for the backing listing); the slowest stat of each run, median and "
        "largest over the runs",
        "ratio = ckptfs / backing (time)",
    ]


def print_report(rows: list[list[str]], lines: list[str]) -> None:
    align = "ll" + "r" * (len(HEADER) - 2)
    print()
    print_lines(lines)
    print()
    print_lines(table_lines(HEADER, rows, align))
    print("\nMarkdown:\n")
    print_lines([f"- {line}" for line in lines])
    print()
    print_lines(markdown_lines(HEADER, rows, align))


# ----- main -----------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m ckptfs.tools.bench.bench_readdir", description=__doc__.splitlines()[0]
    )
    p.add_argument("--files", type=int, default=20000, help="files per directory (20000)")
    p.add_argument("--side", type=int, default=5000, help="files the probe stats (5000)")
    p.add_argument("--probe-ms", type=float, default=5.0, help="probe interval (5 ms)")
    p.add_argument("--runs", type=int, default=5, help="measured runs (default 5)")
    p.add_argument(
        "--rewarm-mib",
        type=int,
        default=256,
        help="memory touched and freed before every listing (default 256)",
    )
    add_shm_workdir_options(p, CACHE_SIZE)
    args = p.parse_args(argv)
    if args.files < 1 or args.runs < 1 or args.side < 1:
        p.error("--files, --side and --runs must be >= 1")
    return args


def benchmark(args: argparse.Namespace, layout: Layout) -> None:
    if os.geteuid() != 0:
        raise BenchError("must run as root (it drops the kernel's dentries and inodes)")
    mount(layout, args.cache_size, args.config)
    status = stat_json(layout, layout.mountpoint)
    interval = args.probe_ms / 1e3
    side = [f"side-{i:06d}" for i in range(args.side)]
    bench = Bench(
        layout,
        args,
        Rewarm(args.rewarm_mib * MIB),
        Probe([layout.mountpoint / "side" / n for n in side], interval),
        Probe([layout.backing / "side" / n for n in side], interval),
    )
    prepare(bench)
    loadavg_start = os.getloadavg()[0]
    for i in range(-1, args.runs):
        start = time.perf_counter()
        one_run(bench, measured=i >= 0)
        what = "warm-up run" if i < 0 else f"run {i + 1}/{args.runs}"
        print(f"{what} in {time.perf_counter() - start:.1f}s")
    load = (loadavg_start, os.getloadavg()[0])
    print_report(report_rows(bench.results), context(args, layout, status, load))


def main(argv: list[str] | None = None) -> int:
    return run_in_shm_workdir("bench_readdir", parse_args(argv), benchmark)


if __name__ == "__main__":
    sys.exit(main())
