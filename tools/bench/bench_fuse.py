"""Where the time of a FUSE write goes: a pyfuse3 write microbenchmark, without ckptfs.

    python -m ckptfs.tools.bench.bench_fuse [--size-mib 1024] [--runs 3]

Mounts a tiny pyfuse3 filesystem of its own (one directory of files, in a
subprocess) with one of these write handlers:

- noop: returns len(buf) and keeps nothing;
- copy-inline: os.pwrite of buf into a pre-faulted tmpfs file, on the event loop;
- copy-thread: the same pwrite through trio.to_thread.run_sync;

each with enable_writeback_cache on and off. For each, a separate writer
process writes --size-mib with a loop of 1 MiB os.write calls and closes the
file, timed from open until close returns (as dd would); the same writer into
/dev/shm is the baseline. Each (run, variant) gets a fresh mount; the variant
order rotates from run to run. The filesystem records the size of every write
request, when it arrived and how long the handler took; the CPU time of the
writer, of the daemon and of everything else (kernel writeback workers, other
processes) is read from /proc around each write.

Before every timed write it touches and frees 2 x --size-mib of anonymous
memory (--no-rewarm turns that off), so that the page cache and tmpfs pages
the write allocates are pages the VM has touched before: on a VM, first-touch
faults can be several times slower and would otherwise land on whichever
variant allocates new pages first. It prints measured numbers; it asserts
nothing.
"""

from __future__ import annotations

import argparse
import bisect
import errno
import functools
import json
import os
import resource
import shutil
import stat
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import pyfuse3
import trio
from ckptfs.tools.bench.benchlib import (
    GIB,
    MIB,
    UNMOUNT_TIMEOUT,
    BenchError,
    Rewarm,
    available_memory,
    cpu_busy_s,
    detach,
    is_mounted,
    machine,
    markdown_lines,
    meminfo,
    print_lines,
    process_cpu_s,
    table_lines,
)

MODULE = "ckptfs.tools.bench.bench_fuse"  # run again as the daemon and the writer
HANDLERS = ("noop", "copy-inline", "copy-thread")
MOUNT_TIMEOUT = 120.0
CHILD_EXIT_TIMEOUT = 15.0
T = TypeVar("T")


# ===== the filesystem (runs in the child) ==========================================


def guarded(fn: Callable[..., Awaitable[T]]) -> Callable[..., Awaitable[T]]:
    """pyfuse3 answers only FUSEError; anything else would take the mount down."""

    @functools.wraps(fn)
    async def wrapper(*args: Any) -> T:
        try:
            return await fn(*args)
        except pyfuse3.FUSEError:
            raise
        except OSError as exc:
            print(f"bench_fuse: {fn.__name__} failed: {exc}", file=sys.stderr, flush=True)
            raise pyfuse3.FUSEError(exc.errno or errno.EIO) from None
        except Exception as exc:  # any bug must become EIO, not a dead mount
            print(f"bench_fuse: {fn.__name__} failed: {exc!r}", file=sys.stderr, flush=True)
            raise pyfuse3.FUSEError(errno.EIO) from None

    return wrapper


@dataclass
class Node:
    ino: int
    mode: int
    size: int = 0
    nlink: int = 1
    lookups: int = 0
    mtime_ns: int = field(default_factory=time.time_ns)


@dataclass
class WriteStats:
    sizes: Counter[int] = field(default_factory=Counter)
    arrivals_ns: list[int] = field(default_factory=list)  # CLOCK_MONOTONIC, request start
    handler_ns: int = 0
    in_flight: int = 0
    max_in_flight: int = 0
    reads: int = 0
    read_bytes: int = 0

    def as_json(self) -> dict[str, Any]:
        return {
            "sizes": {str(k): v for k, v in self.sizes.items()},
            "arrivals_ns": self.arrivals_ns,
            "handler_s": self.handler_ns / 1e9,
            "max_in_flight": self.max_in_flight,
            "reads": self.reads,
            "read_bytes": self.read_bytes,
        }


