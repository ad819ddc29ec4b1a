"""The control client: find the daemon that serves a path and ask it things."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from typing import Any

from ckptfs.fs.preflight import run_files

FSTYPE = "fuse.ckptfs"


class ControlError(Exception):
    pass


def run_dir() -> Path:
    return Path(os.environ.get("CKPTFS_RUN_DIR", "/run/ckptfs"))


def ckptfs_mounts() -> list[Path]:
    with open("/proc/self/mounts") as mounts:
        fields = [line.split() for line in mounts]
    return [Path(f[1].replace("\\040", " ")) for f in fields if len(f) > 2 and f[2] == FSTYPE]


def find_mount(path: Path) -> tuple[Path, str]:
    """The ckptfs mountpoint containing ``path``, and ``path`` relative to it."""
    if not path.exists() and not os.path.lexists(path):
        raise ControlError(f"{path} does not exist")
    # realpath of a path inside a dead mount fails with ENOTCONN: stay lexical then.
    target = Path(os.path.abspath(path))
    try:
        target = Path(os.path.realpath(path))
    except OSError:
        pass
    best = None
    for mnt in ckptfs_mounts():
        if (target == mnt or mnt in target.parents) and (
            best is None or len(mnt.parts) > len(best.parts)
        ):
            best = mnt
    if best is None:
        raise ControlError(f"no ckptfs daemon serves {path} (not inside a ckptfs mount)")
    rel = "" if target == best else str(target.relative_to(best))
    return best, rel


def request(
    mountpoint: Path, payload: dict[str, Any], timeout: float | None = 30
) -> dict[str, Any]:
    sock_path, _, _ = run_files(run_dir(), mountpoint)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        try:
            sock.connect(str(sock_path))
        except (FileNotFoundError, ConnectionRefusedError):
            raise ControlError(
                f"no ckptfs daemon answers for {mountpoint} (no control socket at {sock_path})"
            ) from None
        try:
            sock.sendall(json.dumps(payload).encode() + b"\n")
            data = b""
            while not data.endswith(b"\n"):
                piece = sock.recv(1 << 16)
                if not piece:
                    break
                data += piece
        except TimeoutError:
            raise ControlError(
                f"the ckptfs daemon for {mountpoint} did not answer in time"
            ) from None
    if not data:
        raise ControlError(f"the ckptfs daemon for {mountpoint} closed the connection")
    return json.loads(data)


def daemon_pid(mountpoint: Path) -> int | None:
    _, pid_path, _ = run_files(run_dir(), mountpoint)
    try:
        return int(pid_path.read_text().strip())
    except (OSError, ValueError):
        return None
