"""A randomised multi-process stress run on real mounts (not part of the suite).

    python tests/cluster/stress_mount.py [--seconds 300] [--nodes 1|2] [--workdir DIR]

As root. Mounts ckptfs (two nodes with buddy mirroring, one backing directory,
with ``--nodes 2``); writer processes running as uid 65534 each own a
directory and save into it as training jobs do: a temporary name, small
writes then a large one, ``os.replace``; and, on other names, rewrites,
``pwrite``, truncate, append, rename and unlink. Each writer checks every
read of its own files whole against what it wrote. Reader processes, on the
other node when there are two, read the writers' replaced files and check
each is a version some writer published. A controller runs ``ckptfs flush``,
``flush --wait`` and ``evict`` at random, and every few seconds pauses
everyone, unmounts a node and mounts it again (half the time with a new,
empty cache directory), then compares every file whole. At the end every
node is mounted afresh, everything compared again, and ``ckptfs check`` run.

It found the lost CREATE of tests/harness/test_operator_races.py within two minutes.
An open of a file that another node replaced twice within that open's
lookup and open gets ESTALE (the kernel retries once); readers count those
(see README, Limits) rather than fail.
"""

from __future__ import annotations

import argparse
import errno
import hashlib
import mmap
import multiprocessing as mp
import os
import pickle
import random
import shutil
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))
from ports import free_port  # noqa: E402

UID = 65534
WRITERS, READERS, NAMES = 3, 2, 4
SIZES = [0, 1, 100, 4096, 65537, 1 << 20, 3 * (1 << 20) + 17]


class Cluster:
    def __init__(self, work: Path, nodes: int) -> None:
        self.work = work
        self.nodes = [f"n{i + 1}" for i in range(nodes)]
        self.mnt = {n: work / f"mnt-{n}" for n in self.nodes}
        self.backing = work / "backing"
        self.env = {**os.environ, "CKPTFS_RUN_DIR": str(work / "run")}
        self.ckptfs = [sys.executable, "-m", "ckptfs"]
        self.config: Path | None = None
        if nodes > 1:
            secret = work / "secret"
            secret.write_text("stress test secret, not for production use\n")
            secret.chmod(0o600)
            addresses = ", ".join(f"{n}: 127.0.0.1:{free_port()}" for n in self.nodes)
            self.config = work / "cluster.yaml"
            self.config.write_text(
                f"peers:\n  secret_file: {secret}\n  nodes: {{{addresses}}}\n"
                "  timeout: 1.5\n  heartbeat: 0.2\n"
            )

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(
            [*self.ckptfs, *args], env=self.env, capture_output=True, text=True, timeout=180
        )
        if proc.returncode:
            raise RuntimeError(f"ckptfs {' '.join(args)}: {proc.stderr.strip()}")
        return proc

    def mount(self, node: str, cache: str) -> None:
        args = ["mount", str(self.mnt[node]), "--backing", str(self.backing)]
        args += ["--cache-size", "1GiB", "--cache-dir", f"{cache}-{node}", "--node", node]
        if self.config is not None:
            args += ["--config", str(self.config)]
        self.cli(*args)

    def detach_all(self) -> None:
        for m in self.mnt.values():
            subprocess.run(["fusermount3", "-u", "-z", str(m)], capture_output=True, timeout=30)


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def become_user() -> None:
    os.setgid(UID)
    os.setuid(UID)


def writer(k: int, home: Path, work: Path, go: Any, paused: Any, errors: Any, seed: int) -> None:
    become_user()
    rnd = random.Random(seed)
    expected: dict[str, bytes] = {}
    published = open(work / f"published-{k}.log", "a")  # noqa: SIM115 - for the process's life
    try:
        for step in range(1 << 62):
            if not go.is_set():
                paused.set()
                go.wait()
                paused.clear()
            name = rnd.choice([f"a{i}" for i in range(NAMES)] + [f"p{i}" for i in range(NAMES)])
            path = home / name
            if name.startswith("a"):
                saved_step(rnd, home, name, expected, published)
            else:
                plain_step(rnd, home, name, expected)
            if step % 25 == 0:
                listed = sorted(x for x in os.listdir(home) if not x.startswith("."))
                assert listed == sorted(expected), f"{home}: {listed} != {sorted(expected)}"
            if name in expected and rnd.random() < 0.2:
                with open(path, "rb") as f:
                    got = f.read()
                assert got == expected[name], (
                    f"{path}: {len(got)} B, not the {len(expected[name])} written"
                )
            state = work / f"expected-{k}.pickle"
            with open(f"{state}.tmp", "wb") as f:
                pickle.dump(expected, f)
            os.replace(f"{state}.tmp", state)
    except Exception:  # noqa: BLE001 - reported to the controller
        errors.put(f"writer {k}: {traceback.format_exc()}")
        paused.set()


