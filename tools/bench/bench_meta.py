"""Metadata latency through ckptfs against a plain directory, and torch.load's mmap reopen window.

    python -m ckptfs.tools.bench.bench_meta [--ops 300] [--rounds 5] [--workdir DIR]

Mounts ckptfs itself through the CLI, with its own run directory and cache
directory (CKPTFS_RUN_DIR, CKPTFS_CACHE_DIR), over a backing directory under
--workdir (by default a new directory in /dev/shm, so that the store costs next
to nothing and what is measured is ckptfs and FUSE). The plain baseline is a
directory beside the backing directory, on the same filesystem: the backing
directory itself belongs to the daemon while it is mounted.

Each round measures, in both targets one after the other (the order alternates
between rounds), every operation on --ops files, one call at a time:

- stat, and open(O_RDONLY) + close, of an existing file: once with the name
  cached by the kernel (an untimed stat of it right before), once after the
  kernel's entry and attribute cache of the mount expired (a pass over the
  files after sleeping longer than the mount's attribute timeout);
- create (O_CREAT | O_WRONLY | O_EXCL) + close of a new name, rename of it, then
  unlink; the mount's flusher is let finish (``ckptfs flush --wait``) between
  these steps, so that its background work is not timed with the next one;
- the mmap reopen window of ``torch.load(path, mmap=True)``: torch opens the
  file, reads the zip directory, takes os.path.getsize, then opens the path
  again, mmaps it and closes that fd. The same steps are timed here on a small
  torch.save'd checkpoint (a zipfile-written one without torch), from before the
  first open until the mapping exists; the race window (a replace of the path
  inside it tears the load) ends when the second open returns, as the second
  descriptor is then bound to a version; and, with torch installed, the whole
  ``torch.load(mmap=True, weights_only=True)`` call; the name cached in both, as
  after ``os.path.exists(path)``, and the race window inside that call (from
  torch's own open of the path until its second open returns, and until it
  starts, timed by wrapping the two calls in this process; and torch's
  first open() call alone, which holds most of the FUSE requests; see
  TorchLoad);
- the same windows on the first load of a new version: each checkpoint
  rewritten (a temporary name, then os.replace, as a trainer's save does) and
  flushed, untimed, right before; nothing of it is in the reader's page cache
  on ckptfs, so its reads reach the daemon, and each read makes the kernel ask
  for the attributes again at the next stat;
- with torch, the race window inside ``torch.load(mmap=True)`` of loads
  --gap seconds apart (--spaced loads of one checkpoint per round, nothing
  in between, not even a stat): a job's restore, or a reader polling for a
  new checkpoint, rather than a loop. Everything is cold then, the kernel's
  entries and attributes of the mount have run out, and the first request
  pays the daemon's wake-up (docs/PERFORMANCE.md, "Cold loads").

Per round it takes the median and the 90th percentile of each operation; the
report gives the median over the rounds (after one untimed warm-up round) and
the ratio ckptfs / plain. A watchdog aborts the FUSE connection if the run
exceeds --timeout, and the mount is always unmounted at the end. It prints
measured numbers; it asserts no thresholds.
"""

from __future__ import annotations

import argparse
import gc
import io
import mmap
import os
import statistics
import sys
import threading
import time
import zipfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckptfs.fs.fuse.operations import ATTR_TIMEOUT
from ckptfs.tools.bench.benchlib import (
    BenchError,
    Layout,
    add_shm_workdir_options,
    ckptfs,
    machine,
    markdown_lines,
    mount,
    print_lines,
    run_in_shm_workdir,
    stat_json,
    table_lines,
)

TARGETS = ("ckptfs", "plain")
FILE_BYTES = 4096  # each existing file's size
ZIP_FILES = 8  # checkpoints the reopen window cycles over
ZIP_TENSORS = 64  # tensors in each
ZIP_TENSOR_BYTES = 64 << 10
CACHE_SIZE = "256MiB"
FLUSH_TIMEOUT = 120.0
EXPIRE = ATTR_TIMEOUT + 0.2  # sleep this long for the kernel's cache of the mount to expire
OPS = (
    "stat, cache expired",
    "stat, name cached",
    "open+close, name cached",
    "open+close, cache expired",
    "create+close",
    "rename",
    "unlink",
    "reopen window",
    "  open + zip directory",
    "  getsize + reopen + mmap",
    "race window",
    "reopen window, new version",
    "race window, new version",
    "torch.load(mmap=True)",
    "  race window inside it",
    "  until its reopen starts",
    "  its first open() call",
    "spaced loads: race window",
    "  spaced: until its reopen starts",
    "  spaced: its first open() call",
)


