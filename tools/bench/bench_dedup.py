"""Benchmark model-aware deduplication: bytes stored per checkpoint, and hashing speed.

    python -m ckptfs.tools.bench.bench_dedup [--size-gib 1] [--checkpoints 3] [--workdir DIR]

Mounts ckptfs through the CLI (backing directory on local disk under --workdir,
RAM cache in /dev/shm) and plays a fine-tuning job that freezes ~90% of a
GPT-like state dict of about --size-gib: the last transformer blocks (and the
final LayerNorm) are trainable and perturbed before every checkpoint after the
first, the rest never changes. Every checkpoint also adds a key to the saved
dict (``step`` and one more ``optimizer.param_groups.<n>`` entry), so the
pickle, which torch.save writes before the tensors, grows and every tensor
moves in the file. Each checkpoint is torch.save'd into
``<mnt>/run/checkpoint-<n>/model.pt`` and made durable with
``ckptfs flush <mnt> --wait``. For each it reports:

- without dedup: the file size, what a plain copy onto NFS would write;
- stored: the growth of ``flush.bytes_stored`` in ``ckptfs stat --json``, and
  the growth of ``<backing>/.ckptfs/chunks`` summed file by file as du does;
- fixed chunks: what content-addressed dedup would store if the file were cut
  every chunk_size bytes from offset 0 (computed here, over the same bytes);
- the daemon's close -> durable time (its history record), and how many times
  the file was flushed: `ckptfs flush --wait` queues a file that is being
  flushed a second time, and the flusher then flushes it twice, concurrently
  (``--wait poll`` waits by polling `ckptfs stat --json` instead). The counters
  are read once the flusher is idle, so that work is counted where it belongs.

Then, whether chunking and hashing keep up with the flusher: the flusher's own
``flush.hash_throughput`` next to the backing-store write throughput of the
first (all-new) checkpoint, and, after unmounting, in-process: xxh3-128 over a
--size-gib buffer in 4 MiB pieces (1 and 2 threads), ``plan_chunks`` on the
last checkpoint saved as a plain file (page cache cold and warm), and a plain
sequential write + fsync of --size-gib to the backing disk.

It prints measured numbers; it asserts no thresholds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import xxhash
from ckptfs.fs.config import load_config
from ckptfs.fs.store.chunking import plan_chunks
from ckptfs.fs.store.manifest import MAGIC
from ckptfs.tools.bench.benchlib import (
    GIB,
    MIB,
    N_LAYER,
    BenchError,
    Layout,
    build_state_dict,
    cache_size_for,
    ckptfs,
    fsync_path,
    machine,
    markdown_lines,
    mount,
    print_lines,
    run_mounted,
    save,
    stat_json,
    table_lines,
    timed,
    unmount,
    wait_durable,
)

MB = 1_000_000
HASH_PIECE = 4 * MIB
WRITE_PIECE = 16 * MIB
RANDOM_PIECE = 64 * MIB
HASH_REPEATS = 3
PERTURB_SCALE = 1e-2


# ----- the fine-tuning job ---------------------------------------------------------------


@dataclass
class Job:
    sd: dict[str, torch.Tensor]
    trainable: list[str]
    trainable_blocks: int
    gen: torch.Generator = field(default_factory=lambda: torch.Generator().manual_seed(1))
    extra: dict[str, Any] = field(default_factory=dict)  # grows by one key per checkpoint
    last: dict[str, Any] = field(default_factory=dict)  # the last checkpoint's object

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.sd.values())

    @property
    def trainable_bytes(self) -> int:
        return sum(self.sd[k].numel() * self.sd[k].element_size() for k in self.trainable)

    def train(self) -> None:
        """A few optimizer steps: every trainable tensor changes, frozen ones do not."""
        for k in self.trainable:
            t = self.sd[k]
            noise = torch.randn(t.shape, generator=self.gen).to(t.dtype)
            t.add_(noise, alpha=PERTURB_SCALE)

    def checkpoint(self, n: int) -> dict[str, Any]:
        """The object torch.save writes: the model plus keys that grow the pickle."""
        step = 100 * n
        # Well over 64 bytes of pickle per entry: torch aligns tensor data to 64
        # bytes, so a smaller addition could vanish into the padding.
        self.extra[f"optimizer.param_groups.{n}"] = {
            "lr": 3e-5 * 0.9**n,
            "betas": (0.9, 0.95),
            "weight_decay": 0.1,
            "initial_step": step,
            "name": f"fine-tune group {n} (blocks {N_LAYER - self.trainable_blocks}+)",
        }
        self.last = {**self.sd, "step": step, **self.extra}
        return self.last


def make_job(size: int, fraction: float) -> Job:
    sd = build_state_dict(size)
    total = sum(t.numel() * t.element_size() for t in sd.values())

    def block_bytes(i: int) -> int:
        prefix = f"transformer.h.{i}."
        return sum(t.numel() * t.element_size() for k, t in sd.items() if k.startswith(prefix))

    # Unfreeze blocks from the top down, as fine-tuning usually does, until
    # about ``fraction`` of the bytes are trainable.
    blocks = 0
    trainable_bytes = 0
    while blocks < N_LAYER:
        nxt = block_bytes(N_LAYER - 1 - blocks)
        if blocks and abs(trainable_bytes + nxt - fraction * total) > abs(
            trainable_bytes - fraction * total
        ):
            break
        trainable_bytes += nxt
        blocks += 1
    prefixes = tuple(f"transformer.h.{i}." for i in range(N_LAYER - blocks, N_LAYER))
    trainable = [k for k in sd if k.startswith(prefixes) or k.startswith("transformer.ln_f.")]
    return Job(sd, trainable, blocks)


# ----- measuring the backing store -------------------------------------------------------


@dataclass
class Usage:
    apparent: int = 0  # sum of file sizes
    allocated: int = 0  # sum of st_blocks * 512, what du reports
    files: int = 0


def disk_usage(root: Path) -> Usage:
    """du-like sum over the files under ``root`` (temporary chunk names included)."""
    usage = Usage()
    stack = [root]
    while stack:
        try:
            entries = list(os.scandir(stack.pop()))
        except FileNotFoundError:
            continue
        for e in entries:
            if e.is_dir(follow_symlinks=False):
                stack.append(Path(e.path))
            elif e.is_file(follow_symlinks=False):
                st = e.stat(follow_symlinks=False)
                usage.apparent += st.st_size
                usage.allocated += st.st_blocks * 512
                usage.files += 1
    return usage


def read_manifest(path: Path) -> dict[str, Any]:
    data = path.read_bytes()
    if not data.startswith(MAGIC):
        raise BenchError(f"{path} is not a ckptfs manifest")
    # The last record is the one in force (a flush appends its own).
    return json.loads(data[len(MAGIC) :].splitlines()[-1])


def hash_seconds(flush: dict[str, Any]) -> float:
    """Thread-seconds the flusher spent hashing, from its cumulative counters."""
    rate = flush.get("hash_throughput") or 0
    return flush["bytes_hashed"] / rate if rate else 0.0


@dataclass
class Zip:
    pickle: int  # bytes of data.pkl
    first_tensor: int  # offset of the first tensor's data in the file


def zip_layout(path: Path) -> Zip:
    with zipfile.ZipFile(path) as z, open(path, "rb") as f:
        infos = z.infolist()
        pickle = next((i.file_size for i in infos if i.filename.endswith("/data.pkl")), 0)
        tensors = [i for i in infos if "/data/" in i.filename]
        if not tensors:
            return Zip(pickle, 0)
        first = min(tensors, key=lambda i: i.header_offset)
        # The local header's extra field (torch's alignment padding) says where data starts.
        f.seek(first.header_offset + 26)
        name_len, extra_len = (int.from_bytes(f.read(2), "little") for _ in range(2))
        return Zip(pickle, first.header_offset + 30 + name_len + extra_len)


def fixed_new_bytes(path: Path, chunk_size: int, seen: set[str]) -> int:
    """Bytes a store cut every ``chunk_size`` from offset 0 would add for ``path``."""
    new = 0
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        for off in range(0, size, chunk_size):
            data = os.pread(fd, min(chunk_size, size - off), off)
            digest = xxhash.xxh3_128_hexdigest(data)
            if digest not in seen:
                seen.add(digest)
                new += len(data)
    finally:
        os.close(fd)
    return new


# ----- one checkpoint -------------------------------------------------------------------


@dataclass
class Checkpoint:
    n: int
    size: int = 0
    stored: int = 0  # flush.bytes_stored growth
    deduped: int = 0  # flush.bytes_deduped growth
    hashed: int = 0
    hash_s: float = 0.0
    chunks_dir: Usage = field(default_factory=Usage)  # growth of .ckptfs/chunks
    chunks: int = 0  # chunks in the manifest
    chunking: str = ""
    manifest: int = 0  # bytes of the manifest file
    fixed: int = 0  # what fixed chunking would store
    zip: Zip = field(default_factory=lambda: Zip(0, 0))
    save_s: float = 0.0
    durable_s: float = 0.0  # close -> durable, the daemon's (first) history record
    wait_s: float = 0.0  # torch.save returned -> the wait for durable returned
    flushes: int = 0  # history records of the file: times it was flushed to durable
    notes: list[str] = field(default_factory=list)


def wait_idle(layout: Layout, timeout: float) -> dict[str, Any]:
    """Poll `ckptfs stat --json` until the flusher has nothing queued or active.

    `ckptfs flush --wait` returns when the file is durable, but a second flush
    of the same file may still be running (see ``--wait``); its work belongs to
    this checkpoint, not the next.
    """
    deadline = time.perf_counter() + timeout
    while True:
        status = stat_json(layout, layout.mountpoint)
        flush = status["flush"]
        if not flush["active"] and not flush["queued"]:
            return status
        if time.perf_counter() > deadline:
            raise BenchError(f"the flusher was still busy {timeout:.0f}s after durable: {flush}")
        time.sleep(0.05)


def one_checkpoint(
    layout: Layout,
    job: Job,
    n: int,
    chunk_size: int,
    seen: set[str],
    args: argparse.Namespace,
) -> Checkpoint:
    cp = Checkpoint(n)
    rel = f"run/checkpoint-{n}/model.pt"
    path = layout.mountpoint / rel
    path.parent.mkdir(parents=True)
    chunks_root = layout.backing / ".ckptfs" / "chunks"
    state = job.checkpoint(n)

    before = stat_json(layout, layout.mountpoint)
    du_before = disk_usage(chunks_root)
    cp.save_s, _ = timed(lambda: save(state, path, f"checkpoint {n}"))
    closed = time.perf_counter()
    timeout = args.durable_timeout
    if args.wait == "flush":
        ckptfs(
            layout,
            *("flush", str(layout.mountpoint), "--wait", "--timeout", str(timeout)),
            timeout=timeout + 60,
        )
    else:
        wait_durable(layout, path, timeout)
    cp.wait_s = time.perf_counter() - closed
    after = wait_idle(layout, timeout)
    du_after = disk_usage(chunks_root)

    manifest_path = layout.backing / rel
    manifest = read_manifest(manifest_path)
    if manifest.get("state") != "durable":
        raise BenchError(f"{manifest_path} is {manifest.get('state')!r} after the wait")
    cp.size = manifest["size"]
    cp.chunks = len(manifest["chunks"])
    cp.chunking = manifest.get("chunking", "")
    cp.manifest = manifest_path.stat().st_size
    fb, fa = before["flush"], after["flush"]
    cp.stored = fa["bytes_stored"] - fb["bytes_stored"]
    cp.deduped = fa["bytes_deduped"] - fb["bytes_deduped"]
    cp.hashed = fa["bytes_hashed"] - fb["bytes_hashed"]
    cp.hash_s = hash_seconds(fa) - hash_seconds(fb)
    cp.chunks_dir = Usage(
        du_after.apparent - du_before.apparent,
        du_after.allocated - du_before.allocated,
        du_after.files - du_before.files,
    )
    records = [float(h["durable_s"]) for h in after["history"] if h.get("path") == rel]
    cp.flushes = len(records)
    if not records:
        cp.notes.append("no history record: close -> durable is the time the wait took")
    cp.durable_s = min(records, default=cp.wait_s)  # the first flush made it durable
    if cp.flushes > 1:
        cp.notes.append(
            f"flushed {cp.flushes} times ({', '.join(f'{r:.2f}s' for r in records)} after "
            f"close), hashed {cp.hashed / cp.size:.1f}x its size: the flusher flushed the file "
            "again, concurrently (`ckptfs flush` queued it while it was being flushed)"
        )
    for key, what in (("spilled_bytes", "spilled early"), ("backpressure_events", "waits")):
        grew = after["cache"][key] - before["cache"][key]
        if grew:
            cp.notes.append(f"cache {key} grew by {grew} ({what}): the cache was too small")
    if fa["failures"] != fb["failures"]:
        cp.notes.append(f"{fa['failures'] - fb['failures']} flush failure(s), see the daemon log")

    cp.zip = zip_layout(path)
    cp.fixed = fixed_new_bytes(path, chunk_size, seen)
    return cp


# ----- isolated measurements ------------------------------------------------------------


def random_buffer(size: int) -> bytearray:
    buf = bytearray(size)
    view = memoryview(buf)
    for off in range(0, size, RANDOM_PIECE):
        n = min(RANDOM_PIECE, size - off)
        view[off : off + n] = os.urandom(n)
    return buf


def hash_pieces(pieces: list[memoryview]) -> None:
    for p in pieces:
        xxhash.xxh3_128_hexdigest(p)


def hash_rate(buf: bytearray, threads: int) -> float:
    """Median seconds to xxh3-128 ``buf`` in HASH_PIECE pieces over ``threads`` threads."""
    view = memoryview(buf)
    pieces = [view[off : off + HASH_PIECE] for off in range(0, len(buf), HASH_PIECE)]
    times = []
    for _ in range(HASH_REPEATS):
        workers = [
            threading.Thread(target=hash_pieces, args=(pieces[i::threads],)) for i in range(threads)
        ]
        start = time.perf_counter()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def write_fsync(buf: bytearray, path: Path) -> float:
    """Seconds to write ``buf`` sequentially to a new file, fsync it and its directory."""
    view = memoryview(buf)
    start = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for off in range(0, len(buf), WRITE_PIECE):
            piece = view[off : off + WRITE_PIECE]
            while piece:
                piece = piece[os.write(fd, piece) :]
        os.fsync(fd)
    finally:
        os.close(fd)
    fsync_path(path.parent, directory=True)
    seconds = time.perf_counter() - start
    path.unlink()
    return seconds


@dataclass
class Plan:
    seconds: float
    kind: str
    ranges: list[tuple[int, int]]
    reads: int
    bytes_read: int


def time_plan(path: Path, chunk_size: int, cold: bool) -> Plan:
    fd = os.open(path, os.O_RDONLY)
    try:
        if cold:
            os.fsync(fd)  # clean pages are the ones DONTNEED drops
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        size = os.fstat(fd).st_size
        reads = [0, 0]

        def read_at(off: int, n: int) -> bytes:
            data = os.pread(fd, n, off)
            reads[0] += 1
            reads[1] += len(data)
            return data

        seconds, (kind, ranges) = timed(lambda: plan_chunks(read_at, size, chunk_size))
    finally:
        os.close(fd)
    return Plan(seconds, kind, ranges, reads[0], reads[1])


@dataclass
class Isolated:
    size: int
    hash_1: float
    hash_2: float
    write: float
    plan_cold: Plan
    plan_warm: Plan
    plan_matches: bool


def isolated(layout: Layout, size: int, plain: Path, chunk_size: int, last: Path) -> Isolated:
    print(f"isolated measurements over {size / GIB:.2f} GiB (ckptfs unmounted) ...")
    plan_cold = time_plan(plain, chunk_size, cold=True)
    plan_warm = time_plan(plain, chunk_size, cold=False)
    manifest = read_manifest(last)
    matches = [(o, n) for o, n, _ in manifest["chunks"]] == plan_warm.ranges
    buf = random_buffer(size)
    hash_1 = hash_rate(buf, 1)
    hash_2 = hash_rate(buf, 2)
    write = write_fsync(buf, layout.disk / "write-fsync.bin")
    return Isolated(size, hash_1, hash_2, write, plan_cold, plan_warm, matches)


# ----- report -------------------------------------------------------------------------


def mb(n: float) -> str:
    return f"{n / MB:.1f}"


def print_table(
    header: tuple[str, ...], rows: list[tuple[str, ...]], align: str, context: list[str]
) -> list[str]:
    """Print a plain table; return its markdown lines."""
    print_lines(table_lines(header, rows, align))
    md = [f"- {line}" for line in context] + ([""] if context else [])
    return md + markdown_lines(header, rows, align)


CHECKPOINT_HEADER = (
    "checkpoint",
    "file MB (no dedup)",
    "stored MB",
    "chunks dir MB (du)",
    "stored / file",
    "chunks (new)",
    "fixed chunks MB",
    "pickle B",
    "1st tensor at",
    "save s",
    "close->durable s",
    "flushes",
)


def checkpoint_rows(cps: list[Checkpoint]) -> list[tuple[str, ...]]:
    rows = []
    for cp in cps:
        rows.append(
            (
                f"checkpoint-{cp.n}",
                mb(cp.size),
                mb(cp.stored),
                mb(cp.chunks_dir.allocated),
                f"{100 * cp.stored / cp.size:.1f}%",
                f"{cp.chunks} ({cp.chunks_dir.files})",
                mb(cp.fixed),
                str(cp.zip.pickle),
                str(cp.zip.first_tensor),
                f"{cp.save_s:.2f}",
                f"{cp.durable_s:.2f}",
                str(cp.flushes),
            )
        )
    size = sum(cp.size for cp in cps)
    stored = sum(cp.stored for cp in cps)
    rows.append(
        (
            "total",
            mb(size),
            mb(stored),
            mb(sum(cp.chunks_dir.allocated for cp in cps)),
            f"{100 * stored / size:.1f}%",
            f"{sum(cp.chunks for cp in cps)} ({sum(cp.chunks_dir.files for cp in cps)})",
            mb(sum(cp.fixed for cp in cps)),
            "",
            "",
            "",
            "",
            "",
        )
    )
    return rows


def rate(nbytes: float, seconds: float) -> str:
    return f"{nbytes / MB / seconds:.0f}" if seconds > 0 else "-"


def throughput_rows(cps: list[Checkpoint], final_flush: dict[str, Any], iso: Isolated):
    first = cps[0]
    size = iso.size
    rows = [
        (
            "flusher: xxh3-128 per hashing thread, all checkpoints (stat hash_throughput)",
            f"{final_flush['hash_throughput'] / MB:.0f}",
            f"{hash_seconds(final_flush):.3f}",
            mb(final_flush["bytes_hashed"]),
        ),
        (
            "flusher: xxh3-128 per hashing thread, checkpoint-1",
            rate(first.hashed, first.hash_s),
            f"{first.hash_s:.3f}",
            mb(first.hashed),
        ),
        (
            "flusher: written to backing store, checkpoint-1 (stored / close->durable)",
            rate(first.stored, first.durable_s),
            f"{first.durable_s:.2f}",
            mb(first.stored),
        ),
        (
            "flusher: file made durable, checkpoint-1 (file / close->durable)",
            rate(first.size, first.durable_s),
            f"{first.durable_s:.2f}",
            mb(first.size),
        ),
        ("xxh3-128, 4 MiB pieces, 1 thread", rate(size, iso.hash_1), f"{iso.hash_1:.3f}", mb(size)),
        (
            "xxh3-128, 4 MiB pieces, 2 threads",
            rate(size, iso.hash_2),
            f"{iso.hash_2:.3f}",
            mb(size),
        ),
    ]
    for label, plan in (("page cache cold", iso.plan_cold), ("page cache warm", iso.plan_warm)):
        rows.append(
            (
                f"plan_chunks on the plain file, {label} ({plan.reads} reads, "
                f"{plan.bytes_read / MIB:.1f} MiB read)",
                rate(cps[-1].size, plan.seconds),
                f"{plan.seconds:.4f}",
                mb(cps[-1].size),
            )
        )
    rows.append(
        (
            "sequential write + fsync to the backing disk",
            rate(size, iso.write),
            f"{iso.write:.2f}",
            mb(size),
        )
    )
    return rows


def report(
    cps: list[Checkpoint],
    final_flush: dict[str, Any],
    iso: Isolated,
    context: list[str],
) -> None:
    markdown: list[str] = []
    print()
    print_lines(context)
    print()
    rows = checkpoint_rows(cps)
    markdown += print_table(CHECKPOINT_HEADER, rows, "l" + "r" * 11, context)
    for cp in cps:
        for note in cp.notes:
            print(f"checkpoint-{cp.n}: {note}")
    later = cps[1:]
    summary = []
    if later:
        size = sum(cp.size for cp in later)
        stored = sum(cp.stored for cp in later)
        fixed = sum(cp.fixed for cp in later)
        summary.append(
            f"checkpoints 2-{cps[-1].n}: ckptfs stored {100 * stored / size:.1f}% of the bytes "
            f"a plain copy writes ({size / max(stored, 1):.1f}x less); cutting every "
            f"chunk_size from offset 0 would store {100 * fixed / size:.1f}%"
        )
    print()
    print_lines(summary)
    markdown += [""] + [f"- {line}" for line in summary]

    print()
    t_header = ("measurement", "MB/s", "seconds", "MB")
    t_rows = throughput_rows(cps, final_flush, iso)
    markdown += [""] + print_table(t_header, t_rows, "lrrr", [])
    first = cps[0]
    write_rate = first.stored / first.durable_s if first.durable_s else 0
    ratios = []
    if write_rate:
        for label, hash_rate_ in (
            ("flusher hashing (per thread)", final_flush["hash_throughput"]),
            ("xxh3-128, 1 thread", iso.size / iso.hash_1),
            ("xxh3-128, 2 threads", iso.size / iso.hash_2),
        ):
            ratios.append(f"{label} / checkpoint-1 backing write: {hash_rate_ / write_rate:.1f}x")
    ratios.append(
        f"checkpoint-1 backing write / plain sequential write + fsync: "
        f"{write_rate / (iso.size / iso.write):.2f}x"
    )
    ratios.append(
        f"plan_chunks: {iso.plan_warm.kind}, {len(iso.plan_warm.ranges)} chunks, "
        + (
            "the same cuts as the daemon's manifest of the last checkpoint"
            if iso.plan_matches
            else "DIFFERENT cuts from the daemon's manifest of the last checkpoint"
        )
    )
    if first.flushes > 1:
        ratios.append(
            "checkpoint-1 was flushed twice at once (see flushes): the second flush competed "
            "with the first for the CPU and the disk; --wait poll avoids it"
        )
    print()
    print_lines(ratios)
    markdown += [""] + [f"- {line}" for line in ratios]
    print("\nMarkdown:\n")
    print("\n".join(markdown))


def context_lines(
    job: Job,
    cps: list[Checkpoint],
    layout: Layout,
    status: dict[str, Any],
    config: Any,
    args: argparse.Namespace,
) -> list[str]:
    nbytes, trainable = job.nbytes, job.trainable_bytes
    waits = [cp.wait_s for cp in cps]
    how = (
        "`ckptfs flush <mnt> --wait`"
        if args.wait == "flush"
        else "polling `ckptfs stat --json` for the file"
    )
    return [
        f"model: GPT-like state dict, {nbytes / MB:.0f} MB in {len(job.sd)} tensors "
        f"({N_LAYER} layers, bf16 blocks, fp32 embeddings); trainable: the last "
        f"{job.trainable_blocks} blocks and ln_f = {100 * trainable / nbytes:.1f}% of the bytes, "
        f"changed (+{PERTURB_SCALE:g} x randn) before every checkpoint after the first; "
        f"the other {100 * (nbytes - trainable) / nbytes:.1f}% frozen",
        "every checkpoint adds a key (`step`, one more `optimizer.param_groups.<n>`): "
        "the pickle (written before the tensors) grows and every tensor moves",
        f"machine: {machine()}, torch {torch.__version__}, xxhash {xxhash.VERSION}",
        f"ckptfs: chunk_size {config.chunk_size >> 20} MiB, flush.workers {config.flush_workers}, "
        f"durability {status['durability']}, backing dir {layout.backing} (local disk), "
        f"cache {status['cache']['capacity'] >> 20} MiB in {layout.cache}",
        "file MB = what a plain copy (NFS) writes; stored = growth of flush.bytes_stored; "
        "chunks dir = growth of du (allocated blocks) of .ckptfs/chunks, manifests not "
        f"included (~{statistics.median(cp.manifest for cp in cps) / 1e3:.0f} kB each); "
        "chunks (new) = chunks in the manifest (chunk files added)",
        "fixed chunks = what dedup would store cutting every chunk_size from "
        "offset 0 (same store, computed here over the same bytes)",
        f"close->durable = the daemon's history record (the first, if flushed more than once); "
        f"waited with {how}, which returned {min(waits):.2f}-{max(waits):.2f}s after "
        "torch.save did; counters read once the flusher was idle",
        "MB = 10^6 bytes; flusher hash rates are per thread (bytes / thread-seconds in "
        "xxh3), not the aggregate of flush.workers threads",
    ]


# ----- main -------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m ckptfs.tools.bench.bench_dedup", description=__doc__.splitlines()[0]
    )
    p.add_argument("--size-gib", type=float, default=1.0, help="state dict size (default 1)")
    p.add_argument("--checkpoints", type=int, default=3, help="checkpoints saved (default 3)")
    p.add_argument(
        "--workdir",
        type=Path,
        default=Path("/var/tmp/ckptfs-bench-dedup"),
        help="local-disk directory for the backing dir and the plain-file measurements",
    )
    p.add_argument(
        "--trainable",
        type=float,
        default=0.1,
        help="fraction of the bytes that is trained (whole blocks; default 0.1)",
    )
    p.add_argument("--config", help="ckptfs YAML config for the mount")
    p.add_argument("--cache-size", help="ckptfs cache size (default: 1.5 x size + 256MiB)")
    p.add_argument(
        "--wait",
        choices=["flush", "poll"],
        default="flush",
        help="how to wait for durable: `ckptfs flush <mnt> --wait` (default), or polling "
        "`ckptfs stat --json`, which does not queue the file a second time",
    )
    p.add_argument("--durable-timeout", type=float, default=900.0, help="seconds (default 900)")
    p.add_argument("--keep", action="store_true", help="keep --workdir's files afterwards")
    args = p.parse_args(argv)
    if args.size_gib <= 0 or args.checkpoints < 1:
        p.error("--size-gib must be > 0 and --checkpoints >= 1")
    if not 0 < args.trainable < 1:
        p.error("--trainable must be between 0 and 1")
    return args


def benchmark(args: argparse.Namespace, layout: Layout) -> None:
    size = int(args.size_gib * GIB)
    cache_size = cache_size_for(args.cache_size, size)
    # The daemon reads the same file and environment, so this is its chunk_size.
    config = load_config(args.config)

    seconds, job = timed(lambda: make_job(size, args.trainable))
    print(
        f"built a {job.nbytes / GIB:.2f} GiB state dict with {len(job.sd)} tensors in "
        f"{seconds:.1f}s; {100 * job.trainable_bytes / job.nbytes:.1f}% trainable"
    )
    mount(layout, cache_size, args.config)
    status = stat_json(layout, layout.mountpoint)
    print(f"mounted; cache of {status['cache']['capacity'] >> 20} MiB")

    cps: list[Checkpoint] = []
    seen: set[str] = set()
    for n in range(1, args.checkpoints + 1):
        if n > 1:
            job.train()
        cp = one_checkpoint(layout, job, n, config.chunk_size, seen, args)
        cps.append(cp)
        print(
            f"checkpoint-{n}: {cp.size / MB:.1f} MB, stored {cp.stored / MB:.1f} MB "
            f"({100 * cp.stored / cp.size:.1f}%), save {cp.save_s:.2f}s, "
            f"durable {cp.durable_s:.2f}s after close"
        )
    final = stat_json(layout, layout.mountpoint)

    # The last checkpoint again, as a plain file on the backing disk, for plan_chunks.
    plain = layout.disk / "model.pt"
    save(job.last, plain, "plain file")
    context = context_lines(job, cps, layout, status, config, args)
    job.sd.clear()  # room for the hash buffer
    job.last.clear()
    last_manifest = layout.backing / f"run/checkpoint-{args.checkpoints}/model.pt"
    unmount(layout)  # nothing else runs during the in-process measurements
    iso = isolated(layout, size, plain, config.chunk_size, last_manifest)
    report(cps, final["flush"], iso, context)


def main(argv: list[str] | None = None) -> int:
    return run_mounted("bench_dedup", parse_args(argv), benchmark)


if __name__ == "__main__":
    sys.exit(main())
