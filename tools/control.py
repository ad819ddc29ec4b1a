"""The control client: find the daemon that serves a path and ask it things."""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

from ckptfs import __version__
from ckptfs.fs.config import load_config
from ckptfs.fs.daemon.preflight import run_files

FSTYPE = "fuse.ckptfs"


class ControlError(Exception):
    pass


DEFAULT_RUN_DIR = Path("/run/ckptfs")


def run_dir(config: str | None = None) -> Path:
    """Where the daemons' control sockets are, resolved as the daemon resolves
    it: CKPTFS_RUN_DIR, else the ``run_dir`` of the config file the mount
    used (``--config``), else /run/ckptfs."""
    if "CKPTFS_RUN_DIR" in os.environ:
        return Path(os.environ["CKPTFS_RUN_DIR"])
    if config is not None:
        return load_config(config).run_dir
    return DEFAULT_RUN_DIR


def ckptfs_mounts() -> list[Path]:
    with open("/proc/self/mounts") as mounts:
        fields = [line.split() for line in mounts]
    return [Path(f[1].replace("\\040", " ")) for f in fields if len(f) > 2 and f[2] == FSTYPE]


def find_mount(path: Path) -> tuple[Path, str]:
    """The ckptfs mountpoint containing ``path``, and ``path`` relative to it.

    A path that lies lexically inside a mount is resolved without touching
    the mount: a stat there would wait for the daemon, and a client blocked
    on a wedged FUSE mount cannot even be killed, which is exactly when an
    operator runs ``ckptfs stat``. Other paths are resolved (symlinks may lead
    into a mount).
    """
    mounts = ckptfs_mounts()
    lexical = Path(os.path.abspath(path))
    found = _innermost(lexical, mounts)
    if found is None:
        if not os.path.lexists(path):
            raise ControlError(f"{path} does not exist")
        try:
            found = _innermost(Path(os.path.realpath(path)), mounts)
        except OSError:
            found = None
    if found is None:
        raise ControlError(f"no ckptfs daemon serves {path} (not inside a ckptfs mount)")
    return found


def _innermost(target: Path, mounts: list[Path]) -> tuple[Path, str] | None:
    best = None
    for mnt in mounts:
        if (target == mnt or mnt in target.parents) and (
            best is None or len(mnt.parts) > len(best.parts)
        ):
            best = mnt
    if best is None:
        return None
    return best, "" if target == best else str(target.relative_to(best))


# A daemon that refuses a connection as one too many ("busy": the caller's
# user holds its share already) is asked again for this long.
BUSY_RETRY = 5.0


def request(
    mountpoint: Path, payload: dict[str, Any], timeout: float | None = 30, run: Path | None = None
) -> dict[str, Any]:
    """One request to the daemon of ``mountpoint``, whose control socket is in
    ``run`` (default: ``run_dir()``)."""
    sock_path, _, _ = run_files(run or run_dir(), mountpoint)
    deadline = time.monotonic() + min(BUSY_RETRY, timeout if timeout is not None else BUSY_RETRY)
    pause = 0.05
    while True:
        reply = _request_once(mountpoint, sock_path, payload, timeout)
        if not reply.get("busy") or time.monotonic() + pause > deadline:
            return reply
        time.sleep(pause)
        pause = min(pause * 2, 0.5)


def _request_once(
    mountpoint: Path, sock_path: Path, payload: dict[str, Any], timeout: float | None
) -> dict[str, Any]:
    try:
        data = exchange(sock_path, payload, timeout)
    except (FileNotFoundError, ConnectionRefusedError):
        raise ControlError(
            f"no ckptfs daemon answers for {mountpoint} (no control socket at {sock_path})"
        ) from None
    except TimeoutError:
        raise ControlError(f"the ckptfs daemon for {mountpoint} did not answer in time") from None
    except OSError as exc:
        raise ControlError(
            f"could not ask the ckptfs daemon for {mountpoint} (control socket {sock_path}): "
            f"{exc.strerror or exc}"
        ) from None
    if not data:
        raise ControlError(f"the ckptfs daemon for {mountpoint} closed the connection")
    reply = json.loads(data)
    _warn_if_other_version(mountpoint, reply)
    return reply


_warned: set[str] = set()


def _warn_if_other_version(mountpoint: Path, reply: dict[str, Any]) -> None:
    """Say once per mount when its daemon runs another version than this CLI:
    after an upgrade, a mount keeps its old daemon until it is remounted, and
    a request or reply field the two disagree on would otherwise just look
    wrong. A reply without a version comes from a daemon older than 0.1.0."""
    theirs = reply.get("version", "older than 0.1.0")
    if theirs == __version__ or str(mountpoint) in _warned:
        return
    _warned.add(str(mountpoint))
    print(
        f"ckptfs: note: the daemon of {mountpoint} runs ckptfs {theirs}, this command is "
        f"{__version__}; remount it (ckptfs umount, then mount) to run {__version__}",
        file=sys.stderr,
    )


def exchange(sock_path: Path, payload: dict[str, Any], timeout: float | None) -> bytes:
    """Send one request line to a control socket; return the reply line (raw)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        _connect(sock, sock_path, timeout)
        try:
            sock.sendall(json.dumps(payload).encode() + b"\n")
        except (BrokenPipeError, ConnectionResetError):
            pass  # refused before our request arrived: its reply says why
        data = b""
        while not data.endswith(b"\n"):
            piece = sock.recv(1 << 16)
            if not piece:
                break
            data += piece
    return data


def _connect(sock: socket.socket, sock_path: Path, timeout: float | None) -> None:
    """Connect within ``timeout``. With a timeout set the socket does not block,
    and a Unix socket whose queue of pending connections is full answers
    EAGAIN at once rather than waiting: try again until the timeout."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        try:
            sock.connect(str(sock_path))
            return
        except BlockingIOError:
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(
                    f"{sock_path}: the daemon's connection queue stayed full"
                ) from None
            time.sleep(0.005)


def daemon_pid(mountpoint: Path, run: Path | None = None) -> int | None:
    _, pid_path, _ = run_files(run or run_dir(), mountpoint)
    try:
        return int(pid_path.read_text().strip())
    except (OSError, ValueError):
        return None


def live_daemons(timeout: float = 2.0) -> list[dict[str, Any]]:
    """Every daemon answering on a control socket in the run dir (its ping reply:
    mountpoint, backing, node, pid)."""
    found = []
    directory = run_dir()
    try:
        sockets = sorted(directory.glob("*.sock"))
    except OSError:
        return []
    for sock_path in sockets:
        try:
            reply = json.loads(exchange(sock_path, {"op": "ping"}, timeout))
        except (OSError, ValueError):
            continue  # a stale socket, or a daemon that does not answer
        if isinstance(reply, dict) and reply.get("ok") and reply.get("backing"):
            found.append(reply)
    return found