def now_ns() -> int:
    return time.perf_counter_ns()


# ----- the operations ---------------------------------------------------------------------


def open_close(path: Path) -> None:
    os.close(os.open(path, os.O_RDONLY | os.O_CLOEXEC))


def create_close(path: Path) -> None:
    os.close(os.open(path, os.O_CREAT | os.O_WRONLY | os.O_EXCL | os.O_CLOEXEC, 0o644))


def time_each(
    fn: Callable[[Path], object],
    paths: Iterable[Path],
    before: Callable[[Path], object] | None = None,
) -> list[int]:
    """Nanoseconds of ``fn(path)`` for each path, one call at a time, without the GC;
    ``before(path)``, untimed, right before each call."""
    out: list[int] = []
    gc.disable()
    try:
        for path in paths:
            if before is not None:
                before(path)
            start = now_ns()
            fn(path)
            out.append(now_ns() - start)
    finally:
        gc.enable()
    return out


def reopen_window(path: Path) -> tuple[int, int, int]:
    """What torch.load(path, mmap=True) does before it has its mapping.

    Returns nanoseconds: first open + zip directory, getsize + reopen + mmap,
    and the race window: from the first open's start until the second open
    returns. A replace of the path inside it tears the load; after it, both
    descriptors are bound to their versions and the mmap and close cannot.
    """
    start = now_ns()
    with open(path, "rb") as f:
        f.read(4)  # torch's _is_zipfile
        f.seek(0)
        with zipfile.ZipFile(f) as z:  # the reader parses the central directory
            z.namelist()
            read = now_ns()
            size = os.path.getsize(path)  # torch.load, before UntypedStorage.from_file
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)  # from_file: open, fstat, mmap, close
            reopened = now_ns()
            try:
                os.fstat(fd)
                mapping = mmap.mmap(fd, size, mmap.MAP_PRIVATE, mmap.PROT_READ)
            finally:
                os.close(fd)
            mapped = now_ns()
            mapping.close()
    return read - start, mapped - read, reopened - start


def time_windows(paths: list[Path]) -> tuple[list[int], list[int], list[int], list[int]]:
    """(whole window, first part, second part, race window) in ns for each
    path, its name cached (a stat right before, untimed)."""
    whole: list[int] = []
    first: list[int] = []
    second: list[int] = []
    race: list[int] = []
    gc.disable()
    try:
        for path in paths:
            os.stat(path)
            a, b, r = reopen_window(path)
            whole.append(a + b)
            first.append(a)
            second.append(b)
            race.append(r)
    finally:
        gc.enable()
    return whole, first, second, race


