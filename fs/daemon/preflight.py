"""Checks done before mounting, each failing with a one-line message."""

from __future__ import annotations

import errno
import hashlib
import os
from pathlib import Path

from ckptfs.fs.store.beneath import NotPrivate, make_private_path
from ckptfs.fs.store.storedirs import CHUNKS, StoreDirs


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
    except OSError as exc:
        reason = (
            "permission denied"
            if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS)
            else exc.strerror
        )
        raise MountError(f"backing directory {backing} is not writable: {reason}") from None
    try:
        dirs = StoreDirs(resolved)
        try:
            dirs.private(CHUNKS)
            dirs.manifest_key()
            if os.geteuid() == 0:
                _check_root_acts_as_root(dirs)
        finally:
            dirs.close()
    except NotPrivate as exc:
        raise MountError(str(exc.strerror)) from None
    except OSError as exc:
        raise MountError(f"backing directory {backing}: {exc.strerror or exc}") from None
    return resolved


def _check_root_acts_as_root(dirs: StoreDirs) -> None:
    """The daemon runs as root and makes each user's files theirs (chown):
    a store that does not let root do that (NFS root_squash, all_squash)
    would leave every file the daemon's, or the squashed user's."""
    name = f".squash-test.{os.getpid()}"
    fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600,
                 dir_fd=dirs.private())  # fmt: skip
    try:
        made = os.fstat(fd)
        try:
            os.fchown(fd, 65534, 65534)
            chowned = os.fstat(fd).st_uid == 65534
        except PermissionError:
            chowned = False
    finally:
        os.close(fd)
        os.unlink(name, dir_fd=dirs.private())
    if made.st_uid != 0 or not chowned:
        raise MountError(
            f"backing directory {dirs.root} does not let root act as root (files root makes "
            f"there belong to uid {made.st_uid}{'' if chowned else ', and chown is refused'}: "
            "NFS root_squash?): the daemon makes each user's files theirs; export it to the "
            "nodes with no_root_squash, or run the daemon as the job's user"
        )


def check_cache_dir(cache_dir: Path, mountpoint: Path, size: int) -> None:
    """The cache budget must fit in cache.dir (tmpfs), counting an arena a
    previous daemon of this mount left there (its pages are already ours)."""
    try:
        # The journal that recovery reads: a user who made the directory
        # first would control it.
        make_private_path(cache_dir)
        st = os.statvfs(cache_dir)
    except NotPrivate as exc:
        raise MountError(f"cache directory unsafe: {exc.strerror}") from None
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
