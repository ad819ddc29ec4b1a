"""Cold restore of one checkpoint on several nodes at once (representative fetch).

    python -m ckptfs.tools.bench.bench_cluster [--nodes 4] [--size-mib 512] [--runs 3]
                                               [--workdir DIR] [--cache-size SIZE]
                                               [--store-mbps N]

Every node is a ckptfs daemon on this machine with its own mountpoint, cache
and loopback port; all share one backing directory that sits behind the
tests' counting passthrough FUSE mount (tests/support/countingfs.py, the NFS
stand-in), so the bytes read from the store by every daemon are counted in
one place. As many solo daemons (no peers) on the same backing are the
baselines: one of them alone is a single node, all of them together are as
many nodes without representative fetch. Node 1 saves a GPT-like state dict
of --size-mib with torch.save and waits until it is durable; then, --runs
times, each step cold (every daemon's cached bytes evicted, the kernel page
cache dropped):

- single: ``torch.load`` on the solo node;
- cluster: one ``torch.load`` per node, started together; wall time until the last ends;
- independent: the same on the solo daemons, each reading the store itself.

--store-mbps gives the store one read link of N MB/s that every daemon's
reads share (countingfs --read-mbps), as the nodes of a cluster share the
network link to their NFS server; by default the store is as fast as this
machine can serve it.

It prints the medians: both times and their ratio, the backing-store bytes read
per checkpoint size, and the CPU seconds the daemons, the counting store and
the readers used (on a machine with fewer cores than nodes, the cluster's wall
time is bound by that CPU work, which a real cluster spreads over its nodes).
It asserts no thresholds.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import ckptfs
from ckptfs.tools.bench.benchlib import (
    MIB,
    BenchError,
    Rewarm,
    build_state_dict,
    detach,
    drop_page_cache,
    is_mounted,
    machine,
    print_lines,
    process_cpu_s,
    save,
    table_lines,
)

COUNTINGFS = Path(ckptfs.__file__).resolve().parent / "tests" / "support" / "countingfs.py"
# A reader: says it is ready (torch imported), waits for "go" on stdin so that
# all start together, loads the checkpoint, prints the bytes of its tensors.
READER = """
import sys, torch
print("ready", flush=True)
sys.stdin.readline()
sd = torch.load(sys.argv[1], map_location="cpu", weights_only=True)
print(sum(t.numel() * t.element_size() for t in sd.values()), flush=True)
"""


@dataclass
class Node:
    name: str
    workdir: Path
    port: int = 0
    pid: int = 0

    @property
    def mnt(self) -> Path:
        return self.workdir / f"mnt-{self.name}"

    @property
    def env(self) -> dict[str, str]:
        return {
            **os.environ,
            "CKPTFS_RUN_DIR": str(self.workdir / f"run-{self.name}"),
            "CKPTFS_CACHE_DIR": f"/dev/shm/ckptfs-bench-cluster-{os.getpid()}-{self.name}",
        }

    def cli(self, *args: str, timeout: float = 300) -> str:
        try:
            done = subprocess.run(
                [sys.executable, "-m", "ckptfs", *args],
                env=self.env,
                capture_output=True,
                text=True,
                timeout=timeout,
                check=False,
            )
        except subprocess.TimeoutExpired:
            raise BenchError(f"`ckptfs {' '.join(args)}` on {self.name} timed out") from None
        if done.returncode:
            raise BenchError(
                f"`ckptfs {' '.join(args)}` on {self.name} failed: {done.stderr.strip()}"
            )
        return done.stdout

    def stat(self) -> dict:
        return json.loads(self.cli("stat", str(self.mnt), "--json"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cpu_seconds(pid: int) -> float:
    try:
        return process_cpu_s(pid)
    except OSError:
        return 0.0


class Store:
    """The counting backing mount."""

    def __init__(self, workdir: Path, read_mbps: float) -> None:
        self.real = workdir / "backing-real"
        self.mnt = workdir / "backing"
        self.counters_path = workdir / "backing.counters.json"
        self.real.mkdir(parents=True, exist_ok=True)
        self.mnt.mkdir(parents=True, exist_ok=True)
        self.log = open(workdir / "countingfs.log", "ab")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(
            [sys.executable, str(COUNTINGFS), str(self.real), str(self.mnt),
             "--counters", str(self.counters_path), "--read-mbps", str(read_mbps)],
            stdout=self.log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        deadline = time.monotonic() + 30
        while not (is_mounted(self.mnt.resolve()) and self.counters_path.exists()):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise BenchError(f"countingfs did not mount at {self.mnt}")
            time.sleep(0.05)

    def bytes_read(self) -> int:
        before = self.counters_path.stat().st_mtime_ns
        self.proc.send_signal(signal.SIGUSR1)
        deadline = time.monotonic() + 10
        while self.counters_path.stat().st_mtime_ns == before:
            if time.monotonic() > deadline:
                raise BenchError("countingfs wrote no counters")
            time.sleep(0.02)
        return int(json.loads(self.counters_path.read_text())["bytes_read"])

    def stop(self) -> None:
        detach(self.mnt.resolve(), "bench_cluster")
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.log.close()


def mount(node: Node, store: Store, cache_size: str, config: Path | None) -> None:
    node.mnt.mkdir(parents=True, exist_ok=True)
    args = ["mount", str(node.mnt), "--backing", str(store.mnt), "--cache-size", cache_size]
    if config is not None:
        args += ["--config", str(config), "--node", node.name]
    node.cli(*args)
    run_dir = Path(node.env["CKPTFS_RUN_DIR"])
    node.pid = int(next(run_dir.glob("*.pid")).read_text())


def wait_ready(nodes: list[Node], peers: list[Node]) -> None:
    """Caches pre-faulted (so that it does not compete with a measurement) and
    every peer alive for every other."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        stats = [n.stat() for n in nodes]
        faulted = all(s["cache"]["prefault"] != "running" for s in stats)
        alive = all(
            all(p["alive"] for p in s["peers"]) for n, s in zip(nodes, stats, strict=True)
            if n in peers
        )  # fmt: skip
        if faulted and alive:
            return
        time.sleep(0.5)
    raise BenchError("the daemons did not pre-fault their caches or see each other in 300s")