class TorchLoad:
    """``torch.load(path, mmap=True, weights_only=True)``, and the race window
    inside it: from torch's own ``open()`` of the path until its second open
    (``UntypedStorage.from_file``) returns; until that second open starts;
    and, to show where the window goes, the first open() call alone (Python's
    open: the path walk, the OPEN, and the IOCTL of its isatty; through FUSE,
    after an idle second, also the mount root's GETATTR and the name's LOOKUP).

    Not a race window by itself: a replace tears the load once the first
    open's path walk has bound the name (at the walk's start when the name
    is cached, at its LOOKUP's reply when the kernel had to ask), so the
    OPEN and the IOCTL that follow are inside the window. What the first
    call does not hold (torch's parse, its getsize, the second open's start)
    is the rest of "until its reopen starts".

    The second: a replace by this node's processes tears the load only
    before the second open's path walk, which binds it to an inode, as on
    any filesystem; ckptfs's OPEN that follows is for that inode, and when
    it needs no manifest check (one was made within ``fuse.open_recheck``,
    as in this loop) it answers with that inode's version whatever happens
    to the name meanwhile. When a check is due, a replace that the check
    sees makes it answer ESTALE and the kernel walk the path again: then the
    window runs on to the check, and the first measure is the one to take.

    The window is timed by wrapping those two calls in this process only
    (torch.serialization's ``open`` and ``UntypedStorage.from_file``): torch's
    C++ zip reader parses the directory faster than Python's zipfile, so the
    part a replace can tear is narrower on a plain directory than
    :func:`reopen_window`'s, and the FUSE requests in it weigh more."""

    def __init__(self) -> None:
        import torch
        import torch.serialization

        self._torch = torch
        self._opened = self._open_returned = self._reopening = self._reopened = 0
        builtin_open = open
        from_file = torch.UntypedStorage.from_file

        def timed_open(*args: Any, **kwargs: Any) -> Any:
            self._opened = now_ns()
            f = builtin_open(*args, **kwargs)
            self._open_returned = now_ns()
            return f

        def timed_from_file(*args: Any, **kwargs: Any) -> Any:
            self._reopening = now_ns()
            storage = from_file(*args, **kwargs)
            self._reopened = now_ns()
            return storage

        torch.serialization.open = timed_open  # type: ignore[attr-defined]
        torch.UntypedStorage.from_file = timed_from_file  # type: ignore[method-assign]

    def __call__(self, path: Path) -> object:
        return self._torch.load(path, mmap=True, weights_only=True)

    def windows(self, path: Path) -> tuple[int, int, int]:
        """One load; its race window in ns, until the second open returns
        and until it starts, and its first open() call."""
        self._opened = self._open_returned = self._reopening = self._reopened = 0
        self(path)
        if not (
            self._opened and self._reopened > self._reopening > self._open_returned > self._opened
        ):
            raise BenchError(f"torch.load({path}, mmap=True) did not open the path twice")
        return (
            self._reopened - self._opened,
            self._reopening - self._opened,
            self._open_returned - self._opened,
        )


def torch_loader() -> TorchLoad | None:
    try:
        return TorchLoad()
    except ImportError:
        return None


def write_checkpoint(path: Path, seed: int) -> None:
    """A small torch.save'd checkpoint (a zip of ZIP_TENSORS tensors); zipfile without torch."""
    try:
        import torch
    except ImportError:
        torch = None  # type: ignore[assignment]
    if torch is not None:
        gen = torch.Generator().manual_seed(seed)
        n = ZIP_TENSOR_BYTES // 4
        sd = {f"layer.{i}.weight": torch.randn(n, generator=gen) for i in range(ZIP_TENSORS)}
        buf = io.BytesIO()
        torch.save(sd, buf)
        data = buf.getvalue()
    else:
        buf = io.BytesIO()
        with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as z:
            z.writestr("archive/data.pkl", b"\x80\x02}q\x00.")
            for i in range(ZIP_TENSORS):
                z.writestr(f"archive/data/{i}", os.urandom(ZIP_TENSOR_BYTES))
        data = buf.getvalue()
    with open(path, "wb") as f:
        f.write(data)


# ----- a target -----------------------------------------------------------------------------


@dataclass
class Target:
    name: str
    root: Path  # the directory the files are in
    quiesce: Callable[[], None]
    files: list[Path] = field(default_factory=list)
    checkpoints: list[Path] = field(default_factory=list)
    zips: list[Path] = field(default_factory=list)  # the checkpoints, cycled

    def prepare(self, n: int, windows: int) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        payload = os.urandom(FILE_BYTES)
        self.files = [self.root / f"f-{i:05d}" for i in range(n)]
        for path in self.files:
            with open(path, "wb") as f:
                f.write(payload)
        self.checkpoints = [self.root / f"ckpt-{k}.pt" for k in range(ZIP_FILES)]
        for k, path in enumerate(self.checkpoints):
            write_checkpoint(path, k)
        self.zips = [self.checkpoints[i % ZIP_FILES] for i in range(windows)]
        self.quiesce()

    def new_versions(self, seed: int) -> None:
        """Every checkpoint saved again, as a trainer does: a temporary name, then os.replace."""
        for k, path in enumerate(self.checkpoints):
            tmp = path.with_name(path.name + ".tmp")
            write_checkpoint(tmp, seed * ZIP_FILES + k)
            os.replace(tmp, path)
        self.quiesce()


