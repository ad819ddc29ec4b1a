"""Buddy mirroring on loopback: save cost and restore from a peer's RAM.

    python -m ckptfs.tools.bench.bench_buddy [--size-gib 1] [--runs 3] [--warmup 1] [--workdir DIR]

Mounts three daemons on this machine (n1, n2, n3; one shared backing
directory on the local disk under --workdir, caches in /dev/shm, loopback
peer ports). n1 writes with ``durability: buddy`` (its buddy is n2), n3 with
``durability: local``. Each run, side by side:

- save: ``torch.save`` of a GPT-like state dict of about --size-gib into
  tmpfs, into n3 (local), and into n1 (buddy: close returns once n2 holds
  every page); each ckptfs save is drained (``flush --wait``) before the next.
  Also the buddy / tmpfs ratio of each run, and the CPU seconds the trainer
  and the daemons involved used while each save ran.
- restore: with n1's flush capped (--cap-mib MB/s) so the file stays pending,
  ``torch.load`` on n1 (its own RAM) against ``torch.load`` on n3 (bytes from
  a holder's RAM over loopback, verified), kernel page cache dropped before
  each.

Prints medians of --runs and the daemons' memory outside their arenas. It
prints measured numbers; it asserts no thresholds.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
from ckptfs.tools.bench.benchlib import (
    GIB,
    MIB,
    BenchError,
    Layout,
    Rewarm,
    build_state_dict,
    ckptfs,
    detach,
    drop_page_cache,
    is_mounted,
    machine,
    process_cpu_s,
    save,
    stat_json,
    timed,
    wait_prefaulted,
)

NODES = ("n1", "n2", "n3")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Cluster:
    def __init__(self, base: Path, cache_size: str, cap: int) -> None:
        self.base = base
        self.backing = base / "backing"
        self.backing.mkdir(parents=True, exist_ok=True)
        tag = f"ckptfs-bench-{os.getpid()}"
        self.layouts = {
            n: Layout(
                base / n, Path("/dev/shm") / f"{tag}-{n}-tmp", Path("/dev/shm") / f"{tag}-{n}"
            )
            for n in NODES
        }
        secret = base / "secret"
        secret.write_text(os.urandom(16).hex())
        secret.chmod(0o600)
        nodes = ", ".join(f"{n}: 127.0.0.1:{free_port()}" for n in NODES)
        self.config = base / "cluster.yaml"
        self.config.write_text(
            f"peers:\n  secret_file: {secret}\n  nodes: {{{nodes}}}\n"
            "  timeout: 5\n  heartbeat: 0.5\n"
        )
        self.cache_size = cache_size
        self.cap = cap

    def mount(self) -> None:
        for n, layout in self.layouts.items():
            for d in (layout.mountpoint, layout.run_dir):
                d.mkdir(parents=True, exist_ok=True)
            args = ["mount", str(layout.mountpoint), "--backing", str(self.backing)]
            args += ["--cache-size", self.cache_size, "--cache-dir", str(layout.cache)]
            args += ["--config", str(self.config), "--node", n]
            if n == "n3":
                args += ["--durability", "local"]
            print(ckptfs(layout, *args).strip())
        faulting = sum(wait_prefaulted(layout) for layout in self.layouts.values())
        print(f"caches pre-faulted (waited {faulting:.1f}s)")
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if all(all(p["alive"] for p in self.stat(n)["peers"]) for n in NODES):
                return
            time.sleep(0.2)
        raise BenchError("the three daemons did not see each other alive within 60s")

    def mnt(self, n: str) -> Path:
        return self.layouts[n].mountpoint

    def cpu_seconds(self, n: str) -> float:
        """User + system CPU seconds the daemon of ``n`` has used so far."""
        return process_cpu_s(int(next(self.layouts[n].run_dir.glob("*.pid")).read_text()))

    def stat(self, n: str) -> dict:
        return stat_json(self.layouts[n], self.mnt(n))

    def drain(self, n: str) -> None:
        ckptfs(
            self.layouts[n], "flush", str(self.mnt(n)), "--wait", "--timeout", "900", timeout=960
        )

    def remount_capped(self, n: str) -> None:
        """Remount ``n`` with its flush capped (the restore part keeps files pending)."""
        layout = self.layouts[n]
        ckptfs(layout, "umount", str(self.mnt(n)), timeout=900)
        args = ["mount", str(layout.mountpoint), "--backing", str(self.backing)]
        args += ["--cache-size", self.cache_size, "--cache-dir", str(layout.cache)]
        args += ["--config", str(self.config), "--node", n]
        env_cap = {"CKPTFS_FLUSH_BANDWIDTH": str(self.cap)}
        os.environ.update(env_cap)
        try:
            print(ckptfs(layout, *args).strip())
        finally:
            del os.environ["CKPTFS_FLUSH_BANDWIDTH"]
        wait_prefaulted(layout)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if all(p["alive"] for p in self.stat(n)["peers"]):
                return
            time.sleep(0.2)

    def cleanup(self, keep: bool) -> None:
        for layout in self.layouts.values():
            if is_mounted(layout.mountpoint):
                try:
                    ckptfs(layout, "umount", str(layout.mountpoint), "--force", timeout=120)
                except BenchError as exc:
                    print(f"warning: {exc}; detaching", file=sys.stderr)
                    detach(layout.mountpoint)
            for d in (layout.cache, layout.tmpfs):
                shutil.rmtree(d, ignore_errors=True)
        if not keep and not any(is_mounted(lay.mountpoint) for lay in self.layouts.values()):
            shutil.rmtree(self.backing, ignore_errors=True)


def print_run(i: int, results: dict[str, list[float]]) -> None:
    print(f"run {i + 1}: " + ", ".join(f"{k} {v[-1]:.2f}s" for k, v in results.items()))


def report(title: str, results: dict[str, list[float]], baseline: str) -> None:
    base = statistics.median(results[baseline])
    print(f"\n{title}:")
    for k, v in results.items():
        m = statistics.median(v)
        print(f"  {k:<18} {m:6.2f} s  {m / base:5.2f}x {baseline}")


def anon_mib(c: Cluster, n: str) -> float:
    return c.stat(n)["memory"]["anon"] / MIB


def print_ram(c: Cluster, nbytes: int) -> None:
    """Each node's RAM over the saves: the most of its own not yet durable
    bytes and of the buddy's mirrored here at once (what it needs), the most
    arena in use (clean pages too), and its resident memory now."""
    print(f"  RAM per node over the saves ({nbytes / GIB:.2f} GiB each; peaks since mount):")
    for n in NODES:
        s = c.stat(n)
        peak, mem = s["cache"]["peak"], s["memory"]
        print(
            f"    {n}: own dirty {peak['own_dirty'] / GIB:.2f} GiB + mirrored for others "
            f"{peak['mirrored'] / GIB:.2f} GiB; arena in use {peak['used'] / GIB:.2f} of "
            f"{s['cache']['capacity'] / GIB:.2f} GiB; RSS {mem['rss'] / GIB:.2f} GiB "
            f"(arena pages mapped {mem['shmem'] / GIB:.2f}, heap {mem['anon'] / MIB:.0f} MiB)"
        )


def run(args: argparse.Namespace, c: Cluster) -> None:
    size = int(args.size_gib * GIB)
    print(machine())
    sd = build_state_dict(size)
    nbytes = sum(t.numel() * t.element_size() for t in sd.values())
    print(f"state dict: {nbytes / GIB:.2f} GiB in {len(sd)} tensors")
    rewarm = Rewarm(int(args.rewarm_gib * GIB))
    tmpfs = Path("/dev/shm") / f"ckptfs-bench-{os.getpid()}-plain"
    tmpfs.mkdir(exist_ok=True)
    c.mount()
    saves: dict[str, list[float]] = {"tmpfs": [], "local (n3)": [], "buddy (n1)": []}
    # CPU seconds per save: where a save's time goes when everything shares 2 cores.
    cpu: dict[str, list[float]] = {
        k: [] for k in ("trainer (local)", "n3", "trainer (buddy)", "n1", "n2")
    }
    try:
        # One untimed round first: the first save into each target after the
        # mounts (and 13 GiB of pre-faulting) was often 2-3x slower.
        for i in range(-args.warmup, args.runs):
            for what, path in (
                ("tmpfs", tmpfs / "ckpt.pt"),
                ("local (n3)", c.mnt("n3") / f"save{i}.pt"),
                ("buddy (n1)", c.mnt("n1") / f"save{i}.pt"),
            ):
                rewarm()
                daemons = {"local (n3)": ("n3",), "buddy (n1)": ("n1", "n2")}.get(what, ())
                before = {n: c.cpu_seconds(n) for n in daemons}
                trainer = time.process_time()
                seconds, _ = timed(lambda p=path, w=what: save(sd, p, w))
                if i < 0:
                    print(f"warm-up (untimed): {what} {seconds:.2f}s")
                else:
                    saves[what].append(seconds)
                    if daemons:
                        cpu[f"trainer ({what.split()[0]})"].append(time.process_time() - trainer)
                    for n in daemons:
                        cpu[n].append(c.cpu_seconds(n) - before[n])
                if what != "tmpfs":  # drained, so it does not slow the next save
                    c.drain("n3" if "n3" in what else "n1")
                os.unlink(path)
            if i >= 0:
                print_run(i, saves)
        report(f"save (median of {args.runs})", saves, "tmpfs")
        ratios = sorted(b / t for b, t in zip(saves["buddy (n1)"], saves["tmpfs"], strict=True))
        print(
            f"  buddy / tmpfs per run, sorted: {', '.join(f'{r:.2f}' for r in ratios)}"
            f" (median {statistics.median(ratios):.2f}x)"
        )
        print(
            "  CPU seconds used while the save ran (its flush afterwards not counted; medians): "
            + ", ".join(f"{k} {statistics.median(v):.2f}" for k, v in cpu.items())
        )
        writer = c.stat("n1")["mirroring"]["writer"]
        print(
            f"  n1 mirrored {writer['bytes_sent'] / GIB:.2f} GiB, {writer['fallbacks']} fallback(s)"
        )
        print_ram(c, nbytes)

        c.remount_capped("n1")
        # Other bytes than the saves': chunks already stored would make the
        # file durable at once (dedup), and it must stay pending here.
        sd = build_state_dict(size, seed=1)
        loads: dict[str, list[float]] = {"n1 own RAM": [], "n3 from peer RAM": []}
        for i in range(args.runs):
            path = c.mnt("n1") / f"restore{i}.pt"
            save(sd, path, "restore source")
            for what, node in (("n1 own RAM", "n1"), ("n3 from peer RAM", "n3")):
                drop_page_cache()
                rewarm()
                seconds, loaded = timed(
                    lambda n=node, p=path: torch.load(c.mnt(n) / p.name, weights_only=True)
                )
                if not all(torch.equal(loaded[k], sd[k]) for k in sd):
                    raise BenchError(f"{what}: loaded tensors differ")
                del loaded
                gc.collect()
                loads[what].append(seconds)
            os.unlink(path)
            print_run(i, loads)
        title = f"restore of a pending file (median of {args.runs}, page cache dropped)"
        report(title, loads, "n1 own RAM")
        reads = c.stat("n3")["peer_reads"]
        print(f"  n3 fetched {reads.get('bytes_fetched', 0) / GIB:.2f} GiB from peers")
        print(
            "\ndaemon heap (RssAnon): " + ", ".join(f"{n} {anon_mib(c, n):.0f} MiB" for n in NODES)
        )
    finally:
        shutil.rmtree(tmpfs, ignore_errors=True)
        print(json.dumps({"saves": saves}, indent=None))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench_buddy", description=__doc__.splitlines()[0])
    p.add_argument("--size-gib", type=float, default=1.0)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1, help="untimed rounds of saves first")
    p.add_argument("--workdir", type=Path, default=Path("/var/tmp/ckptfs-bench-buddy"))
    p.add_argument("--rewarm-gib", type=float, default=2.0)
    p.add_argument("--cap-mib", type=float, default=1.0, help="n1's flush cap in the restore part")
    p.add_argument("--keep", action="store_true")
    args = p.parse_args(argv)
    size = int(args.size_gib * GIB)
    cache_size = str(2 * size + 512 * MIB)
    c = Cluster(args.workdir.resolve(), cache_size, int(args.cap_mib * MIB))
    try:
        run(args, c)
        return 0
    except BenchError as exc:
        print(f"bench_buddy: error: {exc}", file=sys.stderr)
        return 1
    finally:
        c.cleanup(args.keep)


if __name__ == "__main__":
    sys.exit(main())
