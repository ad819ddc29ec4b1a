"""What the benchmark scripts of this package share; not a public API.

- memory: /proc/meminfo, and touching and freeing anonymous memory right before a
  timed step, so that on a VM the step draws on pages the host has backed already;
- tables: the plain-text and markdown tables the reports print;
- mounts: ``is_mounted`` and a lazy ``fusermount3 -u -z`` that never raises;
- the ckptfs harness of bench_save_load and bench_dedup: the work directory layout, the
  ``ckptfs`` CLI (mount, stat, unmount), waiting for durable, cleanup, the GPT-like
  state dict they save, and the ``main()`` that runs it all and cleans up.

torch is imported only by the functions that need it, so that bench_fuse (and
the daemon and writer processes it starts) never loads it.
"""

from __future__ import annotations

import argparse
import json
import math
import mmap
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from ckptfs.fs.config import ConfigError, parse_size

if TYPE_CHECKING:
    import torch

GIB = 1 << 30
MIB = 1 << 20
TOUCH_CHUNK = 256 * MIB  # memory is touched, and its level checked, this much at a time
UNMOUNT_TIMEOUT = 30.0  # for fusermount3 -u -z
CLI_TIMEOUT = 120.0  # for a `ckptfs` command
# The GPT-like state dict's shape.
VOCAB = 50304
CONTEXT = 2048
N_LAYER = 24
T = TypeVar("T")


class BenchError(Exception):
    """A benchmark cannot go on; main() prints the message and exits 1."""


def timed(fn: Callable[[], T]) -> tuple[float, T]:
    """Call ``fn``; return (seconds it took, its result)."""
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def process_cpu_s(pid: int) -> float:
    """utime + stime of ``pid`` (all its threads), from /proc/PID/stat."""
    with open(f"/proc/{pid}/stat") as f:
        rest = f.read().rsplit(")", 1)[1].split()
    return (int(rest[11]) + int(rest[12])) / os.sysconf("SC_CLK_TCK")


def cpu_busy_s() -> float:
    """Busy CPU time of the whole machine so far (all CPUs), from /proc/stat."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def fsync_path(path: Path, directory: bool = False) -> None:
    """fsync ``path`` through a new fd (for a file, that flushes its dirty pages all the same)."""
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ----- memory ---------------------------------------------------------------------------


def drop_page_cache(level: str = "3") -> None:
    """sync, then drop the kernel's page cache (1) and its dentries and inodes (3)."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write(f"{level}\n")
    except OSError as exc:
        raise BenchError(f"cannot drop the page cache (run as root): {exc}") from None


def meminfo() -> dict[str, int]:
    """/proc/meminfo in bytes."""
    values: dict[str, int] = {}
    with open("/proc/meminfo") as f:
        for line in f:
            name, _, rest = line.partition(":")
            fields = rest.split()
            if fields and fields[0].isdigit():
                values[name] = int(fields[0]) * (1024 if fields[1:] == ["kB"] else 1)
    if "MemAvailable" not in values or "MemFree" not in values:
        raise BenchError("/proc/meminfo has no MemAvailable or MemFree line")
    return values


def available_memory() -> int:
    return meminfo()["MemAvailable"]