Samples = dict[str, list[int]]


def one_round(
    target: Target, tag: str, seed: int, load: TorchLoad | None, spaced: tuple[int, float]
) -> Samples:
    """Every operation once per file; returns ns samples by operation."""
    s: Samples = {}
    # "cache expired": nothing looked at the names for longer than the mount's
    # attribute timeout; "name cached": a stat of the same name right before.
    time.sleep(EXPIRE)
    s["stat, cache expired"] = time_each(os.stat, target.files)
    s["stat, name cached"] = time_each(os.stat, target.files, before=os.stat)
    s["open+close, name cached"] = time_each(open_close, target.files, before=os.stat)
    time.sleep(EXPIRE)
    s["open+close, cache expired"] = time_each(open_close, target.files)

    new = [target.root / f"c-{tag}-{i:05d}" for i in range(len(target.files))]
    moved = [target.root / f"r-{tag}-{i:05d}" for i in range(len(target.files))]
    s["create+close"] = time_each(create_close, new)
    target.quiesce()
    renames = dict(zip(new, moved, strict=True))
    s["rename"] = time_each(lambda p: os.rename(p, renames[p]), new)
    target.quiesce()
    s["unlink"] = time_each(os.unlink, moved)
    target.quiesce()

    # Names cached, as for torch.load right after os.path.exists(path).
    whole, first, second, race = time_windows(target.zips)
    s["reopen window"], s["  open + zip directory"], s["  getsize + reopen + mmap"] = (
        whole,
        first,
        second,
    )
    s["race window"] = race
    s["reopen window, new version"], s["race window, new version"] = [], []
    for n in range(0, len(target.zips), ZIP_FILES):
        target.new_versions(seed + n)
        whole, _, _, race = time_windows(target.checkpoints[: len(target.zips) - n])
        s["reopen window, new version"] += whole
        s["race window, new version"] += race
    if load is not None:
        s["torch.load(mmap=True)"] = time_each(load, target.zips, before=os.stat)
        (
            s["  race window inside it"],
            s["  until its reopen starts"],
            s["  its first open() call"],
        ) = load_windows(load, target.zips)
        count, gap = spaced
        if count:
            (
                s["spaced loads: race window"],
                s["  spaced: until its reopen starts"],
                s["  spaced: its first open() call"],
            ) = spaced_load_windows(load, target.checkpoints[0], count, gap)
    return s


Windows = tuple[list[int], list[int], list[int]]


def load_windows(load: TorchLoad, paths: list[Path]) -> Windows:
    """The race windows of each torch.load(mmap=True), its name cached:
    until the second open returns, until it starts, and the first open() call."""
    windows: Windows = ([], [], [])
    gc.disable()
    try:
        for path in paths:
            os.stat(path)
            for samples, value in zip(windows, load.windows(path), strict=True):
                samples.append(value)
    finally:
        gc.enable()
    return windows


def spaced_load_windows(load: TorchLoad, path: Path, count: int, gap: float) -> Windows:
    """The race windows of ``count`` loads of ``path``, ``gap`` seconds
    apart with nothing in between: until the second open returns, until it
    starts, and the first open() call."""
    windows: Windows = ([], [], [])
    for _ in range(count):
        time.sleep(gap)
        gc.disable()
        try:
            measured = load.windows(path)
        finally:
            gc.enable()
        for samples, value in zip(windows, measured, strict=True):
            samples.append(value)
    return windows


# ----- the report -----------------------------------------------------------------------------


def p90(values: list[int]) -> float:
    if len(values) < 2:  # --spaced 1: one load a round
        return float(values[0])
    return statistics.quantiles(values, n=10, method="inclusive")[8]


@dataclass
class Summary:
    median: float  # median over the rounds of the per-round medians (ns)
    p90: float  # the same for the per-round 90th percentiles
    spread: tuple[float, float]  # the smallest and largest per-round median


def summarize(rounds: list[Samples], op: str) -> Summary | None:
    per_round = [r[op] for r in rounds if r.get(op)]
    if not per_round:
        return None
    medians = [statistics.median(v) for v in per_round]
    return Summary(
        statistics.median(medians),
        statistics.median(p90(v) for v in per_round),
        (min(medians), max(medians)),
    )