def saved_step(
    rnd: random.Random, home: Path, name: str, expected: dict[str, bytes], log: Any
) -> None:
    """torch.save to a temporary name, then os.replace; or check it, mmap'd."""
    path = home / name
    if name in expected and rnd.random() < 0.3:
        with open(path, "rb") as f:
            if expected[name]:
                with mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as m:
                    assert m[:] == expected[name], f"{path}: mmap differs"
        return
    data = os.urandom(rnd.choice(SIZES))
    log.write(f"{name} {digest(data)}\n")
    log.flush()
    os.fsync(log.fileno())  # before a reader can see it
    tmp = home / f".tmp-{name}"
    with open(tmp, "wb") as f:
        for i in range(0, min(len(data), 8192), 512):
            f.write(data[i : i + 512])
        if len(data) > 8192:
            f.write(data[8192:])
    os.replace(tmp, path)
    expected[name] = data


def plain_step(rnd: random.Random, home: Path, name: str, expected: dict[str, bytes]) -> None:
    path = home / name
    cur = expected.get(name)
    op = rnd.random()
    if cur is None or op < 0.15:
        data = os.urandom(rnd.randrange(0, 2 << 20))
        path.write_bytes(data)
        expected[name] = data
    elif op < 0.4:
        off, buf = rnd.randrange(0, len(cur) + 10000), os.urandom(rnd.randrange(1, 300000))
        fd = os.open(path, os.O_RDWR)
        try:
            os.pwrite(fd, buf, off)
        finally:
            os.close(fd)
        new = bytearray(cur) + bytes(max(0, off - len(cur)))
        new[off : off + len(buf)] = buf
        expected[name] = bytes(new)
    elif op < 0.5:
        size = rnd.randrange(0, len(cur) + 50000)
        os.truncate(path, size)
        expected[name] = cur[:size] + bytes(max(0, size - len(cur)))
    elif op < 0.6:
        buf = os.urandom(rnd.randrange(1, 100000))
        with open(path, "ab") as f:
            f.write(buf)
        expected[name] = cur + buf
    elif op < 0.68:
        os.unlink(path)
        del expected[name]
    else:
        other = f"p{rnd.randrange(NAMES)}"
        os.rename(path, home / other)
        expected[other] = expected.pop(name)


def reader(
    k: int, homes: list[Path], work: Path, go: Any, paused: Any, errors: Any, seed: int
) -> None:
    become_user()
    rnd = random.Random(seed)
    try:
        while True:
            if not go.is_set():
                paused.set()
                go.wait()
                paused.clear()
            w = rnd.randrange(len(homes))
            name = f"a{rnd.randrange(NAMES)}"
            path = homes[w] / name
            try:
                with open(path, "rb") as f:
                    got = f.read()
            except FileNotFoundError:
                continue
            except OSError as exc:
                if exc.errno != errno.ESTALE:
                    raise
                with open(work / "estale.log", "a") as log:
                    log.write(f"{time.time():.3f} {path}\n")
                continue
            with open(work / f"published-{w}.log") as log:
                versions = {line.split()[1] for line in log if line.split()[0] == name}
            assert digest(got) in versions, f"{path}: {len(got)} B never published"
    except Exception:  # noqa: BLE001 - reported to the controller
        errors.put(f"reader {k}: {traceback.format_exc()}")
        paused.set()


def verify(cluster: Cluster, node_of: list[str]) -> None:
    for k, node in enumerate(node_of):
        state = cluster.work / f"expected-{k}.pickle"
        if not state.exists():
            continue
        with open(state, "rb") as f:
            expected = pickle.load(f)
        home = cluster.mnt[node] / "job" / f"w{k}"
        listed = sorted(x for x in os.listdir(home) if not x.startswith("."))
        assert listed == sorted(expected), f"{home}: {listed} != {sorted(expected)}"
        for name, data in expected.items():
            got = (home / name).read_bytes()
            assert got == data, f"{home / name}: {len(got)} B, not the {len(data)} written"


