"""Real ckptfs mounts for tests: each under its own directories, always
unmounted and killed at the end, even on failure, and its log checked then:
an unexpected WARNING, ERROR or traceback fails the test (``mount_factory``;
the ``mounts`` fixtures of tests/conftest.py are made of it)."""

from __future__ import annotations

import io
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, redirect_stderr, redirect_stdout
from pathlib import Path
from typing import Any

from ckptfs.tools import cli
from ckptfs.tools.control import ControlError, find_mount, request
from ports import free_port  # noqa: F401  (tests import it from here)
from waits import wait_for

FUSERMOUNT = "fusermount3"


def is_mounted(path: Path) -> bool:
    with open("/proc/self/mounts") as mounts:
        return any(line.split()[1] == str(path) for line in mounts)


def process_gone(pid: int) -> bool:
    """Whether ``pid`` has exited. A daemon's parent (the mount CLI) is gone,
    so init reaps it, and init here can take over a second: its zombie has
    exited, whatever /proc still shows."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    except FileNotFoundError:
        return True


def fuse_requests(m: Mount) -> dict[str, int]:
    """The daemon's counts of FUSE requests by kind (``ckptfs stat``)."""
    return dict(m.stat()["fuse"]["requests"])


def lines_of_a_killed_peer(name: str) -> list[str]:
    """The warnings a node logs when peer `name` is SIGKILLed: its outbound
    connection lost, the peer reported, and (when the killed process had unread
    bytes, so its kernel answered with a reset) its inbound connection dropped."""
    return [
        f"lost connection to peer '{name}'",
        f"peer '{name}' at 127.0.0.1",
        f"dropped connection from peer '{name}'",
    ]


_ENVIRON = threading.Lock()


@contextmanager
def environ(env: dict[str, str]) -> Iterator[None]:
    """``os.environ`` is ``env`` inside, and as it was after (one at a time)."""
    with _ENVIRON:
        saved = dict(os.environ)
        os.environ.clear()
        os.environ.update(env)
        try:
            yield
        finally:
            os.environ.clear()
            os.environ.update(saved)


def cli_here(args: list[str], env: dict[str, str]) -> tuple[int, str]:
    """``ckptfs ARGS`` with environment ``env``: tools/cli.py's main run in
    this process, as ``python -m ckptfs`` runs it, without an interpreter of
    its own (importing the CLI costs 0.4 s of CPU, on CI's two cores, at each
    of the suite's hundreds of mounts). Its exit code, and what it printed."""
    out, err = io.StringIO(), io.StringIO()
    with environ(env), redirect_stdout(out), redirect_stderr(err):
        code = cli.main(args)
    return code, err.getvalue() + out.getvalue()


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

    # ``mount`` runs the CLI's code in this process (see cli_here); a Mount
    # whose ``cli`` does more than run ``ckptfs`` (as another user) says False.
    mount_in_process = True

    def mount(
        self, *extra: str, cache_size: str = "256MiB", env: dict[str, str] | None = None
    ) -> None:
        """``ckptfs mount MNT --backing BACKING --cache-size SIZE EXTRA...``."""
        args = ["mount", str(self.mnt), "--backing", str(self.backing), "--cache-size", cache_size]
        args += extra
        if not self.mount_in_process:
            self.cli(*args, env=env, timeout=90)
        else:
            code, said = cli_here(args, {**self.env, **(env or {})})
            if code != 0:
                raise AssertionError(f"ckptfs {' '.join(args)} failed: {said}")
        assert is_mounted(self.mnt)
        self.pid = int(
            (
                self.run_dir / next(p.name for p in self.run_dir.iterdir() if p.suffix == ".pid")
            ).read_text()
        )

    def ask(
        self, op: str, path: Path | None = None, *, within: float | None = 30, **fields: Any
    ) -> dict[str, Any]:
        """The daemon's reply to control request ``op`` about ``path`` (default:
        the whole mount), answered within ``within`` seconds, asked from this
        process as the CLI asks it (tools/cli.py, tools/control.py): tests
        poll the daemon often, and a ``ckptfs`` process costs a second of CPU
        on CI's two cores, which the daemons under test need."""
        mountpoint, rel = find_mount(path or self.mnt)
        reply = request(mountpoint, {"op": op, "path": rel, **fields}, within, run=self.run_dir)
        assert reply.pop("ok", False), f"{op} of {path or self.mnt}: {reply}"
        return reply

    def stat(self, path: Path | None = None) -> dict[str, Any]:
        """What ``ckptfs stat PATH --json`` prints (the daemon's stat reply)."""
        return self.ask("stat", path)

    def file_state(self, rel: str) -> str | None:
        for f in self.stat()["files"]:
            if f["path"] == rel:
                return f["state"]
        return None

    def wait_durable(self, timeout: float = 60) -> None:
        """``ckptfs flush MNT --wait --timeout TIMEOUT``: everything durable."""
        self.ask("flush", within=timeout + 30, wait=True, timeout=timeout)

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
            self._unmount_at_teardown()
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
        shutil.rmtree(self.cache_dir, ignore_errors=True)

    def _unmount_at_teardown(self) -> None:
        """What ``ckptfs umount MNT --timeout 20`` does, asked from this
        process (see ``ask``): the daemon flushes for at most 20 s, then
        unmounts and exits; waited for at most 60 s. Whatever is left is
        detached by ``cleanup``."""
        try:
            mountpoint, _ = find_mount(self.mnt)
            request(
                mountpoint, {"op": "unmount", "timeout": 20, "force": False}, 40, run=self.run_dir
            )
        except (ControlError, OSError):
            return
        pid = self.pid
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if not is_mounted(self.mnt) and (pid is None or process_gone(pid)):
                return
            time.sleep(0.05)

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
