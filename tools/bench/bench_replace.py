"""A checkpoint replaced while others load it: torn loads, race window, rename; ckptfs vs plain.

    python -m ckptfs.tools.bench.bench_replace [--readers 2] [--seconds 4] [--period 0.06]
        [--gap 0] [--runs 3] [--workdir DIR]

Issue 13's scenario. One writer saves a checkpoint to a temporary name and
``os.replace``s it onto the final name every --period seconds (``torch.save``
then ``os.replace``, as trainers do), while --readers processes
``torch.load(mmap=True)`` the final name in a loop (--gap seconds between
loads; 0: back to back). torch.load(mmap=True) reads the pickle through one
open and maps the tensor bytes through a second open of the path, so a
replace in between gives a torn load (the tensors of one version, the pickle
of another) on any filesystem. Every version says which it is in its pickle
and in its tensor bytes; each load is classified, and its race window is
timed inside torch.load itself (from torch's own open of the path until its
second open starts, by wrapping the two calls in the reader's process).

Each run does the same in a plain directory (beside the backing directory,
on the same filesystem) and through the mount, in alternating order. It
prints, per target and run: loads, torn loads (also per replace), the race
window (median, 90th percentile, the median of the torn loads' windows, and
that of each reader's first untorn load of a new version, which finds
nothing of the new file in the kernel's page cache), and the writer's save
and rename latency; then the medians over the runs and the ratios. It
asserts nothing.

Why the mount's torn loads outnumber its windows: the kernel holds the
replaced file's inode lock for as long as the FUSE RENAME takes (a backing-
store round trip), and FUSE's lseek(SEEK_END), which torch's zip reader does
between the two opens, takes that lock: a load whose first open came before
the rename waits there, and its second open then finds the new file
(docs/PERFORMANCE.md, "Replace while others load").
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckptfs.tools.bench.benchlib import (
    BenchError,
    Layout,
    add_shm_workdir_options,
    mount,
    run_in_shm_workdir,
    stat_json,
)

FIRST = 1000  # versions 1000..9999 pickle to the same number of bytes
CACHE_SIZE = "512MiB"
READY_TIMEOUT = 120.0


def version(v: int) -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(v)
    return {
        "version": v,
        "marker": torch.full((8,), v, dtype=torch.int64),
        "w": torch.randn(256, 512, generator=g),
    }


# ----- the reader (a process of its own) -----------------------------------------------------


def reader(path: Path, out: Path, stop: Path, gap: float) -> None:
    """torch.load(mmap=True) ``path`` until ``stop`` exists; writes one row per load:
    (window ns, pickle's version, tensors' version)."""
    import torch
    import torch.serialization

    marks: dict[str, int] = {}
    builtin_open = open
    from_file = torch.UntypedStorage.from_file

    def timed_open(*args: Any, **kwargs: Any) -> Any:
        marks["opened"] = time.monotonic_ns()
        return builtin_open(*args, **kwargs)

    def timed_from_file(*args: Any, **kwargs: Any) -> Any:
        marks.setdefault("reopening", time.monotonic_ns())
        return from_file(*args, **kwargs)

    torch.serialization.open = timed_open  # type: ignore[attr-defined]
    torch.UntypedStorage.from_file = timed_from_file  # type: ignore[method-assign]
    rows = []
    Path(f"{out}.ready").touch()
    while not stop.exists():
        marks.clear()
        sd = torch.load(path, mmap=True, weights_only=True)
        if "opened" not in marks or "reopening" not in marks:
            raise SystemExit(f"torch.load({path}, mmap=True) did not open the path twice")
        rows.append((marks["reopening"] - marks["opened"], sd["version"], int(sd["marker"][0])))
        del sd
        if gap:
            time.sleep(gap)
    out.write_text(json.dumps(rows))


# ----- one race ----------------------------------------------------------------------------


@dataclass
class Race:
    target: str
    loads: int = 0
    torn: int = 0
    replaces: int = 0
    windows: list[int] = field(default_factory=list)
    torn_windows: list[int] = field(default_factory=list)
    # A reader's first untorn load of each version: right after its replace,
    # nothing of the new file in the kernel's page cache yet.
    first_windows: list[int] = field(default_factory=list)
    saves: list[int] = field(default_factory=list)
    renames: list[int] = field(default_factory=list)


def race(target: str, directory: Path, args: argparse.Namespace) -> Race:
    import torch

    work = Path(tempfile.mkdtemp(prefix="bench-replace-", dir="/dev/shm"))
    directory.mkdir(exist_ok=True)
    final, staging, stop = directory / "model.pt", directory / "model.pt.tmp", work / "stop"
    torch.save(version(FIRST), staging)
    os.replace(staging, final)
    cmd = [sys.executable, "-m", "ckptfs.tools.bench.bench_replace", "--reader"]
    procs = [
        subprocess.Popen([*cmd, str(final), str(work / f"r{i}.json"), str(stop), str(args.gap)])
        for i in range(args.readers)
    ]
    result = Race(target)
    try:
        deadline = time.monotonic() + READY_TIMEOUT
        while len(list(work.glob("*.ready"))) < len(procs):
            if any(p.poll() is not None for p in procs) or time.monotonic() > deadline:
                raise BenchError(f"{target}: a reader did not start")
            time.sleep(0.05)
        v, start = FIRST, time.monotonic()
        while time.monotonic() < start + args.seconds:
            time.sleep(max(0.0, start + (v - FIRST) * args.period - time.monotonic()))
            v += 1
            t0 = time.perf_counter_ns()
            torch.save(version(v), staging)
            t1 = time.perf_counter_ns()
            os.replace(staging, final)
            t2 = time.perf_counter_ns()
            result.saves.append(t1 - t0)
            result.renames.append(t2 - t1)
        result.replaces = v - FIRST
        stop.touch()
        for p in procs:
            if p.wait(timeout=60) != 0:
                raise BenchError(f"{target}: a reader failed ({p.returncode})")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for i in range(args.readers):
        last = None
        for window, pickled, tensors in json.loads((work / f"r{i}.json").read_text()):
            result.loads += 1
            result.windows.append(window)
            if pickled != tensors:
                result.torn += 1
                result.torn_windows.append(window)
            elif pickled != last:
                result.first_windows.append(window)
            last = tensors
    for p in work.iterdir():
        p.unlink()
    work.rmdir()
    return result


# ----- the report --------------------------------------------------------------------------


def _us(values: list[int], q: float = 0.5) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))] / 1e3


def row(r: Race) -> dict[str, float]:
    return {
        "loads": r.loads,
        "torn %": 100.0 * r.torn / max(1, r.loads),
        "torn per replace": r.torn / max(1, r.replaces),
        "window µs": _us(r.windows),
        "window p90 µs": _us(r.windows, 0.9),
        "torn loads' window µs": _us(r.torn_windows),
        "new version's window µs": _us(r.first_windows),
        "save µs": _us(r.saves),
        "rename µs": _us(r.renames),
        "rename p90 µs": _us(r.renames, 0.9),
    }


def print_report(runs: list[dict[str, Race]]) -> None:
    columns = list(row(Race("")).keys())
    print(f"{'run':>4} {'target':8} " + " ".join(f"{c:>21}" for c in columns))
    for i, run in enumerate(runs, 1):
        for name in ("ckptfs", "plain"):
            values = row(run[name])
            print(f"{i:>4} {name:8} " + " ".join(f"{values[c]:>21.2f}" for c in columns))
    medians = {
        name: {c: statistics.median(row(run[name])[c] for run in runs) for c in columns}
        for name in ("ckptfs", "plain")
    }
    print("medians over the runs:")
    for name, values in medians.items():
        print(f"{'':>4} {name:8} " + " ".join(f"{values[c]:>21.2f}" for c in columns))
    ratio = {
        c: medians["ckptfs"][c] / medians["plain"][c] if medians["plain"][c] else float("inf")
        for c in columns
    }
    print(f"{'':>4} {'ratio':8} " + " ".join(f"{ratio[c]:>20.2f}x" for c in columns))


def benchmark(args: argparse.Namespace, layout: Layout) -> None:
    mount(layout, args.cache_size, args.config)
    status = stat_json(layout, layout.mountpoint)
    print(f"mounted {layout.mountpoint}; backing {layout.backing}; cache of "
          f"{status['cache']['capacity'] >> 20} MiB")  # fmt: skip
    print(f"{args.readers} readers (torch.load(mmap=True), {args.gap:g} s between loads); a "
          f"replace every {args.period:g} s for {args.seconds:g} s; {args.runs} runs")  # fmt: skip
    targets = {"ckptfs": layout.mountpoint / "replace", "plain": layout.disk / "replace"}
    runs: list[dict[str, Race]] = []
    for i in range(args.runs):
        order = ["ckptfs", "plain"] if i % 2 == 0 else ["plain", "ckptfs"]
        runs.append({name: race(name, targets[name], args) for name in order})
        print(f"run {i + 1}/{args.runs} ({', '.join(order)}) done")
    print_report(runs)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m ckptfs.tools.bench.bench_replace", description=__doc__.splitlines()[0]
    )
    p.add_argument("--readers", type=int, default=2, help="loading processes (default 2)")
    p.add_argument("--seconds", type=float, default=4.0, help="replacing per run (default 4)")
    p.add_argument("--period", type=float, default=0.06, help="seconds per replace (default 0.06)")
    p.add_argument("--gap", type=float, default=0.0, help="seconds between a reader's loads")
    p.add_argument("--runs", type=int, default=3, help="runs, each in both targets (default 3)")
    add_shm_workdir_options(p, CACHE_SIZE)
    args = p.parse_args(argv)
    if args.readers < 1 or args.runs < 1 or args.seconds <= 0 or args.period <= 0 or args.gap < 0:
        p.error("--readers and --runs must be >= 1, --seconds and --period > 0, --gap >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--reader"]:
        path, out, stop, gap = argv[1:5]
        reader(Path(path), Path(out), Path(stop), float(gap))
        return 0
    args = parse_args(argv)
    return run_in_shm_workdir("bench_replace", args, benchmark)


if __name__ == "__main__":
    sys.exit(main())