def safety_margin() -> int:
    """Memory the warm-up never touches: there is no swap to fall back on, and
    other processes on the machine keep allocating while it runs."""
    return max(GIB, meminfo()["MemTotal"] // 16)


_PATTERN = b"\xa5" * MIB


def mmap_chunk(n: int) -> mmap.mmap:
    """``n`` bytes of new anonymous memory, every page written."""
    m = mmap.mmap(-1, n)
    for off in range(0, n, MIB):
        end = min(off + MIB, n)
        m[off:end] = _PATTERN[: end - off]
    return m


def touch_memory(
    want: int, field: str, floor: int, new_chunk: Callable[[int], object] = mmap_chunk
) -> tuple[int, float]:
    """Write to up to ``want`` bytes of new anonymous memory, hold it all, then free it.

    Returns (bytes touched, seconds). ``new_chunk(n)`` allocates and writes one
    chunk of TOUCH_CHUNK bytes (or fewer); dropping it frees it. All chunks are
    held until the end so that they occupy distinct physical pages; freeing them
    leaves those pages, now backed by the hypervisor, on the kernel's free
    lists, where the next allocations (tensors, page cache, tmpfs pages) take
    them from. It stops early rather than let /proc/meminfo's ``field`` fall
    below ``floor`` (other processes allocate too, and there may be no swap).
    """
    chunks: list[object] = []
    touched = 0
    start = time.perf_counter()
    try:
        while touched < want:
            n = min(TOUCH_CHUNK, want - touched)
            if meminfo()[field] - n < floor:
                break
            chunks.append(new_chunk(n))
            touched += n
    finally:
        chunks.clear()
    return touched, time.perf_counter() - start


class Rewarm:
    """Touch and free ``size`` bytes right before each timed step.

    A one-off warm-up need not last: a VM with free page reporting may hand
    freed memory back to the host, other processes allocate and free meanwhile,
    and the steps between measurements take seconds. Re-touching just before
    the clock starts gives every target the same kind of pages: none pays for
    the host's first-touch faults because of where it sits in the run. Bounded
    by MemFree: reclaiming page cache here could evict a file the next step
    expects to find cached.
    """

    def __init__(self, size: int, new_chunk: Callable[[int], object] = mmap_chunk) -> None:
        self.size = size
        self.new_chunk = new_chunk
        self.margin = safety_margin()
        self.seconds: list[float] = []
        self.short: list[int] = []  # bytes touched when MemFree did not allow ``size``

    def __call__(self) -> None:
        if self.size <= 0:
            return
        touched, seconds = touch_memory(self.size, "MemFree", self.margin, self.new_chunk)
        self.seconds.append(seconds)
        if touched < self.size:
            self.short.append(touched)


def machine(total_memory: int | None = None) -> str:
    """'N CPUs, M GiB RAM, Linux RELEASE' for a report's context."""
    if total_memory is None:
        total_memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return f"{os.cpu_count()} CPUs, {total_memory / GIB:.0f} GiB RAM, Linux {platform.release()}"


# ----- tables ---------------------------------------------------------------------------


def table_lines(
    header: Sequence[str], rows: Sequence[Sequence[str]], align: str | None = None
) -> list[str]:
    """A plain-text table, columns two spaces apart.

    ``align`` has an "l" or "r" per column; by default the first column is
    left-aligned and the others right-aligned.
    """
    align = align or "l" + "r" * (len(header) - 1)
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = []
    for r in [header, *rows]:
        cells = [
            f"{c:<{w}}" if a == "l" else f"{c:>{w}}"
            for c, w, a in zip(r, widths, align, strict=True)
        ]
        lines.append("  ".join(cells).rstrip())
    return lines


def markdown_lines(
    header: Sequence[str], rows: Sequence[Sequence[str]], align: str | None = None
) -> list[str]:
    """The same table in markdown (``align`` as for table_lines)."""
    align = align or "l" + "r" * (len(header) - 1)
    lines = ["| " + " | ".join(header) + " |"]
    lines.append("| " + " | ".join("---" if a == "l" else "---:" for a in align) + " |")
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return lines


def print_lines(lines: Sequence[str], bullet: str = "") -> None:
    for line in lines:
        print(f"{bullet}{line}")


# ----- mounts ---------------------------------------------------------------------------


def is_mounted(path: Path) -> bool:
    """Whether ``path`` (absolute, symlinks resolved) is a mount point.

    Reads /proc/self/mounts only: unlike ckptfs.fs.preflight.is_mounted it never
    stats the path, which would hang on a FUSE daemon that stopped answering.
    """
    with open("/proc/self/mounts") as mounts:
        return any(line.split()[1:2] == [str(path)] for line in mounts)


def detach(mountpoint: Path, prog: str = "") -> None:
    """``fusermount3 -u -z`` if ``mountpoint`` is mounted; never raises (runs in a finally)."""
    if not is_mounted(mountpoint):
        return
    try:
        subprocess.run(
            ["fusermount3", "-u", "-z", str(mountpoint)], timeout=UNMOUNT_TIMEOUT, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        print(f"{prog + ': ' if prog else ''}warning: fusermount3 -u -z: {exc}", file=sys.stderr)


# ----- the ckptfs harness (bench_save_load, bench_dedup) ------------------------------------


@dataclass
class Layout:
    workdir: Path
    tmpfs: Path  # plain tmpfs directory: the in-RAM baseline
    cache: Path  # ckptfs RAM cache (its cache.dir), also on tmpfs

    @property
    def backing(self) -> Path:
        return self.workdir / "backing"

    @property
    def mountpoint(self) -> Path:
        return self.workdir / "mnt"

    @property
    def disk(self) -> Path:
        # Beside the backing directory, on the same disk, but not inside it: the
        # daemon owns the backing namespace while mounted.
        return self.workdir / "disk"

    @property
    def run_dir(self) -> Path:
        return self.workdir / "run"


def make_layout(workdir: Path) -> Layout:
    tag = f"ckptfs-bench-{os.getpid()}"
    layout = Layout(workdir.resolve(), Path("/dev/shm") / tag, Path("/dev/shm") / f"{tag}-cache")
    if is_mounted(layout.mountpoint):
        raise BenchError(
            f"{layout.mountpoint} is still mounted (an earlier run?): "
            f"`ckptfs umount {layout.mountpoint}` or `fusermount3 -u -z {layout.mountpoint}`"
        )
    for d in (layout.backing, layout.mountpoint, layout.disk, layout.run_dir, layout.tmpfs):
        d.mkdir(parents=True, exist_ok=True)
    if any(layout.mountpoint.iterdir()) or any(layout.backing.iterdir()):
        raise BenchError(
            f"{layout.mountpoint} or {layout.backing} is not empty: pick a new --workdir"
        )
    return layout


def cli_env(layout: Layout) -> dict[str, str]:
    """The environment of every `ckptfs` command: this benchmark's own run and cache
    directories, so that it never finds, or disturbs, another mount's."""
    return {
        **os.environ,
        "CKPTFS_RUN_DIR": str(layout.run_dir),
        "CKPTFS_CACHE_DIR": str(layout.cache),
    }


def ckptfs(layout: Layout, *args: str, timeout: float = CLI_TIMEOUT) -> str:
    """Run ``ckptfs ARGS`` (this interpreter's copy); return stdout or raise naming the command."""
    cmd = [sys.executable, "-m", "ckptfs", *args]
    try:
        done = subprocess.run(
            cmd, env=cli_env(layout), capture_output=True, text=True, timeout=timeout, check=False
        )
    except subprocess.TimeoutExpired:
        raise BenchError(
            f"`ckptfs {' '.join(args)}` did not return within {timeout:.0f}s"
        ) from None
    if done.returncode != 0:
        detail = (done.stderr or done.stdout).strip().splitlines()
        raise BenchError(
            f"`ckptfs {' '.join(args)}` failed ({done.returncode}): {detail[-1] if detail else ''}"
        )
    return done.stdout


def stat_json(layout: Layout, path: Path) -> dict[str, Any]:
    return json.loads(ckptfs(layout, "stat", str(path), "--json"))


def file_entry(status: dict[str, Any], layout: Layout, path: Path) -> dict[str, Any] | None:
    rel = str(path.relative_to(layout.mountpoint))
    return next((f for f in status.get("files", []) if f.get("path") == rel), None)


def cache_size_for(requested: str | None, size: int) -> str:
    """The ckptfs cache size for a state dict of ``size`` bytes: ``requested``
    (--cache-size), else one file plus headroom; raises if memory is short."""
    cache_size = requested or str(int(1.5 * size) + 256 * MIB)
    check_memory(size, parse_size(cache_size, "--cache-size", allow_percent=True))
    return cache_size


def check_memory(size: int, cache_size: int) -> None:
    # The state dict, one loaded copy, the tmpfs file and the ckptfs cache are
    # resident at once; the page cache of the other copies is reclaimable.
    need = 3 * size + cache_size + GIB
    have = available_memory()
    if have < need:
        raise BenchError(
            f"needs about {need / GIB:.1f} GiB of free memory for --size-gib {size / GIB:g}, "
            f"{have / GIB:.1f} GiB available"
        )


def mount(layout: Layout, cache_size: str, config: str | None) -> float:
    """Mount and wait until the daemon has pre-faulted its cache; returns that wait."""
    args = ["mount", str(layout.mountpoint), "--backing", str(layout.backing)]
    args += ["--cache-size", cache_size, "--cache-dir", str(layout.cache)]
    if config:
        args += ["--config", config]
    print(ckptfs(layout, *args).strip())
    return wait_prefaulted(layout)


def wait_prefaulted(layout: Layout, timeout: float = 300) -> float:
    """Wait until the daemon has pre-faulted its cache; returns that wait.

    Pre-faulting runs in the background after mount, in a thread that zeroes
    the whole cache; left running, it competes with the first measurements for
    the CPU (with three 4.5 GiB caches on 2 cores, for the first two runs).
    """
    start = time.perf_counter()
    deadline = start + timeout
    while time.perf_counter() < deadline:
        state = stat_json(layout, layout.mountpoint)["cache"]["prefault"]
        if state == "stopped":
            print(
                f"warning: {layout.mountpoint}: pre-faulting stopped (see the daemon's log);"
                " measuring with a partly pre-faulted cache",
                file=sys.stderr,
            )
        if state != "running":
            return time.perf_counter() - start
        time.sleep(0.2)
    raise BenchError(f"{layout.mountpoint}: cache not pre-faulted within {timeout:.0f}s")


def unmount(layout: Layout) -> None:
    """`ckptfs umount`, else a lazy fusermount3; never raises (runs in a finally)."""
    if not is_mounted(layout.mountpoint):
        return
    try:
        print(ckptfs(layout, "umount", str(layout.mountpoint), timeout=600).strip())
    except BenchError as exc:
        print(f"warning: {exc}; detaching with fusermount3 -u -z", file=sys.stderr)
        detach(layout.mountpoint)
    if is_mounted(layout.mountpoint):
        print(f"warning: {layout.mountpoint} is still mounted", file=sys.stderr)


def wait_durable(layout: Layout, path: Path, timeout: float) -> tuple[float, float]:
    """Poll `ckptfs stat --json` until ``path`` is durable.

    Returns (seconds since the call, median duration of one poll): the state
    changed at most one poll before it was seen.
    """
    start = time.perf_counter()
    polls: list[float] = []
    while time.perf_counter() - start < timeout:
        poll_start = time.perf_counter()
        entry = file_entry(stat_json(layout, path), layout, path)
        polls.append(time.perf_counter() - poll_start)
        if entry is None:
            raise BenchError(f"`ckptfs stat --json {path}` does not list the file")
        state = entry.get("state")
        if state == "durable":
            return time.perf_counter() - start, statistics.median(polls)
        if state == "lost":
            raise BenchError(f"ckptfs reports {path} as lost")
        time.sleep(0.02)
    raise BenchError(f"{path} was not durable within {timeout:.0f}s")


def cleanup(layout: Layout, keep: bool) -> None:
    """Unmount, free the RAM, and remove the files; the daemon's log in run/ stays."""
    unmount(layout)
    for d in (layout.tmpfs, layout.cache):
        shutil.rmtree(d, ignore_errors=True)
    if is_mounted(layout.mountpoint):
        print(f"left {layout.workdir} in place: {layout.mountpoint} is still mounted")
        return
    if not keep:
        for d in (layout.backing, layout.disk, layout.mountpoint):
            shutil.rmtree(d, ignore_errors=True)


def run_mounted(
    prog: str, args: argparse.Namespace, benchmark: Callable[[argparse.Namespace, Layout], None]
) -> int:
    """main() of a benchmark that mounts ckptfs under ``args.workdir``.

    Runs ``benchmark(args, layout)``; whatever happens, unmounts and cleans up
    (``args.keep`` keeps the files). Returns the exit status.
    """
    layout: Layout | None = None
    try:
        layout = make_layout(args.workdir)
        benchmark(args, layout)
        return 0
    except (BenchError, ConfigError) as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        if layout is not None:
            for log in sorted(layout.run_dir.glob("*.log")):
                print(f"{prog}: daemon log: {log}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{prog}: interrupted; unmounting and cleaning up", file=sys.stderr)
        return 130
    finally:
        if layout is not None:
            cleanup(layout, args.keep)


def add_shm_workdir_options(p: argparse.ArgumentParser, cache_size: str) -> None:
    """The options :func:`run_in_shm_workdir` reads (--workdir, --keep) and
    the mount's (--config, --cache-size)."""
    p.add_argument(
        "--workdir",
        type=Path,
        help="directory for the backing dir and the plain dir (default: a new one in /dev/shm, "
        "removed afterwards)",
    )
    p.add_argument("--config", help="ckptfs YAML config for the mount")
    p.add_argument("--cache-size", default=cache_size, help=f"(default {cache_size})")
    p.add_argument("--keep", action="store_true", help="keep --workdir's files afterwards")


def run_in_shm_workdir(
    prog: str, args: argparse.Namespace, benchmark: Callable[[argparse.Namespace, Layout], None]
) -> int:
    """:func:`run_mounted`, in a new work directory in /dev/shm unless
    ``args.workdir`` names one; that new directory is removed afterwards
    unless the run failed or ``args.keep`` asks to keep it."""
    made = args.workdir is None
    if made:
        args.workdir = Path(tempfile.mkdtemp(prefix=f"ckptfs-{prog}-", dir="/dev/shm"))
    status = 1  # if the benchmark itself raises (or Ctrl-C): its files are kept
    try:
        status = run_mounted(prog, args, benchmark)
    finally:
        if made and not args.keep and status == 0:
            if is_mounted(args.workdir.resolve() / "mnt"):
                print(f"left {args.workdir} in place: its mnt/ is still mounted")
            else:
                shutil.rmtree(args.workdir, ignore_errors=True)
        elif made:
            print(f"{prog}: files and the daemon log left in {args.workdir}", file=sys.stderr)
    return status


# ----- the state dict (bench_save_load, bench_dedup) ----------------------------------------


def gpt_width(size: int) -> int:
    """Model width so that the state dict below comes to about ``size`` bytes."""
    # bf16 blocks: 12*d^2 per layer at 2 bytes; fp32 embeddings: (VOCAB+CONTEXT)*d*4.
    a, b = N_LAYER * 12 * 2, (VOCAB + CONTEXT) * 4
    d = (-b + math.sqrt(b * b + 4 * a * size)) / (2 * a)
    return max(64, round(d / 64) * 64)


def build_state_dict(size: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """A GPT-2-like state dict: fp32 embeddings and norms, bf16 block weights."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    d = gpt_width(size)

    def randn(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype)

    sd: dict[str, torch.Tensor] = {
        "transformer.wte.weight": randn(VOCAB, d, dtype=torch.float32),
        "transformer.wpe.weight": randn(CONTEXT, d, dtype=torch.float32),
    }
    for i in range(N_LAYER):
        p = f"transformer.h.{i}."
        sd[p + "ln_1.weight"] = torch.ones(d)
        sd[p + "ln_1.bias"] = torch.zeros(d)
        sd[p + "attn.c_attn.weight"] = randn(3 * d, d)
        sd[p + "attn.c_attn.bias"] = randn(3 * d)
        sd[p + "attn.c_proj.weight"] = randn(d, d)
        sd[p + "attn.c_proj.bias"] = randn(d)
        sd[p + "ln_2.weight"] = torch.ones(d)
        sd[p + "ln_2.bias"] = torch.zeros(d)
        sd[p + "mlp.c_fc.weight"] = randn(4 * d, d)
        sd[p + "mlp.c_fc.bias"] = randn(4 * d)
        sd[p + "mlp.c_proj.weight"] = randn(d, 4 * d)
        sd[p + "mlp.c_proj.bias"] = randn(d)
    sd["transformer.ln_f.weight"] = torch.ones(d)
    sd["transformer.ln_f.bias"] = torch.zeros(d)
    return sd


def save(obj: Any, path: Path, what: str) -> None:
    """torch.save ``obj`` to ``path``; a failure raises BenchError naming ``what``."""
    import torch

    try:
        torch.save(obj, path)
    except (OSError, RuntimeError) as exc:  # torch's C++ writer raises RuntimeError
        raise BenchError(f"{what}: torch.save to {path} failed: {exc}") from None
