"""Checks done before mounting, each failing with a one-line message."""

from __future__ import annotations

import errno
import hashlib
import os
from pathlib import Path


class MountError(Exception):
    pass


def is_mounted(path: Path) -> bool:
    target = os.path.realpath(path)
    with open("/proc/self/mounts") as mounts:
        return any(line.split()[1] == target for line in mounts if len(line.split()) > 1)


def check_mountpoint(mountpoint: Path) -> Path:
    try:
        # A STATFS, not a stat: it always reaches a FUSE daemon, while a stat
        # may be answered from the root's attributes the kernel keeps for a
        # second, so a mount whose daemon was killed just now is seen dead.
        os.statvfs(mountpoint)
    except FileNotFoundError:
        raise MountError(f"mountpoint {mountpoint} does not exist") from None
    except OSError as exc:
        if exc.errno == errno.ENOTCONN:
            # A daemon that died leaves its mount behind, answering nothing.
            raise MountError(
                f"mountpoint {mountpoint} is a dead ckptfs mount (its daemon is gone): "
                f"detach it with `fusermount3 -u -z {mountpoint}`, then mount again "
                "with the same cache dir to recover what was not yet durable"
            ) from None
        raise MountError(f"mountpoint {mountpoint}: {exc.strerror}") from None
    if not mountpoint.is_dir():
        raise MountError(f"mountpoint {mountpoint} is not a directory")
    if is_mounted(mountpoint):
        raise MountError(f"mountpoint {mountpoint} is already mounted")
    if any(os.scandir(mountpoint)):
        raise MountError(f"mountpoint {mountpoint} is not empty")
    return mountpoint.resolve()


def check_backing(backing: Path | None, mountpoint: Path) -> Path:
    if backing is None:
        raise MountError("no backing directory: pass --backing DIR or set 'backing' in the config")
    if not backing.exists():
        raise MountError(f"backing directory {backing} does not exist")
    if not backing.is_dir():
        raise MountError(f"backing directory {backing} is not a directory")
    resolved = backing.resolve()
    if resolved == mountpoint or mountpoint in resolved.parents:
        raise MountError(f"backing directory {backing} lies inside the mountpoint {mountpoint}")
    probe = resolved / f".ckptfs-write-test.{os.getpid()}"
    try:
        probe.write_bytes(b"")
        probe.unlink()
        (resolved / ".ckptfs" / "chunks").mkdir(parents=True, exist_ok=True)
        # Chunks hold every file's bytes whatever the file's mode: only the
        # daemon (and root's offline tools) may read them. Users read through
        # the mount, where the manifest's owner and mode are enforced.
        if os.geteuid() == 0:
            os.chmod(resolved / ".ckptfs", 0o700)
    except OSError as exc:
        reason = (
            "permission denied"
            if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS)
            else exc.strerror
        )
        raise MountError(f"backing directory {backing} is not writable: {reason}") from None
    return resolved


def check_cache_dir(cache_dir: Path, mountpoint: Path, size: int) -> None:
    """The cache budget must fit in cache.dir (tmpfs), counting an arena a
    previous daemon of this mount left there (its pages are already ours)."""
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        st = os.statvfs(cache_dir)
    except OSError as exc:
        raise MountError(f"cache directory {cache_dir} is not usable: {exc.strerror}") from None
    arena = cache_dir / mount_id(mountpoint) / "arena"
    reusable = arena.stat().st_blocks * 512 if arena.exists() else 0
    free = st.f_bavail * st.f_frsize + reusable
    if free < size:
        raise MountError(
            f"cache directory {cache_dir} has {free >> 20} MiB free, "
            f"cache.size needs {size >> 20} MiB"
        )


def mount_id(mountpoint: Path) -> str:
    """A stable name for a mount's run files and cache directory."""
    return hashlib.sha1(str(mountpoint).encode()).hexdigest()[:12]


def run_files(run_dir: Path, mountpoint: Path) -> tuple[Path, Path, Path]:
    """(control socket, pid file, log file) of the daemon serving ``mountpoint``."""
    ident = mount_id(mountpoint)
    return run_dir / f"{ident}.sock", run_dir / f"{ident}.pid", run_dir / f"{ident}.log"