def us(ns: float) -> str:
    return f"{ns / 1e3:.1f}"


HEADER = (
    "operation",
    "ckptfs median µs",
    "ckptfs p90 µs",
    "plain median µs",
    "plain p90 µs",
    "ratio median",
    "ratio p90",
    "ckptfs round medians µs",
)


def report_rows(results: dict[str, list[Samples]]) -> list[list[str]]:
    rows = []
    for op in OPS:
        mnt, plain = summarize(results["ckptfs"], op), summarize(results["plain"], op)
        if mnt is None or plain is None:
            continue
        rows.append(
            [
                op,
                us(mnt.median),
                us(mnt.p90),
                us(plain.median),
                us(plain.p90),
                f"{mnt.median / plain.median:.1f}x",
                f"{mnt.p90 / plain.p90:.1f}x",
                f"{us(mnt.spread[0])}-{us(mnt.spread[1])}",
            ]
        )
    return rows


def context(
    args: argparse.Namespace,
    layout: Layout,
    status: dict[str, Any],
    torch: bool,
    load: tuple[float, float],
) -> list[str]:
    return [
        f"machine: {machine()}, Python {sys.version.split()[0]}; load average (1 min) "
        f"{load[0]:.1f} at the start, {load[1]:.1f} at the end",
        f"ckptfs: durability {status['durability']}, backing dir {layout.backing}, cache "
        f"{status['cache']['capacity'] >> 20} MiB in {layout.cache}; plain dir {layout.disk} "
        "(same filesystem as the backing dir)",
        f"{args.rounds} rounds after an untimed warm-up round, {args.ops} files of "
        f"{FILE_BYTES} bytes per operation per round, targets in alternating order; "
        "medians and p90 per round, then the median over the rounds",
        f"kernel entry and attribute timeout of the mount: {ATTR_TIMEOUT:g}s ('cache expired': "
        f"a pass over the files after sleeping {EXPIRE:g}s; 'name cached': a stat of the same "
        "name right before each call, untimed)",
        "create, rename and unlink: `ckptfs flush --wait` between the steps, untimed",
        f"reopen window: first open, 4-byte magic read, zip central directory (zipfile), "
        f"os.path.getsize, second open + fstat + mmap(MAP_PRIVATE) + close, on "
        f"{'torch.save' if torch else 'zipfile'}-written checkpoints of {ZIP_TENSORS} x "
        f"{ZIP_TENSOR_BYTES >> 10} KiB, cycled over {ZIP_FILES} files, each name cached (a stat "
        "right before, untimed, as after os.path.exists); race window: from the first open's "
        "start until the second open returns (a replace after that cannot tear the load); "
        "'new version': the same on the first load of each checkpoint after it was saved "
        "again (temporary name, os.replace) and flushed, untimed; torch.load the same way "
        "as 'reopen window'; its race window: from torch's own open() of the path until "
        "its second open (UntypedStorage.from_file) returns, timed by wrapping the two; "
        "'its first open() call': torch's open() of the path alone (see TorchLoad)",
        f"spaced loads: {args.spaced} torch.load(mmap=True) of one checkpoint per round, "
        f"{args.gap:g}s apart, nothing in between (no stat)",
        "ratio = ckptfs / plain (time); µs = microseconds",
    ]


def print_report(rows: list[list[str]], lines: list[str]) -> None:
    align = "l" + "r" * (len(HEADER) - 1)
    print()
    print_lines(lines)
    print()
    print_lines(table_lines(HEADER, rows, align))
    print("\nMarkdown:\n")
    print_lines([f"- {line}" for line in lines])
    print()
    print_lines(markdown_lines(HEADER, rows, align))


# ----- the watchdog -----------------------------------------------------------------------------


def fuse_connection(mountpoint: Path) -> str | None:
    """The FUSE connection number of ``mountpoint`` (its device minor), from mountinfo."""
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            if len(fields) > 4 and fields[4] == str(mountpoint):
                major, _, minor = fields[2].partition(":")
                return minor if major == "0" else None
    return None


