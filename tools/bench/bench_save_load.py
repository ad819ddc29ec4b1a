"""Benchmark torch.save / torch.load through ckptfs against tmpfs and local disk.

    python -m ckptfs.tools.bench.bench_save_load [--size-gib 2] [--runs 3] [--workdir DIR]

Mounts ckptfs itself through the CLI (backing directory on local disk under
--workdir, RAM cache in /dev/shm), builds a GPT-like state dict of about
--size-gib, and for each run measures:

- save: into the mount (until torch.save's close returns), into tmpfs, and into
  a plain directory on the backing disk followed by fsync of file and directory;
- close -> durable: until ``ckptfs stat --json`` reports the file durable;
- load: from the mount with the ckptfs cache warm (kernel page cache as the save
  left it), with the kernel page cache dropped, cold (``ckptfs evict`` plus page
  cache dropped), from tmpfs, and from the disk with its page cache dropped.

Before the runs it touches and frees most of the free RAM, then does one untimed
run of every target; each run takes the targets (mount, tmpfs, disk) in a
rotated order, and every timed step is preceded by touching and freeing
--rewarm-gib of memory. On a VM, memory the guest never touched, or handed
back to the host (virtio-balloon free page reporting), costs a host fault on
first touch, several times slower than recycled pages: without this, whichever
step first allocates such pages (a load's tensors, the tmpfs pages) looks
several times slower.

Every load opens a new fd (torch.load(path)) and is checked against the saved
state outside the timed part. Every run saves different bytes, so that dedup
does not flatter runs after the first. It prints measured numbers; it asserts
no thresholds.
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from ckptfs.tools.bench.benchlib import (
    GIB,
    N_LAYER,
    BenchError,
    Layout,
    Rewarm,
    build_state_dict,
    cache_size_for,
    ckptfs,
    file_entry,
    fsync_path,
    machine,
    markdown_lines,
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
    wait_durable,
)

TARGETS = ("mount", "tmpfs", "disk")


# ----- memory -------------------------------------------------------------------------


def torch_chunk(n: int) -> torch.Tensor:
    """``n`` bytes of new memory as a torch tensor, every byte written (for touch_memory)."""
    chunk = torch.empty(n, dtype=torch.uint8)
    chunk.fill_(0xA5)
    return chunk


def warm_memory(size: int, limit: int | None) -> list[str]:
    """The one-off warm-up before any measurement; returns lines for the report.

    Touches MemAvailable minus room for what the runs still allocate (the ckptfs
    cache and the state dict are resident already: the tmpfs copy, one loaded
    copy and the page cache of the file being read) and a margin. Going past
    MemFree makes the kernel reclaim page cache now rather than in the middle of
    a timed step.
    """
    info = meminfo()
    margin = safety_margin()
    reserve = 3 * size + margin
    want = max(0, info["MemAvailable"] - reserve)
    if limit is not None:
        want = min(want, limit)
    print(
        f"warming memory: touching and freeing {want / GIB:.2f} GiB of anonymous memory "
        f"(MemAvailable {info['MemAvailable'] / GIB:.2f} GiB, MemFree "
        f"{info['MemFree'] / GIB:.2f} GiB, left alone {reserve / GIB:.2f} GiB) ..."
    )
    touched, seconds = touch_memory(want, "MemAvailable", margin, torch_chunk)
    rate = f", {touched / 1e9 / seconds:.2f} GB/s" if touched and seconds else ""
    print(f"  touched {touched / GIB:.2f} GiB in {seconds:.2f}s{rate}")
    lines = [
        f"memory warm-up: touched and freed {touched / GIB:.2f} GiB of anonymous memory in "
        f"{seconds:.2f}s{rate} (MemAvailable {info['MemAvailable'] / GIB:.2f} GiB minus "
        f"{reserve / GIB:.2f} GiB for the tmpfs copy, a loaded copy, page cache and a "
        f"{margin / GIB:.2f} GiB margin), then one untimed run of every target"
    ]
    reporting = page_reporting()
    if reporting:
        lines.append(reporting)
    return lines


def page_reporting() -> str:
    """Describe virtio-balloon free page reporting, if this VM has it on.

    With it, the guest may hand free blocks back to the hypervisor, after which
    touching them costs a first-touch fault on the host again: pages warmed long
    before a measurement need not stay warm.
    """
    order_file = Path("/sys/module/page_reporting/parameters/page_reporting_order")
    try:
        order = int(order_file.read_text())
    except (OSError, ValueError):
        return ""
    for dev in Path("/sys/bus/virtio/devices").glob("*"):
        try:
            driver = (dev / "driver").resolve().name
            features = (dev / "features").read_text().strip()
        except OSError:
            continue
        # Feature bit 5 is VIRTIO_BALLOON_F_REPORTING.
        if driver == "virtio_balloon" and len(features) > 5 and features[5] == "1":
            block = (os.sysconf("SC_PAGE_SIZE") << order) >> 20
            return (
                f"virtio-balloon free page reporting is on (free blocks of {block} MiB may be "
                "handed back to the host)"
            )
    return ""


def describe_rewarm(rewarm: Rewarm) -> str:
    if rewarm.size <= 0:
        return "no memory re-touch before the timed steps (--rewarm-gib 0)"
    line = (
        f"before every timed step: touched and freed {rewarm.size / GIB:.2f} GiB "
        f"(median {statistics.median(rewarm.seconds or [0.0]):.2f}s, untimed)"
    )
    if rewarm.short:
        line += (
            f"; {len(rewarm.short)} time(s) MemFree allowed only {min(rewarm.short) / GIB:.2f} GiB"
        )
    return line


def drop_page_cache(path: Path) -> str:
    """Drop the kernel's cached pages of ``path``; returns how.

    FUSE files are in the page cache like any other, and ckptfs lets the kernel
    keep them across opens, so a new fd alone does not make a read cold.
    """
    os.sync()
    how = "fadvise(DONTNEED)"
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        how = "drop_caches + " + how
    except OSError:
        pass  # not permitted (container, non-root): per-file fadvise still works
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return how


# ----- the state dict -----------------------------------------------------------------


def perturb(sd: dict[str, torch.Tensor]) -> None:
    """Change every element, as a training step does, so no chunk repeats across runs."""
    for t in sd.values():
        t.add_(1.0)


def same_state(expected: dict[str, torch.Tensor], actual: Any) -> bool:
    return (
        isinstance(actual, dict)
        and actual.keys() == expected.keys()
        and all(torch.equal(expected[k], actual[k]) for k in expected)
    )


# ----- one run --------------------------------------------------------------------------


@dataclass
class Run:
    order: tuple[str, ...] = ()
    file_size: int = 0
    seconds: dict[str, float] = field(default_factory=dict)
    poll_s: float = 0.0  # how long one `ckptfs stat` poll took: the durable time's resolution
    page_cache_drop: str = ""
    notes: list[str] = field(default_factory=list)


@dataclass
class Bench:
    layout: Layout
    sd: dict[str, torch.Tensor]
    durable_timeout: float
    rewarm: Rewarm


def save_fsync(sd: dict[str, torch.Tensor], path: Path) -> None:
    save(sd, path, "disk")
    fsync_path(path)
    fsync_path(path.parent, directory=True)


def load_checked(
    sd: dict[str, torch.Tensor], path: Path, what: str, prepare: Callable[[], None]
) -> float:
    prepare()
    try:
        seconds, loaded = timed(lambda: torch.load(path, weights_only=True))
    except (OSError, RuntimeError) as exc:  # a damaged zip archive raises RuntimeError
        raise BenchError(f"{what}: torch.load of {path} failed: {exc}") from None
    ok = same_state(sd, loaded)
    del loaded
    gc.collect()
    if not ok:
        raise BenchError(f"{what}: {path} loaded back different tensors than were saved")
    return seconds


def evict(layout: Layout, path: Path) -> str:
    ckptfs(layout, "evict", str(path))
    entry = file_entry(stat_json(layout, path), layout, path) or {}
    left = entry.get("ram_bytes", 0)
    return f"evict left {left >> 20} MiB of the file in the ckptfs cache" if left else ""


def run_mount(bench: Bench, run: Run, tag: str) -> None:
    layout, sd, s, prepare = bench.layout, bench.sd, run.seconds, bench.rewarm
    mnt_dir = layout.mountpoint / tag
    mnt_dir.mkdir()
    mnt_file = mnt_dir / "model.pt"
    prepare()
    s["save mount"], _ = timed(lambda: save(sd, mnt_file, "mount"))
    s["close -> durable"], run.poll_s = wait_durable(layout, mnt_file, bench.durable_timeout)
    s["load mount warm"] = load_checked(sd, mnt_file, "mount warm", prepare)
    run.page_cache_drop = drop_page_cache(mnt_file)
    s["load mount, page cache dropped"] = load_checked(
        sd, mnt_file, "mount page cache dropped", prepare
    )
    note = evict(layout, mnt_file)
    drop_page_cache(mnt_file)
    s["load mount cold"] = load_checked(sd, mnt_file, "mount cold", prepare)
    run.notes += [note] if note else []
    shutil.rmtree(mnt_dir)  # frees the cache for the next run


def run_tmpfs(bench: Bench, run: Run, tag: str) -> None:
    sd, s, prepare = bench.sd, run.seconds, bench.rewarm
    tmpfs_file = bench.layout.tmpfs / f"{tag}.pt"
    prepare()
    s["save tmpfs"], _ = timed(lambda: save(sd, tmpfs_file, "tmpfs"))
    s["load tmpfs"] = load_checked(sd, tmpfs_file, "tmpfs", prepare)
    run.file_size = tmpfs_file.stat().st_size
    tmpfs_file.unlink()


def run_disk(bench: Bench, run: Run, tag: str) -> None:
    sd, s, prepare = bench.sd, run.seconds, bench.rewarm
    disk_file = bench.layout.disk / f"{tag}.pt"
    prepare()
    s["save disk + fsync"], _ = timed(lambda: save_fsync(sd, disk_file))
    drop_page_cache(disk_file)
    s["load disk cold"] = load_checked(sd, disk_file, "disk cold", prepare)
    disk_file.unlink()


RUNNERS: dict[str, Callable[[Bench, Run, str], None]] = {
    "mount": run_mount,
    "tmpfs": run_tmpfs,
    "disk": run_disk,
}


def run_order(index: int) -> tuple[str, ...]:
    """Rotate the targets: with as many runs as targets, each goes first once."""
    shift = index % len(TARGETS)
    return TARGETS[shift:] + TARGETS[:shift]


def one_run(bench: Bench, tag: str, order: tuple[str, ...]) -> Run:
    run = Run(order=order)
    for target in order:
        RUNNERS[target](bench, run, tag)
    return run


# ----- report ---------------------------------------------------------------------------

ROWS = [
    ("save mount", "torch.save into ckptfs (close returned)"),
    ("save tmpfs", "torch.save into tmpfs"),
    ("save disk + fsync", "torch.save into the backing disk + fsync"),
    ("close -> durable", "ckptfs close -> durable in backing dir"),
    ("load mount warm", "torch.load from ckptfs, cache warm"),
    ("load mount, page cache dropped", "torch.load from ckptfs, kernel page cache dropped"),
    ("load mount cold", "torch.load from ckptfs, evicted + page cache dropped"),
    ("load tmpfs", "torch.load from tmpfs"),
    ("load disk cold", "torch.load from the backing disk, page cache dropped"),
]
RATIOS = [
    ("save: mount / tmpfs", "save mount", "save tmpfs"),
    ("save: mount / disk + fsync", "save mount", "save disk + fsync"),
    ("load: mount warm / tmpfs", "load mount warm", "load tmpfs"),
    ("load: mount cold / disk cold", "load mount cold", "load disk cold"),
]


def medians(runs: list[Run]) -> dict[str, float]:
    return {key: statistics.median(r.seconds[key] for r in runs) for key, _ in ROWS}


def table_rows(runs: list[Run], size: int) -> list[tuple[str, str, str, str]]:
    med = medians(runs)
    rows = []
    for key, label in ROWS:
        spread = [r.seconds[key] for r in runs]
        rows.append(
            (
                label,
                f"{med[key]:.3f}",
                f"{size / 1e9 / med[key]:.2f}",
                f"{min(spread):.3f}-{max(spread):.3f}",
            )
        )
    return rows


def print_report(runs: list[Run], size: int, context: list[str]) -> None:
    med = medians(runs)
    header = ("measurement", "median s", "GB/s", "min-max s")
    rows = table_rows(runs, size)
    print()
    print_lines(context)
    print()
    print_lines(table_lines(header, rows))
    print()
    for label, num, den in RATIOS:
        print(f"{label:<30} {med[num] / med[den]:6.2f}x (time)")

    print("\nMarkdown:\n")
    print_lines(context, bullet="- ")
    print()
    print_lines(markdown_lines(header, rows))
    print()
    ratios = [(label, f"{med[num] / med[den]:.2f}") for label, num, den in RATIOS]
    print_lines(markdown_lines(("ratio (time)", "x"), ratios))


def context(
    runs: list[Run], layout: Layout, durability: str, warmup: list[str], rewarm: Rewarm
) -> list[str]:
    poll = statistics.median(r.poll_s for r in runs)
    return [
        f"file: {runs[0].file_size / 1e9:.2f} GB GPT-like state dict ({N_LAYER} layers, "
        f"bf16 blocks, fp32 embeddings), {len(runs)} run(s), median reported",
        f"machine: {machine()}, torch {torch.__version__}",
        f"ckptfs: durability {durability}, backing dir {layout.backing}, cache in {layout.cache}",
        f"durable time seen by polling `ckptfs stat --json` (one poll: {poll:.3f}s); "
        f"page cache dropped with {runs[0].page_cache_drop}; every load opens a new fd",
        *warmup,
        describe_rewarm(rewarm),
        "target order per run: " + "; ".join(", ".join(r.order) for r in runs),
        "GB/s = file size / time (10^9 bytes); ratios are time ratios, below 1 = ckptfs faster",
    ]


# ----- main -------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m ckptfs.tools.bench.bench_save_load", description=__doc__.splitlines()[0]
    )
    p.add_argument("--size-gib", type=float, default=2.0, help="state dict size (default 2)")
    p.add_argument("--runs", type=int, default=3, help="measured runs (default 3)")
    p.add_argument(
        "--workdir",
        type=Path,
        default=Path("/var/tmp/ckptfs-bench"),
        help="local-disk directory for the backing dir and the disk baseline",
    )
    p.add_argument("--config", help="ckptfs YAML config for the mount")
    p.add_argument("--cache-size", help="ckptfs cache size (default: 1.5 x size + 256MiB)")
    p.add_argument("--durable-timeout", type=float, default=900.0, help="seconds (default 900)")
    p.add_argument(
        "--warm-gib",
        type=float,
        help="cap on the one-off warm-up before the runs "
        "(default: the free RAM minus room for the runs and a margin)",
    )
    p.add_argument(
        "--rewarm-gib",
        type=float,
        help="memory to touch and free right before every timed step "
        "(default: 2 x the state dict; 0 turns it off)",
    )
    p.add_argument("--keep", action="store_true", help="keep --workdir's files afterwards")
    args = p.parse_args(argv)
    if args.size_gib <= 0 or args.runs < 1:
        p.error("--size-gib must be > 0 and --runs >= 1")
    if any(v is not None and v < 0 for v in (args.warm_gib, args.rewarm_gib)):
        p.error("--warm-gib and --rewarm-gib must be >= 0")
    return args


def benchmark(args: argparse.Namespace, layout: Layout) -> None:
    size = int(args.size_gib * GIB)
    cache_size = cache_size_for(args.cache_size, size)

    seconds, sd = timed(lambda: build_state_dict(size))
    nbytes = sum(t.numel() * t.element_size() for t in sd.values())
    print(f"built a {nbytes / GIB:.2f} GiB state dict with {len(sd)} tensors in {seconds:.1f}s")

    prefault = mount(layout, cache_size, args.config)
    status = stat_json(layout, layout.mountpoint)
    print(
        f"mounted; cache of {status['cache']['capacity'] >> 20} MiB pre-faulted ({prefault:.1f}s)"
    )

    # Warm up after the state dict and the cache exist, so that the pages it
    # touches are the free ones the runs will draw from.
    warm_limit = None if args.warm_gib is None else int(args.warm_gib * GIB)
    warmup = warm_memory(size, warm_limit)
    rewarm_size = int((2 * size) if args.rewarm_gib is None else args.rewarm_gib * GIB)
    bench = Bench(layout, sd, args.durable_timeout, Rewarm(rewarm_size, torch_chunk))
    print("untimed warm-up run: one save and the loads of every target ...")
    seconds, _ = timed(lambda: one_run(bench, "warmup", TARGETS))
    print(f"  done in {seconds:.1f}s")

    runs: list[Run] = []
    for i in range(args.runs):
        perturb(sd)  # new bytes: no run is flattered by dedup against the one before
        run = one_run(bench, f"run-{i}", run_order(i))
        runs.append(run)
        times = ", ".join(f"{k} {v:.3f}s" for k, v in run.seconds.items())
        print(f"run {i + 1}/{args.runs} ({', '.join(run.order)}): {times}")
        for note in run.notes:
            print(f"  {note}")
    report_context = context(runs, layout, status["durability"], warmup, bench.rewarm)
    print_report(runs, runs[0].file_size, report_context)


def main(argv: list[str] | None = None) -> int:
    return run_mounted("bench_save_load", parse_args(argv), benchmark)


if __name__ == "__main__":
    sys.exit(main())
