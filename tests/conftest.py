"""Real FUSE mounts for tests, always unmounted and killed, even on failure.

Each mount gets its own mountpoint, backing directory, cache directory and run
directory under pytest's tmp_path. At teardown the daemon's log is checked:
an unexpected WARNING, ERROR or traceback fails the test.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

FUSERMOUNT = "fusermount3"


def is_mounted(path: Path) -> bool:
    with open("/proc/self/mounts") as mounts:
        return any(line.split()[1] == str(path) for line in mounts)


def wait_for(predicate: Any, timeout: float, what: str, interval: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = predicate()
        if result:
            return result
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def free_port() -> int:
    """A loopback TCP port free now (a peer's, a rendezvous')."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def process_gone(pid: int) -> bool:
    """Whether ``pid`` has exited. A daemon's parent (the mount CLI) is gone,
    so init reaps it, and init here can take over a second: its zombie has
    exited, whatever /proc still shows."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    except FileNotFoundError:
        return True


def lines_of_a_killed_peer(name: str) -> list[str]:
    """The warnings a node logs when peer `name` is SIGKILLed: its outbound
    connection lost, the peer reported, and (when the killed process had unread
    bytes, so its kernel answered with a reset) its inbound connection dropped."""
    return [
        f"lost connection to peer '{name}'",
        f"peer '{name}' at 127.0.0.1",
        f"dropped connection from peer '{name}'",
    ]


class Mount:
    def __init__(self, root: Path, name: str = "m") -> None:
        self.root = root
        self.mnt = root / f"{name}-mnt"
        self.backing = root / "backing"
        self.run_dir = root / f"{name}-run"
        self.cache_dir = Path("/dev/shm") / f"ckptfs-test-{os.getpid()}-{root.name}-{name}"
        for d in (self.mnt, self.backing, self.run_dir):
            d.mkdir(parents=True, exist_ok=True)
        self.env = {
            **os.environ,
            "CKPTFS_RUN_DIR": str(self.run_dir),
            "CKPTFS_CACHE_DIR": str(self.cache_dir),
        }
        self.allowed_log: list[str] = []
        self.pid: int | None = None

    def cli(
        self,
        *args: str,
        check: bool = True,
        timeout: float = 120,
        env: dict[str, str] | None = None,
    ) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(
            [sys.executable, "-m", "ckptfs", *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            env={**self.env, **(env or {})},
        )
        if check and proc.returncode != 0:
            raise AssertionError(f"ckptfs {' '.join(args)} failed: {proc.stderr}{proc.stdout}")
        return proc

    def mount(
        self, *extra: str, cache_size: str = "256MiB", env: dict[str, str] | None = None
    ) -> None:
        self.cli(
            "mount",
            str(self.mnt),
            "--backing",
            str(self.backing),
            "--cache-size",
            cache_size,
            *extra,
            env=env,
            timeout=90,
        )
        assert is_mounted(self.mnt)
        self.pid = int(
            (
                self.run_dir / next(p.name for p in self.run_dir.iterdir() if p.suffix == ".pid")
            ).read_text()
        )

    def stat(self, path: Path | None = None) -> dict[str, Any]:
        return json.loads(self.cli("stat", str(path or self.mnt), "--json").stdout)

    def file_state(self, rel: str) -> str | None:
        for f in self.stat()["files"]:
            if f["path"] == rel:
                return f["state"]
        return None

    def wait_durable(self, timeout: float = 60) -> None:
        self.cli("flush", str(self.mnt), "--wait", "--timeout", str(timeout), timeout=timeout + 30)

    def log(self) -> str:
        return "".join(p.read_text(errors="replace") for p in self.run_dir.glob("*.log"))

    def umount(self) -> None:
        self.cli("umount", str(self.mnt), timeout=120)
        assert not is_mounted(self.mnt)

    def kill(self) -> None:
        """SIGKILL the daemon (a crash); the mount is left dead until detached."""
        assert self.pid is not None
        os.kill(self.pid, signal.SIGKILL)
        pid = self.pid
        wait_for(lambda: process_gone(pid), 10, "daemon death")
        subprocess.run([FUSERMOUNT, "-u", "-z", str(self.mnt)], capture_output=True, timeout=30)

    def cleanup(self) -> None:
        if is_mounted(self.mnt):
            try:
                self.cli("umount", str(self.mnt), "--timeout", "20", check=False, timeout=40)
            except subprocess.TimeoutExpired:
                pass
        if is_mounted(self.mnt):
            subprocess.run([FUSERMOUNT, "-u", "-z", str(self.mnt)], capture_output=True, timeout=30)
        if self.pid is not None:
            deadline = time.monotonic() + 5
            while not process_gone(self.pid) and time.monotonic() < deadline:
                time.sleep(0.05)
            for sig in (signal.SIGTERM, signal.SIGKILL):
                if process_gone(self.pid):
                    break
                try:
                    os.kill(self.pid, sig)
                    time.sleep(0.2)
                except ProcessLookupError:
                    break
        subprocess.run(["rm", "-rf", str(self.cache_dir)], timeout=60)

    def unexpected_log_lines(self) -> list[str]:
        bad = []
        for line in self.log().splitlines():
            if any(level in line for level in (" WARNING ", " ERROR ", " CRITICAL ", "Traceback")):
                if not any(allowed in line for allowed in self.allowed_log):
                    bad.append(line)
        return bad


@contextmanager
def mount_factory(root: Path, *, run_dir_mode: int | None = None) -> Iterator[Any]:
    """``make("n1")`` returns a Mount under ``root`` (not yet mounted); every
    mount is cleaned up, and its log checked, at the end."""
    made: list[Mount] = []

    def make(name: str = "m") -> Mount:
        m = Mount(root, name)
        if run_dir_mode is not None:
            m.run_dir.chmod(run_dir_mode)
        made.append(m)
        return m

    try:
        yield make
    finally:
        problems = []
        for m in made:
            m.cleanup()
            problems += m.unexpected_log_lines()
        assert not problems, "unexpected daemon log lines:\n" + "\n".join(problems)


@pytest.fixture
def mounts(tmp_path: Path) -> Iterator[Any]:
    """Factory: ``mounts("n1")`` returns a Mount (not yet mounted)."""
    with mount_factory(tmp_path) as make:
        yield make


@pytest.fixture
def shared_mounts() -> Iterator[Any]:
    """Like ``mounts``, under a directory every user may traverse (pytest's
    tmp_path is 0700 to root)."""
    root = Path(tempfile.mkdtemp(prefix="ckptfs-users-", dir="/tmp"))
    root.chmod(0o755)
    try:
        with mount_factory(root, run_dir_mode=0o755) as make:
            yield make
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def mounted(mounts: Any) -> Mount:
    m = mounts()
    m.mount()
    return m


@pytest.fixture
def h(tmp_path: Path) -> Iterator[Any]:
    """A ckptfs Core driven without FUSE (lifecycle_harness.py), started."""
    from lifecycle_harness import Harness

    harness = Harness(tmp_path)
    harness.start()
    yield harness
    harness.close()


def store_key(path: Path, backing: Path | None = None) -> bytes:
    """The manifest key of the backing directory ``backing`` (made if it has
    none), or of the first at or above ``path`` with a .ckptfs: what a
    daemon of that store seals its manifests with."""
    from ckptfs.fs.store.storedirs import CKPTFS_DIR, StoreDirs

    if backing is None:
        backing = next((r for r in (path, *path.parents) if (r / CKPTFS_DIR).is_dir()), None)
    if backing is None:
        raise AssertionError(f"no backing directory (with .ckptfs) at or above {path}")
    dirs = StoreDirs(backing)
    try:
        return dirs.manifest_key()
    finally:
        dirs.close()


def write_store_manifest(
    path: Path, manifest: Any, backing: Path | None = None, **kwargs: Any
) -> None:
    """A manifest written into a backing directory as a ckptfs daemon of that
    store would (sealed): for tests that stand for another node."""
    from ckptfs.fs.store.manifest import write_manifest

    write_manifest(path, manifest, key=store_key(path.parent, backing), **kwargs)