def run(seconds: float, nodes: int, work: Path) -> int:
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    work.chmod(0o777)
    cluster = Cluster(work, nodes)
    for path in (*cluster.mnt.values(), cluster.backing):
        path.mkdir()
    caches = dict.fromkeys(cluster.nodes, f"/dev/shm/ckptfs-stress-{os.getpid()}-0")
    ctx = mp.get_context("fork")
    errors = ctx.Queue()
    go = ctx.Event()
    go.set()
    procs: list[tuple[Any, Any]] = []
    try:
        for node in cluster.nodes:
            cluster.mount(node, caches[node])
        first = cluster.mnt[cluster.nodes[0]]
        node_of = [cluster.nodes[k % nodes] for k in range(WRITERS)]
        for k in range(WRITERS):
            (first / "job" / f"w{k}").mkdir(parents=True)
            published = work / f"published-{k}.log"
            published.touch()
            published.chmod(0o666)  # appended to by the writer, as uid 65534
        subprocess.run(["chown", "-R", f"{UID}:{UID}", str(first / "job")], check=True)
        for k in range(WRITERS):
            home = cluster.mnt[node_of[k]] / "job" / f"w{k}"
            paused = ctx.Event()
            args = (k, home, work, go, paused, errors, random.randrange(1 << 30))
            procs.append((ctx.Process(target=writer, args=args), paused))
        for k in range(READERS):
            node = cluster.nodes[(k + 1) % nodes]
            homes = [cluster.mnt[node] / "job" / f"w{w}" for w in range(WRITERS)]
            paused = ctx.Event()
            args = (k, homes, work, go, paused, errors, random.randrange(1 << 30))
            procs.append((ctx.Process(target=reader, args=args), paused))
        for p, _ in procs:
            p.start()
        failure = control(cluster, caches, node_of, procs, go, errors, seconds)
        if failure:
            print("FAILED:", failure)
            return 1
        for node in cluster.nodes:
            cluster.cli("umount", str(cluster.mnt[node]))
        for node in cluster.nodes:
            cluster.mount(node, f"/dev/shm/ckptfs-stress-{os.getpid()}-final")
        for node in cluster.nodes:
            verify(cluster, [node] * WRITERS)
        for node in cluster.nodes:
            cluster.cli("umount", str(cluster.mnt[node]))
        print(cluster.cli("check", str(cluster.backing)).stdout.strip())
        stale = work / "estale.log"
        print(f"ESTALE opens: {len(stale.read_text().splitlines()) if stale.exists() else 0}")
        print("OK")
        return 0
    finally:
        for p, _ in procs:
            p.kill()
            p.join(10)
        cluster.detach_all()
        for cache in Path("/dev/shm").glob(f"ckptfs-stress-{os.getpid()}-*"):
            shutil.rmtree(cache, ignore_errors=True)


def control(
    cluster: Cluster,
    caches: dict[str, str],
    node_of: list[str],
    procs: list[tuple[Any, Any]],
    go: Any,
    errors: Any,
    seconds: float,
) -> str | None:
    rnd = random.Random()
    start, remounts = time.monotonic(), 0

    def pause() -> None:
        go.clear()
        for _p, paused in procs:
            if not paused.wait(60):
                raise RuntimeError("a worker did not pause within 60 s")

    try:
        while time.monotonic() - start < seconds:
            time.sleep(rnd.uniform(0.5, 3))
            if not errors.empty():
                return str(errors.get())
            node = rnd.choice(cluster.nodes)
            mnt = str(cluster.mnt[node])
            r = rnd.random()
            if r < 0.4:
                cluster.cli("flush", mnt)
            elif r < 0.7:
                cluster.cli("evict", mnt)
            elif r < 0.8:
                cluster.cli("flush", mnt, "--wait", "--timeout", "60")
                cluster.cli("evict", mnt)
            else:
                pause()
                if not errors.empty():
                    return str(errors.get())
                cluster.cli("umount", mnt)
                remounts += 1
                if rnd.random() < 0.5:
                    shutil.rmtree(f"{caches[node]}-{node}", ignore_errors=True)
                    caches[node] = f"/dev/shm/ckptfs-stress-{os.getpid()}-{remounts}"
                cluster.mount(node, caches[node])
                time.sleep(1.0)  # the peers see it alive again
                verify(cluster, node_of)
                go.set()
        pause()
        print(f"ran {time.monotonic() - start:.0f} s, {remounts} remounts")
        return None if errors.empty() else str(errors.get())
    except Exception:  # noqa: BLE001 - the run's result
        return traceback.format_exc()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=300)
    parser.add_argument("--nodes", type=int, choices=[1, 2], default=1)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/ckptfs-stress"))
    args = parser.parse_args()
    if os.geteuid() != 0:
        parser.error("run as root (it mounts, and runs its workers as uid 65534)")
    return run(args.seconds, args.nodes, args.workdir)


if __name__ == "__main__":
    sys.exit(main())