class Watchdog:
    """After ``seconds``, abort the mount's FUSE connection: a hung daemon then
    fails every pending and later request (ENOTCONN) instead of blocking the run."""

    def __init__(self, mountpoint: Path, seconds: float) -> None:
        self.mountpoint = mountpoint
        self.fired = False
        self._timer = threading.Timer(seconds, self._fire)
        self._timer.daemon = True

    def __enter__(self) -> Watchdog:
        self._timer.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._timer.cancel()

    def _fire(self) -> None:
        self.fired = True
        conn = fuse_connection(self.mountpoint)
        print(f"bench_meta: --timeout reached; aborting FUSE connection {conn}", file=sys.stderr)
        if conn is None:
            return
        try:
            Path(f"/sys/fs/fuse/connections/{conn}/abort").write_text("1")
        except OSError as exc:
            print(f"bench_meta: warning: cannot abort the connection: {exc}", file=sys.stderr)


# ----- main -----------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m ckptfs.tools.bench.bench_meta", description=__doc__.splitlines()[0]
    )
    p.add_argument("--ops", type=int, default=300, help="files per operation per round")
    p.add_argument("--rounds", type=int, default=5, help="measured rounds (default 5)")
    p.add_argument("--windows", type=int, help="reopen windows per round (default: --ops / 2)")
    add_shm_workdir_options(p, CACHE_SIZE)
    p.add_argument("--no-torch", action="store_true", help="do not time torch.load")
    p.add_argument(
        "--spaced", type=int, default=6, help="spaced torch.loads per round (default 6; 0: none)"
    )
    p.add_argument(
        "--gap",
        type=float,
        default=ATTR_TIMEOUT + 0.2,
        help=f"seconds between spaced loads (default {ATTR_TIMEOUT + 0.2:g})",
    )
    p.add_argument(
        "--timeout", type=float, default=1800.0, help="abort the run after seconds (default 1800)"
    )
    args = p.parse_args(argv)
    if args.ops < 10 or args.rounds < 1:
        p.error("--ops must be >= 10 and --rounds >= 1")
    if args.spaced < 0 or args.gap < 0:
        p.error("--spaced and --gap must be >= 0")
    args.windows = args.windows or max(10, args.ops // 2)
    return args


def benchmark(args: argparse.Namespace, layout: Layout) -> None:
    mount(layout, args.cache_size, args.config)
    status = stat_json(layout, layout.mountpoint)
    print(f"mounted {layout.mountpoint}; cache of {status['cache']['capacity'] >> 20} MiB")

    def flush_wait() -> None:
        ckptfs(
            layout,
            *("flush", str(layout.mountpoint), "--wait", "--timeout", str(FLUSH_TIMEOUT)),
            timeout=FLUSH_TIMEOUT + 30,
        )

    targets = {
        "ckptfs": Target("ckptfs", layout.mountpoint / "meta", flush_wait),
        "plain": Target("plain", layout.disk / "meta", lambda: None),
    }
    load = None if args.no_torch else torch_loader()
    results: dict[str, list[Samples]] = {name: [] for name in TARGETS}
    loadavg_start = os.getloadavg()[0]
    with Watchdog(layout.mountpoint, args.timeout) as watchdog:
        try:
            for t in targets.values():
                t.prepare(args.ops, args.windows)
            print(f"wrote {args.ops} files and {ZIP_FILES} checkpoints in each target")
            for i in range(-1, args.rounds):
                order = TARGETS if i % 2 == 0 else TARGETS[::-1]
                start = time.perf_counter()
                for name in order:
                    samples = one_round(
                        targets[name],
                        f"{i + 1}-{name}",
                        (i + 2) * 1000,
                        load,
                        (args.spaced, args.gap),
                    )
                    if i >= 0:
                        results[name].append(samples)
                what = "warm-up round" if i < 0 else f"round {i + 1}/{args.rounds}"
                print(f"{what} ({', '.join(order)}) in {time.perf_counter() - start:.1f}s")
        except OSError as exc:
            why = " (--timeout reached: connection aborted)" if watchdog.fired else ""
            raise BenchError(f"{exc}{why}") from None
    loadavg = (loadavg_start, os.getloadavg()[0])
    print_report(report_rows(results), context(args, layout, status, load is not None, loadavg))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return run_in_shm_workdir("bench_meta", args, benchmark)


if __name__ == "__main__":
    sys.exit(main())