def make_cold(nodes: list[Node]) -> None:
    for n in nodes:
        n.cli("evict", str(n.mnt))
    drop_page_cache()


def restore(paths: list[Path], expect: int, rewarm: Rewarm) -> tuple[float, float]:
    """torch.load of each path in its own process, all at once: (wall s, reader CPU s)."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", READER, str(p)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for p in paths
    ]
    for p in procs:
        assert p.stdout is not None
        if p.stdout.readline().strip() != "ready":
            raise BenchError("a reader failed to start")
    rewarm()  # after the imports: right before the clock starts
    start = time.perf_counter()
    for p in procs:
        assert p.stdin is not None
        p.stdin.write("go\n")
        p.stdin.flush()
    cpu = 0.0
    for p in procs:
        _, status, usage = os.wait4(p.pid, 0)
        p.returncode = os.waitstatus_to_exitcode(status)
        cpu += usage.ru_utime + usage.ru_stime
    wall = time.perf_counter() - start
    for p in procs:
        assert p.stdout is not None
        out = p.stdout.read().strip()
        if p.returncode or int(out or 0) < expect:
            raise BenchError(f"a reader failed ({p.returncode}) or got {out} bytes")
    return wall, cpu


def measure(
    readers: list[Node],
    daemons: list[Node],
    store: Store,
    path: str,
    size: int,
    expect: int,
    rewarm: Rewarm,
) -> dict[str, float]:
    make_cold(daemons)
    pids = [n.pid for n in daemons]
    daemons0, store0 = sum(cpu_seconds(p) for p in pids), cpu_seconds(store.proc.pid)
    read0 = store.bytes_read()
    wall, reader_cpu = restore([n.mnt / path for n in readers], expect, rewarm)
    daemons_cpu = sum(cpu_seconds(p) for p in pids) - daemons0
    store_cpu = cpu_seconds(store.proc.pid) - store0
    return {
        "wall": wall,
        "backing": (store.bytes_read() - read0) / size,
        "cpu": daemons_cpu + store_cpu + reader_cpu,
        "cpu_daemons": daemons_cpu,
        "cpu_store": store_cpu,
        "cpu_readers": reader_cpu,
    }


def bench(args: argparse.Namespace) -> None:
    workdir = args.workdir.resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    if any(workdir.iterdir()):
        raise BenchError(f"{workdir} is not empty: pick a new --workdir")
    store = Store(workdir, args.store_mbps)
    peers = [Node(f"n{i + 1}", workdir, free_port()) for i in range(args.nodes)]
    solos = [Node(f"solo{i + 1}", workdir) for i in range(args.nodes)]
    secret = workdir / "secret"
    secret.write_text("bench secret, not for production 0123456789\n")
    secret.chmod(0o600)
    config = workdir / "cluster.yaml"
    listed = ", ".join(f"{n.name}: 127.0.0.1:{n.port}" for n in peers)
    config.write_text(f"peers:\n  secret_file: {secret}\n  nodes: {{{listed}}}\n")
    mounted: list[Node] = []
    try:
        for n in peers:
            mount(n, store, args.cache_size, config)
            mounted.append(n)
        for n in solos:
            mount(n, store, args.cache_size, None)
            mounted.append(n)
        wait_ready(mounted, peers)
        sd = build_state_dict(args.size_mib * MIB)
        tensors = sum(t.numel() * t.element_size() for t in sd.values())
        save(sd, peers[0].mnt / "ckpt.pt", "the checkpoint")
        del sd
        peers[0].cli("flush", str(peers[0].mnt), "--wait", "--timeout", "600", timeout=660)
        size = (peers[0].mnt / "ckpt.pt").stat().st_size
        print(f"checkpoint: {size / MIB:.0f} MiB, durable; {machine()}")
        link = f"{args.store_mbps:g} MB/s" if args.store_mbps else "no limit"
        print(f"store: countingfs over {store.real}, one read link shared by all nodes: {link}")
        # The readers' tensors are fresh memory, which this kind of VM backs at
        # a few hundred MB/s on first touch: touch and free enough for all of
        # them right before each step (benchlib.Rewarm), so that no step pays
        # for where it sits in the run.
        rewarm = Rewarm(int(1.5 * args.nodes * size))
        runs: dict[str, list[dict[str, float]]] = {"single": [], "cluster": [], "independent": []}
        for run in range(args.runs):
            for kind, readers in (
                ("single", solos[:1]),
                ("cluster", peers),
                ("independent", solos),
            ):
                result = measure(readers, mounted, store, "ckpt.pt", size, tensors, rewarm)
                runs[kind].append(result)
            print(f"run {run + 1}: " + ", ".join(f"{k} {v[-1]}" for k, v in runs.items()))
        report(args, runs, peers)
    finally:
        for n in reversed(mounted):
            try:
                n.cli("umount", str(n.mnt), timeout=120)
            except BenchError as exc:
                print(f"warning: {exc}", file=sys.stderr)
                detach(n.mnt.resolve(), "bench_cluster")
            shutil.rmtree(n.env["CKPTFS_CACHE_DIR"], ignore_errors=True)
        store.stop()
        if not args.keep:
            shutil.rmtree(store.real, ignore_errors=True)


def report(
    args: argparse.Namespace, runs: dict[str, list[dict[str, float]]], peers: list[Node]
) -> None:
    labels = {
        "single": "1 node (solo daemon)",
        "cluster": f"{args.nodes} nodes, representative fetch",
        "independent": f"{args.nodes} solo nodes (no peers)",
    }
    rows = [
        [labels[kind]]
        + [f"{statistics.median(r[key] for r in rows):{fmt}}" for key, fmt in
           (("wall", ".2f"), ("backing", ".3f"), ("cpu", ".1f"), ("cpu_daemons", ".1f"),
            ("cpu_store", ".1f"), ("cpu_readers", ".1f"))]
        for kind, rows in runs.items()
    ]  # fmt: skip

    def ratio(kind: str) -> float:
        pairs = zip(runs["single"], runs[kind], strict=True)
        return statistics.median(k["wall"] / s["wall"] for s, k in pairs)

    print(f"\ncold restore (torch.load), medians of {args.runs} run(s):")
    header = ["", "wall s", "backing bytes / size", "CPU s", "daemons", "store", "readers"]
    print_lines(table_lines(header, rows))
    print(f"{args.nodes}-node wall / single-node wall: {ratio('cluster'):.2f} with representative "
          f"fetch, {ratio('independent'):.2f} without")  # fmt: skip
    reps = [n.stat()["representative"] for n in peers]
    print(
        "representative fetch, all runs: "
        + ", ".join(
            f"{n.name} fetched {r['chunks_fetched']} served {r['chunks_served']} "
            f"fallbacks {r['fallbacks']}"
            for n, r in zip(peers, reps, strict=True)
        )
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench_cluster", description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--size-mib", type=int, default=512)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--cache-size", default="768MiB", help="per daemon")
    parser.add_argument("--workdir", type=Path, default=Path("/var/tmp/ckptfs-bench-cluster"))
    parser.add_argument("--keep", action="store_true", help="keep the backing files")
    parser.add_argument(
        "--store-mbps",
        type=float,
        default=0,
        help="MB/s of the store's read link, shared by all nodes (default 0: no limit)",
    )
    args = parser.parse_args(argv)
    if args.nodes < 2:
        parser.error("--nodes must be at least 2")
    if args.store_mbps < 0:
        parser.error("--store-mbps must not be negative")
    try:
        bench(args)
    except BenchError as exc:
        print(f"bench_cluster: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
