"""Real ckptfs daemons, each in its own network namespace, over one shared
stand-in store (tests/support/countingfs.py with fault injection).

Each daemon is started with ``nsenter --net`` only: it has its own network
(its own address, which the peers' identity check needs) but this process's
mount namespace, so its FUSE mount is a directory here like any other. The
control sockets are Unix sockets in a run directory, reached from here
whatever the network namespace.

Every wait is bounded; :meth:`Cluster.close` kills, unmounts and removes
everything it started, in any state (a daemon stopped with SIGSTOP, a mount
whose daemon is dead, a stalled store).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckptfs.fs.daemon.preflight import run_files
from ckptfs.tools.control import ControlError, request
from countingfs import CountingMount, counting_mount
from mounts import is_mounted

from . import spawner
from .netns import Network

PEER_PORT = 7070
MOUNT_TIMEOUT = 90.0
KILL_TIMEOUT = 10.0
CLI_TIMEOUT = 120.0
SECRET = "ckptfs fault trials: a secret for test hosts only\n"


class ClusterError(RuntimeError):
    pass


@dataclass
class NodeGate:
    """Whether a node's mount may be used now. Workload operations hold it
    shared (:meth:`use`); a restart holds it alone, so that nothing touches
    the bare mountpoint directory between the unmount and the new mount."""

    state: str = "up"  # up | dead | stopped | restarting
    users: int = 0
    cond: threading.Condition = field(default_factory=threading.Condition)

    @contextmanager
    def use(self) -> Iterator[bool]:
        """Yields whether the node is up; while it yields, no restart starts."""
        with self.cond:
            if self.state == "restarting":
                yield False
                return
            self.users += 1
            up = self.state == "up"
        try:
            yield up
        finally:
            with self.cond:
                self.users -= 1
                self.cond.notify_all()

    @contextmanager
    def exclusive(self, timeout: float) -> Iterator[None]:
        with self.cond:
            before = self.state
            self.state = "restarting"
            if not self.cond.wait_for(lambda: self.users == 0, timeout):
                self.state = before
                raise ClusterError(f"mount still in use after {timeout:g}s")
        yield


@dataclass
class Node:
    name: str
    mnt: Path
    cache_dir: Path
    env: dict[str, str]
    pid: int | None = None
    gate: NodeGate = field(default_factory=NodeGate)
    log_offset: int = 0


class Cluster:
    """``nodes`` daemons over one store under ``workdir``; a context manager."""

    def __init__(
        self,
        workdir: Path,
        nodes: list[str],
        node_env: dict[str, dict[str, str]] | None = None,
        peer_timeout: float = 2.0,
        heartbeat: float = 0.25,
        cache_size: str = "256MiB",
    ) -> None:
        self.workdir = workdir
        self.names = nodes
        self.net = Network(nodes)
        self.run_dir = workdir / "run"
        self.backing = workdir / "backing"
        self.config = workdir / "cluster.yaml"
        self.cache_size = cache_size
        self.peer_timeout, self.heartbeat = peer_timeout, heartbeat
        tag = f"ckptfs-faults-{os.getpid()}"
        self.nodes = {
            n: Node(
                n,
                workdir / f"mnt-{n}",
                Path("/dev/shm") / f"{tag}-{n}",
                {
                    **os.environ,
                    "CKPTFS_RUN_DIR": str(self.run_dir),
                    "CKPTFS_CACHE_DIR": str(Path("/dev/shm") / f"{tag}-{n}"),
                    **(node_env or {}).get(n, {}),
                },
            )
            for n in nodes
        }
        self.store: CountingMount | None = None
        self._stack = ExitStack()
        # Held by every mount; close() takes it and sets `closing`, so that
        # no daemon starts (a fault's restart in another thread) once the
        # daemons are being stopped.
        self._mount_lock = threading.Lock()
        self.closing = False

    # ----- setting up and tearing down ------------------------------------------------
    def __enter__(self) -> Cluster:
        try:
            self.open()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def open(self) -> None:
        # First: every command from here on starts from a process that has
        # none of the workload's files open (faults/spawner.py).
        spawner.start()
        self._stack.callback(spawner.stop)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.run_dir.mkdir(exist_ok=True)
        self._stack.callback(self.net.close)
        self.net.open()
        self.store = self._stack.enter_context(
            counting_mount(self.workdir / "backing-real", self.backing, faults=True)
        )
        self._write_config()
        self._stack.callback(self._stop_daemons)
        errors: list[str] = []

        def start(node: Node) -> None:
            try:
                self.mount(node)
            except ClusterError as exc:
                errors.append(str(exc))

        threads = [threading.Thread(target=start, args=(n,)) for n in self.nodes.values()]
        for t in threads:
            t.start()
        for t in threads:
            t.join(MOUNT_TIMEOUT + 30)
        if errors:
            raise ClusterError("; ".join(errors))
        self.wait_alive(60)

    def _write_config(self) -> None:
        secret = self.workdir / "secret"
        secret.write_text(SECRET)
        secret.chmod(0o600)
        nodes = ", ".join(f"{n}: {self.net.ip(n)}:{PEER_PORT}" for n in self.names)
        self.config.write_text(
            f"peers:\n  secret_file: {secret}\n  nodes: {{{nodes}}}\n"
            f"  timeout: {self.peer_timeout}\n  heartbeat: {self.heartbeat}\n"
        )

    def close(self) -> None:
        self._stack.close()

    def _stop_daemons(self) -> None:
        """Kill every daemon (a stopped one too), detach its mount, drop its cache."""
        taken = self._mount_lock.acquire(timeout=MOUNT_TIMEOUT + 20)
        self.closing = True
        if taken:
            self._mount_lock.release()
        for node in self.nodes.values():
            pid = node.pid or self._pid_file(node)
            if pid is not None:
                for sig in (signal.SIGCONT, signal.SIGKILL):
                    try:
                        os.kill(pid, sig)
                    except ProcessLookupError:
                        break
                wait_gone(pid, KILL_TIMEOUT)
            detach(node.mnt)
            shutil.rmtree(node.cache_dir, ignore_errors=True)

    # ----- daemons -----------------------------------------------------------------
    def mount(self, node: Node) -> None:
        """Start ``node``'s daemon in its namespace; returns once its mount answers."""
        argv = [*self.net.nsenter(node.name), sys.executable, "-m", "ckptfs", "mount",
                str(node.mnt), "--backing", str(self.backing), "--config", str(self.config),
                "--node", node.name, "--cache-size", self.cache_size]  # fmt: skip
        node.mnt.mkdir(parents=True, exist_ok=True)
        with self._mount_lock:
            if self.closing:
                raise ClusterError(f"not mounting {node.name}: the cluster is closing")
            try:
                done = spawner.run(argv, env=node.env, timeout=MOUNT_TIMEOUT + 10)
            except subprocess.TimeoutExpired:
                raise ClusterError(f"mount of {node.name} did not return in time") from None
        if done.returncode != 0 or not is_mounted(node.mnt):
            raise ClusterError(f"mount of {node.name} failed: {done.stderr.strip()}")
        node.pid = self._pid_file(node)
        node.gate.state = "up"

    def _pid_file(self, node: Node) -> int | None:
        try:
            return int(run_files(self.run_dir, node.mnt)[1].read_text())
        except (OSError, ValueError):
            return None

    def kill(self, name: str, lose_ram: bool) -> None:
        """kill -9 of ``name``'s daemon; with ``lose_ram`` its cache goes too
        (the node's RAM lost with it). Its mount stays, dead, until :meth:`restart`."""
        node = self.nodes[name]
        assert node.pid is not None
        node.gate.state = "dead"
        for sig in (signal.SIGKILL, signal.SIGCONT):
            try:
                os.kill(node.pid, sig)
            except ProcessLookupError:
                pass
        if not wait_gone(node.pid, KILL_TIMEOUT):
            raise ClusterError(f"{name}'s daemon (pid {node.pid}) survived SIGKILL")
        if lose_ram:
            shutil.rmtree(node.cache_dir, ignore_errors=True)

    def restart(self, name: str) -> None:
        node = self.nodes[name]
        with node.gate.exclusive(60):
            detach(node.mnt)
            try:
                self.mount(node)
            except ClusterError:
                node.gate.state = "dead"
                raise

    def stop(self, name: str) -> None:
        node = self.nodes[name]
        assert node.pid is not None
        node.gate.state = "stopped"
        os.kill(node.pid, signal.SIGSTOP)

    def cont(self, name: str) -> None:
        node = self.nodes[name]
        if node.pid is not None:
            try:
                os.kill(node.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        if node.gate.state == "stopped":
            node.gate.state = "up"

    # ----- asking the daemons -------------------------------------------------------
    def ask(self, name: str, payload: dict[str, Any], timeout: float = 30) -> dict[str, Any]:
        try:
            return request(self.nodes[name].mnt, payload, timeout, run=self.run_dir)
        except (ControlError, OSError, ValueError) as exc:
            return {"ok": False, "error": str(exc)}

    def cli(self, name: str, *args: str, timeout: float = CLI_TIMEOUT) -> tuple[int, str]:
        """``ckptfs ARGS`` as the operator runs it on ``name``: (exit code, output)."""
        try:
            done = spawner.run(
                [*self.net.nsenter(name), sys.executable, "-m", "ckptfs", *args],
                env=self.nodes[name].env,
                timeout=timeout,
            )
        except subprocess.TimeoutExpired:
            return -1, f"ckptfs {' '.join(args)}: no answer within {timeout:g}s"
        return done.returncode, done.stdout + done.stderr

    def check(self, name: str, rel: str) -> tuple[int, str]:
        """``ckptfs check`` of ``rel`` (a path in the mount), run on ``name``."""
        return self.cli(name, "check", str(self.nodes[name].mnt / rel))

    def _stat(self, name: str) -> dict[str, Any]:
        reply = self.ask(name, {"op": "stat", "path": ""}, timeout=10)
        return reply if reply.get("ok") else {}

    def wait_alive(self, timeout: float) -> None:
        """Until every node sees every other alive, as the process running
        now: a node restarted before the others noticed its death is seen
        alive at once, but its takeover starts only once they see its new
        process (peer/node.py)."""
        deadline = time.monotonic() + timeout
        waiting = list(self.names)
        while waiting and time.monotonic() < deadline:
            stats = {n: self._stat(n) for n in self.names}  # one look at each node a round
            now = {n: st.get("incarnation") for n, st in stats.items()}
            waiting = [
                n
                for n in waiting
                if not stats[n].get("peers")
                or not all(
                    p.get("alive") and p.get("incarnation") == now.get(p.get("name"))
                    for p in stats[n]["peers"]
                )
            ]
            if waiting:
                time.sleep(0.1)
        if waiting:
            raise ClusterError(f"after {timeout:g}s, {', '.join(waiting)} still miss peers")

    # ----- logs ---------------------------------------------------------------------
    def log_path(self, name: str) -> Path:
        return run_files(self.run_dir, self.nodes[name].mnt)[2]

    def mark_logs(self) -> None:
        for name, node in self.nodes.items():
            try:
                node.log_offset = self.log_path(name).stat().st_size
            except OSError:
                node.log_offset = 0

    def log_since_mark(self, name: str) -> str:
        try:
            with open(self.log_path(name), "rb") as f:
                f.seek(self.nodes[name].log_offset)
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def stat(self, name: str) -> dict[str, Any]:
        return self.ask(name, {"op": "stat", "path": ""}, timeout=10)


def wait_gone(pid: int, timeout: float) -> bool:
    """Whether ``pid`` exited (or is a zombie) within ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z":
                return True
        except (FileNotFoundError, IndexError):
            return True
        time.sleep(0.02)
    return False


def detach(mnt: Path) -> None:
    """Lazy unmount of ``mnt`` if mounted: it goes now, whatever still uses it."""
    if is_mounted(mnt):
        spawner.run(["fusermount3", "-u", "-z", str(mnt)], timeout=30)


def dump_json(data: Any) -> str:
    return json.dumps(data, indent=1, sort_keys=True, default=str)
