"""A ``Type=notify`` unit: the daemon says READY=1 once its mount answers, and
STOPPING=1 when it unmounts (fs/daemon/sdnotify.py, deploy/ckptfs@.service)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from ckptfs.fs.daemon.sdnotify import notify
from conftest import Mount, is_mounted


def messages(sock: socket.socket, until: str, timeout: float) -> list[dict[str, str]]:
    """Datagrams received until one holds ``until`` (each as its fields)."""
    got: list[dict[str, str]] = []
    deadline = time.monotonic() + timeout
    while not any(until in m for m in got):
        left = deadline - time.monotonic()
        assert left > 0, f"no {until} within {timeout}s: {got}"
        sock.settimeout(left)
        data = sock.recv(4096).decode()
        got.append(dict(line.split("=", 1) for line in data.splitlines()))
    return got


def test_notify_reaches_a_path_or_an_abstract_socket_and_is_silent_without_one(
    tmp_path: Path,
) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(str(tmp_path / "notify"))
        assert notify("READY=1", "STATUS=up", environ={"NOTIFY_SOCKET": str(tmp_path / "notify")})
        assert messages(sock, "READY", 5) == [{"READY": "1", "STATUS": "up"}]
    name = f"ckptfs-test-{os.getpid()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        assert notify("STOPPING=1", environ={"NOTIFY_SOCKET": "@" + name})
        assert messages(sock, "STOPPING", 5) == [{"STOPPING": "1"}]
    assert not notify("READY=1", environ={})


def test_ready_comes_once_the_mount_answers_and_stopping_at_the_unmount(mounts) -> None:
    m: Mount = mounts()
    address = m.root / "notify.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(str(address))
        # As systemd runs it: in the foreground, the daemon as the main process.
        daemon = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "ckptfs",
                "mount",
                str(m.mnt),
                "--backing",
                str(m.backing),
                "--cache-size",
                "64MiB",
                "--foreground",
            ],  # fmt: skip
            env={**m.env, "NOTIFY_SOCKET": str(address)},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        m.pid = daemon.pid  # cleaned up by the fixture, whatever happens here
        try:
            (ready,) = messages(sock, "READY", 60)
            # At READY the mount is there and answers, with no wait.
            assert is_mounted(m.mnt)
            assert os.listdir(m.mnt) == []
            assert ready["MAINPID"] == str(daemon.pid)
            assert ready["STATUS"] == f"mounted {m.mnt} over {m.backing}"
            (m.mnt / "a.bin").write_bytes(b"x" * 1000)
            m.cli("umount", str(m.mnt))
            assert messages(sock, "STOPPING", 30)[-1] == {"STOPPING": "1"}
            assert daemon.wait(timeout=30) == 0
            assert "everything was durable" in m.log()
        finally:
            if daemon.poll() is None:
                daemon.kill()
                daemon.wait(timeout=30)