class BenchOps(pyfuse3.Operations):
    """One directory (the root) of regular files; the data goes to ``backing_fd``
    (copy handlers) or nowhere (noop). Every file shares the one backing file:
    the benchmark writes one file per mount."""

    def __init__(self, handler: str, writeback: bool, backing_fd: int, capacity: int) -> None:
        super().__init__()
        self.enable_writeback_cache = writeback
        self.handler = handler
        self.backing_fd = backing_fd
        self.capacity = capacity
        now = time.time_ns()
        root = Node(pyfuse3.ROOT_INODE, stat.S_IFDIR | 0o755, nlink=2, mtime_ns=now)
        self.nodes: dict[int, Node] = {root.ino: root}
        self.names: dict[bytes, int] = {}
        self.next_ino = pyfuse3.ROOT_INODE + 1
        self.open_files: dict[int, int] = {}  # fh -> inode
        self.next_fh = 1
        self.stats = WriteStats()

    # ----- helpers -----
    def _node(self, ino: int) -> Node:
        node = self.nodes.get(ino)
        if node is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        return node

    def _attr(self, node: Node) -> pyfuse3.EntryAttributes:
        e = pyfuse3.EntryAttributes()
        e.st_ino = node.ino
        e.generation = 0
        e.entry_timeout = 300
        e.attr_timeout = 300
        e.st_mode = node.mode
        e.st_nlink = node.nlink
        e.st_uid = os.getuid()
        e.st_gid = os.getgid()
        e.st_rdev = 0
        e.st_size = node.size
        e.st_blksize = MIB
        e.st_blocks = -(-node.size // 512)
        e.st_atime_ns = e.st_mtime_ns = e.st_ctime_ns = node.mtime_ns
        return e

    def _lookup_ref(self, node: Node) -> pyfuse3.EntryAttributes:
        node.lookups += 1
        return self._attr(node)

    def _maybe_free(self, node: Node) -> None:
        if node.ino != pyfuse3.ROOT_INODE and node.lookups <= 0 and node.nlink == 0:
            if node.ino not in self.open_files.values():
                del self.nodes[node.ino]

    def _open_fh(self, ino: int) -> int:
        fh = self.next_fh
        self.next_fh += 1
        self.open_files[fh] = ino
        return fh

    # ----- metadata -----
    @guarded
    async def lookup(self, parent_inode: int, name: bytes, ctx: Any) -> pyfuse3.EntryAttributes:
        if parent_inode != pyfuse3.ROOT_INODE:
            raise pyfuse3.FUSEError(errno.ENOENT)
        if name in (b".", b".."):
            return self._lookup_ref(self.nodes[pyfuse3.ROOT_INODE])
        ino = self.names.get(name)
        if ino is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        return self._lookup_ref(self.nodes[ino])

    @guarded
    async def forget(self, inode_list: Any) -> None:
        for ino, count in inode_list:
            node = self.nodes.get(ino)
            if node is not None:
                node.lookups -= count
                self._maybe_free(node)

    @guarded
    async def getattr(self, inode: int, ctx: Any) -> pyfuse3.EntryAttributes:
        return self._attr(self._node(inode))

    @guarded
    async def setattr(
        self, inode: int, attr: Any, fields: Any, fh: int | None, ctx: Any
    ) -> pyfuse3.EntryAttributes:
        node = self._node(inode)
        if fields.update_size:
            node.size = attr.st_size
        if fields.update_mode:
            node.mode = stat.S_IFMT(node.mode) | stat.S_IMODE(attr.st_mode)
        if fields.update_mtime:
            node.mtime_ns = attr.st_mtime_ns
        return self._attr(node)

    @guarded
    async def statfs(self, ctx: Any) -> pyfuse3.StatvfsData:
        s = pyfuse3.StatvfsData()
        s.f_bsize = s.f_frsize = 4096
        s.f_blocks = s.f_bfree = s.f_bavail = self.capacity // 4096
        s.f_files = s.f_ffree = s.f_favail = 1 << 20
        s.f_namemax = 255
        return s

    @guarded
    async def opendir(self, inode: int, ctx: Any) -> int:
        if inode != pyfuse3.ROOT_INODE:
            raise pyfuse3.FUSEError(errno.ENOTDIR)
        return 0

    @guarded
    async def readdir(self, fh: int, start_id: int, token: Any) -> None:
        # Offsets are inode numbers, never reused: stable while the directory changes.
        for name, ino in sorted(self.names.items(), key=lambda item: item[1]):
            if ino <= start_id:
                continue
            node = self.nodes[ino]
            if not pyfuse3.readdir_reply(token, name, self._attr(node), ino):
                break
            node.lookups += 1

    @guarded
    async def releasedir(self, fh: int) -> None:
        pass

    @guarded
    async def create(
        self, parent_inode: int, name: bytes, mode: int, flags: int, ctx: Any
    ) -> tuple[pyfuse3.FileInfo, pyfuse3.EntryAttributes]:
        if parent_inode != pyfuse3.ROOT_INODE:
            raise pyfuse3.FUSEError(errno.ENOENT)
        if name in self.names:
            raise pyfuse3.FUSEError(errno.EEXIST)
        node = Node(self.next_ino, stat.S_IFREG | stat.S_IMODE(mode))
        self.next_ino += 1
        self.nodes[node.ino] = node
        self.names[name] = node.ino
        return pyfuse3.FileInfo(fh=self._open_fh(node.ino)), self._lookup_ref(node)

    @guarded
    async def open(self, inode: int, flags: int, ctx: Any) -> pyfuse3.FileInfo:
        node = self._node(inode)
        if flags & os.O_TRUNC:
            node.size = 0
        return pyfuse3.FileInfo(fh=self._open_fh(node.ino))

    @guarded
    async def unlink(self, parent_inode: int, name: bytes, ctx: Any) -> None:
        ino = self.names.pop(name, None)
        if ino is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        node = self.nodes[ino]
        node.nlink = 0
        self._maybe_free(node)

    # ----- data -----
    @guarded
    async def read(self, fh: int, off: int, size: int) -> bytes:
        node = self._node(self.open_files[fh])
        size = max(0, min(size, node.size - off))
        self.stats.reads += 1
        self.stats.read_bytes += size
        if self.handler == "noop":
            return bytes(size)
        return os.pread(self.backing_fd, size, off)

    @guarded
    async def write(self, fh: int, off: int, buf: bytes) -> int:
        start = time.monotonic_ns()
        st = self.stats
        st.sizes[len(buf)] += 1
        st.arrivals_ns.append(start)
        st.in_flight += 1
        st.max_in_flight = max(st.max_in_flight, st.in_flight)
        try:
            node = self._node(self.open_files[fh])
            if self.handler != "noop":
                if off + len(buf) > self.capacity:
                    raise pyfuse3.FUSEError(errno.ENOSPC)
                if self.handler == "copy-inline":
                    done = os.pwrite(self.backing_fd, buf, off)
                else:
                    done = await trio.to_thread.run_sync(os.pwrite, self.backing_fd, buf, off)
                if done != len(buf):
                    raise pyfuse3.FUSEError(errno.EIO)
            node.size = max(node.size, off + len(buf))
            node.mtime_ns = time.time_ns()
            return len(buf)
        finally:
            st.in_flight -= 1
            st.handler_ns += time.monotonic_ns() - start

    @guarded
    async def flush(self, fh: int) -> None:
        pass

    @guarded
    async def fsync(self, fh: int, datasync: bool) -> None:
        pass

    @guarded
    async def release(self, fh: int) -> None:
        ino = self.open_files.pop(fh, None)
        if ino is not None and ino in self.nodes:
            self._maybe_free(self.nodes[ino])


def prefault_file(path: Path, size: int) -> int:
    """Create ``path`` (on tmpfs) and write every page of it; returns an O_RDWR fd."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    block = b"\x5a" * MIB
    for off in range(0, size, MIB):
        os.pwrite(fd, block[: min(MIB, size - off)], off)
    return fd


def serve(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="bench_fuse serve")
    p.add_argument("mountpoint")
    p.add_argument("--handler", choices=HANDLERS, required=True)
    p.add_argument("--writeback", choices=("on", "off"), required=True)
    p.add_argument("--backing-file", type=Path, required=True)
    p.add_argument("--capacity", type=int, required=True)
    p.add_argument("--stats-file", type=Path, required=True)
    args = p.parse_args(argv)

    fd = prefault_file(args.backing_file, args.capacity)
    ops = BenchOps(args.handler, args.writeback == "on", fd, args.capacity)
    options = set(pyfuse3.default_options) | {"fsname=benchfuse", "subtype=benchfuse"}
    pyfuse3.init(ops, args.mountpoint, options)
    try:
        trio.run(pyfuse3.main)
    finally:
        pyfuse3.close(unmount=True)
        os.close(fd)
    tmp = args.stats_file.with_suffix(".tmp")
    tmp.write_text(json.dumps(ops.stats.as_json()))
    tmp.rename(args.stats_file)
    return 0


# ===== the writer (runs in its own process) ========================================


def write_file(argv: list[str]) -> int:
    """Write ARGV[1] bytes to ARGV[0]; ARGV[2], if given, is the daemon's pid.

    Reads the machine's and the daemon's CPU time itself, so that the window is
    exactly the timed one (not this interpreter's start-up)."""
    path, size = argv[0], int(argv[1])
    daemon = int(argv[2]) if len(argv) > 2 else None
    buf = os.urandom(MIB)
    daemon0 = process_cpu_s(daemon) if daemon else 0.0
    busy0 = cpu_busy_s()
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.monotonic_ns()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    t_open = time.monotonic_ns()
    view = memoryview(buf)
    left = size
    while left > 0:
        n = os.write(fd, view[: min(MIB, left)])
        left -= n
    t_loop = time.monotonic_ns()
    os.close(fd)
    t_close = time.monotonic_ns()
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    busy = cpu_busy_s() - busy0
    daemon_cpu = process_cpu_s(daemon) - daemon0 if daemon else None
    print(
        json.dumps(
            {
                "start_ns": t0,
                "open_s": (t_open - t0) / 1e9,
                "loop_s": (t_loop - t_open) / 1e9,
                "close_s": (t_close - t_loop) / 1e9,
                "total_s": (t_close - t0) / 1e9,
                "loop_end_ns": t_loop,
                "user_s": r1.ru_utime - r0.ru_utime,
                "sys_s": r1.ru_stime - r0.ru_stime,
                "busy_s": busy,
                "daemon_cpu_s": daemon_cpu,
            }
        )
    )
    return 0


# ===== the driver ==================================================================


@dataclass(frozen=True)
class Variant:
    handler: str  # one of HANDLERS, or "tmpfs" for the baseline
    writeback: bool = False

    @property
    def label(self) -> str:
        if self.handler == "tmpfs":
            return "tmpfs (/dev/shm)"
        return f"{self.handler}, writeback {'on' if self.writeback else 'off'}"

    @property
    def slug(self) -> str:
        return f"{self.handler}-wb{int(self.writeback)}"


VARIANTS = [Variant(h, wb) for h in HANDLERS for wb in (True, False)] + [Variant("tmpfs")]


@dataclass
class Result:
    seconds: float
    loop_s: float
    close_s: float
    writer_cpu_s: float
    daemon_cpu_s: float | None = None
    other_cpu_s: float = 0.0
    requests: int = 0
    mean_request: float = 0.0
    received_in_loop: float | None = None  # share of the bytes the daemon had when the loop ended
    handler_s: float | None = None
    max_in_flight: int | None = None
    reads: int = 0
    sizes: Counter[int] = field(default_factory=Counter)


def bdi_settings(path: Path) -> str:
    dev = os.stat(path).st_dev
    bdi = Path(f"/sys/class/bdi/{os.major(dev)}:{os.minor(dev)}")
    out = []
    for name in ("max_ratio", "max_bytes", "strict_limit", "read_ahead_kb"):
        try:
            out.append(f"{name} {(bdi / name).read_text().strip()}")
        except OSError:
            pass
    return ", ".join(out)


class Driver:
    def __init__(self, args: argparse.Namespace, workdir: Path) -> None:
        self.size = args.size_mib * MIB
        self.workdir = workdir  # on tmpfs: the baseline, the backing files and the stats
        self.mountpoint = Path(tempfile.mkdtemp(prefix="ckptfs-bench-fuse-mnt-"))
        self.rewarm = Rewarm(0 if args.no_rewarm else 2 * self.size)
        self.write_timeout = max(120.0, self.size / 5e6)
        self.bdi = ""

    def cleanup(self) -> None:
        detach(self.mountpoint, "bench_fuse")
        try:
            self.mountpoint.rmdir()
        except OSError as exc:
            print(f"bench_fuse: warning: left {self.mountpoint}: {exc}", file=sys.stderr)

    def run_writer(self, path: Path, daemon_pid: int | None) -> dict[str, Any]:
        cmd = [sys.executable, "-m", MODULE, "_write", str(path)]
        cmd += [str(self.size)] + ([str(daemon_pid)] if daemon_pid else [])
        try:
            done = subprocess.run(
                cmd,
                capture_output=True,
                text=True,
                timeout=self.write_timeout,
                check=False,
            )
        except subprocess.TimeoutExpired:
            raise BenchError(
                f"writing {path} did not finish within {self.write_timeout:.0f}s"
            ) from None
        if done.returncode != 0:
            tail = done.stderr.strip().splitlines()
            raise BenchError(f"writer into {path} failed: {tail[-1] if tail else done.returncode}")
        return json.loads(done.stdout)

    def measure(self, path: Path, daemon_pid: int | None) -> tuple[Result, dict[str, Any]]:
        self.rewarm()
        w = self.run_writer(path, daemon_pid)
        writer_cpu = w["user_s"] + w["sys_s"]
        result = Result(w["total_s"], w["loop_s"], w["close_s"], writer_cpu)
        result.daemon_cpu_s = w["daemon_cpu_s"]
        # /proc/stat counts in clock ticks: small negative remainders are rounding.
        result.other_cpu_s = max(0.0, w["busy_s"] - writer_cpu - (result.daemon_cpu_s or 0.0))
        return result, w

    def run_tmpfs(self, index: int) -> Result:
        path = self.workdir / f"baseline-{index}"
        try:
            result, _ = self.measure(path, None)
        finally:
            path.unlink(missing_ok=True)
        return result

    @contextmanager
    def mounted(self, variant: Variant, index: int) -> Iterator[tuple[subprocess.Popen[str], Path]]:
        stats = self.workdir / f"stats-{variant.slug}-{index}.json"
        backing = self.workdir / f"backing-{variant.slug}-{index}"
        log = self.workdir / f"daemon-{variant.slug}-{index}.log"
        cmd = [sys.executable, "-m", MODULE, "_serve", str(self.mountpoint)]
        cmd += ["--handler", variant.handler, "--writeback", "on" if variant.writeback else "off"]
        cmd += ["--backing-file", str(backing), "--capacity", str(self.size)]
        cmd += ["--stats-file", str(stats)]
        with open(log, "w") as log_out:
            child = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=log_out,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # a ^C reaches only us; we unmount and stop it
                text=True,
            )
        try:
            deadline = time.monotonic() + MOUNT_TIMEOUT
            while not is_mounted(self.mountpoint):
                if child.poll() is not None:
                    raise BenchError(f"{variant.label}: daemon exited: {self._log_tail(log)}")
                if time.monotonic() > deadline:
                    raise BenchError(f"{variant.label}: not mounted within {MOUNT_TIMEOUT:.0f}s")
                time.sleep(0.05)
            if not self.bdi:
                self.bdi = bdi_settings(self.mountpoint)
            yield child, stats
            # Clean unmount: the daemon's main() returns and it writes its stats.
            done = subprocess.run(
                ["fusermount3", "-u", str(self.mountpoint)],
                capture_output=True,
                text=True,
                timeout=UNMOUNT_TIMEOUT,
                check=False,
            )
            if done.returncode != 0:
                raise BenchError(f"fusermount3 -u failed: {done.stderr.strip()}")
            child.wait(timeout=CHILD_EXIT_TIMEOUT)
            if child.returncode != 0:
                raise BenchError(f"{variant.label}: daemon failed: {self._log_tail(log)}")
            problems = [
                line
                for line in log.read_text().splitlines()
                if any(mark in line for mark in ("bench_fuse:", "Traceback", "failed with"))
            ]
            if problems:
                raise BenchError(f"{variant.label}: daemon reported: {problems[0]}")
        except subprocess.TimeoutExpired as exc:
            raise BenchError(f"{variant.label}: {exc}") from None
        finally:
            stop_child(child, self.mountpoint)
            backing.unlink(missing_ok=True)

    @staticmethod
    def _log_tail(log: Path) -> str:
        lines = log.read_text().strip().splitlines()
        return lines[-1] if lines else "(empty log)"

    def run_fuse(self, variant: Variant, index: int) -> Result:
        with self.mounted(variant, index) as (child, stats_file):
            path = self.mountpoint / f"file-{index}"
            result, w = self.measure(path, child.pid)
            os.unlink(path)  # drops the inode's page cache
        try:
            stats = json.loads(stats_file.read_text())
        except (OSError, ValueError) as exc:
            raise BenchError(f"{variant.label}: no statistics from the daemon: {exc}") from None
        finally:
            stats_file.unlink(missing_ok=True)
        sizes = Counter({int(k): v for k, v in stats["sizes"].items()})
        arrivals = stats["arrivals_ns"]
        result.sizes = sizes
        result.requests = sum(sizes.values())
        result.mean_request = sum(k * v for k, v in sizes.items()) / max(1, result.requests)
        result.handler_s = stats["handler_s"]
        result.max_in_flight = stats["max_in_flight"]
        result.reads = stats["reads"]
        # Requests are about the same size: count those that arrived before the
        # write() loop ended to estimate how much data flowed during the loop.
        in_loop = bisect.bisect_right(arrivals, w["loop_end_ns"])
        result.received_in_loop = in_loop / max(1, len(arrivals))
        return result

    def run_one(self, variant: Variant, index: int) -> Result:
        if variant.handler == "tmpfs":
            return self.run_tmpfs(index)
        return self.run_fuse(variant, index)


def stop_child(child: subprocess.Popen[str], mountpoint: Path) -> None:
    """Lazy-unmount if still mounted, then make sure the daemon is gone; never raises."""
    detach(mountpoint, "bench_fuse")
    if child.poll() is None:
        for stop in (child.terminate, child.kill):
            stop()
            try:
                child.wait(timeout=5)
                break
            except subprocess.TimeoutExpired:
                continue
    if child.poll() is None:
        print(f"bench_fuse: warning: daemon {child.pid} did not exit", file=sys.stderr)


# ----- report -----------------------------------------------------------------------

BUCKETS = [
    (0, 4096, "< 4 KiB"),
    (4096, 64 * 1024, "4-64 KiB"),
    (64 * 1024, 128 * 1024, "64-128 KiB"),
    (128 * 1024, 256 * 1024, "128-256 KiB"),
    (256 * 1024, 512 * 1024, "256-512 KiB"),
    (512 * 1024, MIB, "512 KiB-1 MiB"),
    (MIB, MIB + 1, "1 MiB"),
    (MIB + 1, 1 << 62, "> 1 MiB"),
]


def fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def med(values: list[Any]) -> Any:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def summary_rows(results: dict[Variant, list[Result]], size: int) -> list[list[str]]:
    rows = []
    for variant in VARIANTS:
        rs = results[variant]
        rates = [size / 1e6 / r.seconds for r in rs]
        fuse = variant.handler != "tmpfs"
        rows.append(
            [
                variant.label,
                f"{statistics.median(rates):.0f}",
                f"{min(rates):.0f}-{max(rates):.0f}",
                f"{med([r.loop_s for r in rs]):.3f}",
                f"{med([r.close_s for r in rs]):.3f}",
                fmt(med([r.received_in_loop for r in rs]), ".0%") if fuse else "-",
                f"{med([r.writer_cpu_s for r in rs]):.2f}",
                fmt(med([r.daemon_cpu_s for r in rs]), ".2f"),
                fmt(med([r.handler_s for r in rs]), ".2f"),
                f"{med([r.other_cpu_s for r in rs]):.2f}",
                f"{med([r.requests for r in rs]):.0f}" if fuse else "-",
                f"{med([r.mean_request for r in rs]) / 1024:.0f}" if fuse else "-",
                fmt(med([r.max_in_flight for r in rs]), ".0f"),
            ]
        )
    return rows


HEADER = [
    "variant",
    "MB/s",
    "min-max MB/s",
    "write() loop s",
    "close s",
    "data in by loop end",
    "writer CPU s",
    "daemon CPU s",
    "write handler s (sum)",
    "other CPU s",
    "write requests",
    "mean request KiB",
    "max in flight",
]


def histogram_rows(results: dict[Variant, list[Result]]) -> list[list[str]]:
    rows = []
    for variant in VARIANTS:
        if variant.handler == "tmpfs":
            continue
        total: Counter[int] = Counter()
        for r in results[variant]:
            total.update(r.sizes)
        n = sum(total.values())
        cells = []
        for lo, hi, _ in BUCKETS:
            count = sum(v for k, v in total.items() if lo <= k < hi)
            cells.append(f"{count} ({count / n:.0%})" if count else "0")
        reads = sum(r.reads for r in results[variant])
        rows.append([variant.label, str(n), *cells, str(reads)])
    return rows


def report(
    driver: Driver, results: dict[Variant, list[Result]], runs: int, orders: list[str]
) -> None:
    size = driver.size
    first = VARIANTS[0]
    exact: Counter[int] = Counter()
    for r in results[first]:
        exact.update(r.sizes)
    context = [
        f"{size >> 20} MiB per write test, 1 MiB os.write() calls + close from a separate "
        f"process, timed from open until close returned; {runs} run(s), median reported",
        f"machine: {machine(meminfo()['MemTotal'])}, "
        f"pyfuse3 {pyfuse3.__version__}, trio {trio.__version__}, "
        f"/proc/sys/fs/fuse/max_pages_limit {read_text('/proc/sys/fs/fuse/max_pages_limit')}, "
        f"vm.dirty_ratio {read_text('/proc/sys/vm/dirty_ratio')}, FUSE bdi: {driver.bdi}",
        "copy handlers pwrite into a pre-faulted tmpfs file; a fresh mount per (run, variant); "
        "variant order per run: " + "; ".join(orders),
        "data in by loop end: share of write requests that reached the daemon before the "
        "write() loop ended (the rest came during close); CPU columns are CPU-seconds in the "
        "timed window; write handler s sums each write handler's duration (overlapping "
        "ones in copy-thread count twice); other = the whole machine's busy time minus "
        "writer and daemon (kernel writeback workers, interrupts, other processes)",
    ]
    rewarm = driver.rewarm
    if rewarm.size:
        line = (
            f"before every timed write: touched and freed {rewarm.size / GIB:.2f} GiB of "
            f"anonymous memory (median {statistics.median(rewarm.seconds):.2f}s, untimed)"
        )
        if rewarm.short:
            line += f"; MemFree allowed only {min(rewarm.short) / GIB:.2f} GiB at times"
        context.append(line)
    else:
        context.append("no memory touched before the timed writes (--no-rewarm)")
    context.append("MB/s = 10^6 bytes per second")

    rows = summary_rows(results, size)
    hist_header = ["variant", "requests", *[b[2] for b in BUCKETS], "read requests"]
    hist = histogram_rows(results)
    top = ", ".join(f"{k} B x {v}" for k, v in exact.most_common(8))

    print()
    print_lines(context)
    print()
    print_lines(table_lines(HEADER, rows))
    print()
    print("write request sizes the handler saw (all runs):")
    print_lines(table_lines(hist_header, hist))
    print(f"most common exact sizes, {first.label}: {top}")

    print("\nMarkdown:\n")
    print_lines(context, bullet="- ")
    print()
    print_lines(markdown_lines(HEADER, rows))
    print()
    print_lines(markdown_lines(hist_header, hist))
    print()
    print(f"Most common exact request sizes, {first.label}: {top}")


def read_text(path: str) -> str:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return "?"


# ----- main -------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.splitlines()[0])
    p.add_argument("--size-mib", type=int, default=1024, help="bytes per write test (default 1024)")
    p.add_argument("--runs", type=int, default=3, help="measured runs per variant (default 3)")
    p.add_argument(
        "--no-rewarm",
        action="store_true",
        help="do not touch and free memory before every timed write",
    )
    args = p.parse_args(argv)
    if args.size_mib < 1 or args.runs < 1:
        p.error("--size-mib and --runs must be >= 1")
    return args


def benchmark(args: argparse.Namespace) -> None:
    size = args.size_mib * MIB
    # A pre-faulted backing file, the page cache of the written file, the baseline
    # copy and the re-touched memory can all be resident at once.
    need = 4 * size + GIB
    have = available_memory()
    if have < need:
        raise BenchError(f"needs about {need / GIB:.1f} GiB of memory, {have / GIB:.1f} available")
    if not shutil.which("fusermount3"):
        raise BenchError("fusermount3 not found")
    workdir = Path(tempfile.mkdtemp(prefix="ckptfs-bench-fuse-", dir="/dev/shm"))
    driver = Driver(args, workdir)
    try:
        results: dict[Variant, list[Result]] = {v: [] for v in VARIANTS}
        orders = []
        for run in range(args.runs):
            shift = run % len(VARIANTS)
            order = VARIANTS[shift:] + VARIANTS[:shift]
            orders.append(", ".join(v.slug for v in order))
            for variant in order:
                result = driver.run_one(variant, run)
                results[variant].append(result)
                print(
                    f"run {run + 1}/{args.runs} {variant.label:<28} "
                    f"{size / 1e6 / result.seconds:7.0f} MB/s  (loop {result.loop_s:.3f}s, "
                    f"close {result.close_s:.3f}s)",
                    flush=True,
                )
        report(driver, results, args.runs, orders)
    finally:
        driver.cleanup()
        shutil.rmtree(workdir, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_serve"]:
        return serve(argv[1:])
    if argv[:1] == ["_write"]:
        return write_file(argv[1:])
    args = parse_args(argv)
    try:
        benchmark(args)
        return 0
    except BenchError as exc:
        print(f"bench_fuse: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("bench_fuse: interrupted; unmounted and cleaned up", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
