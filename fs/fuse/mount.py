"""Mounting and unmounting a FUSE filesystem whose requests this process reads.

Root mounts with mount(2) on a /dev/fuse descriptor of its own; anyone else
asks the setuid ``fusermount3`` to do it and to pass the descriptor back over
a socket (the ``_FUSE_COMMFD`` protocol of libfuse), as libfuse does.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import logging
import os
import socket
import stat
import subprocess
from collections.abc import Iterable

log = logging.getLogger(__name__)

MS_NOSUID = 2
MS_NODEV = 4
MNT_DETACH = 2
FUSERMOUNT = "fusermount3"

_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p] * 3 + [ctypes.c_ulong, ctypes.c_char_p]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]


class MountFailed(OSError):
    pass


def mount(mountpoint: str, fsname: str, options: Iterable[str]) -> int:
    """Mount at ``mountpoint``; returns the /dev/fuse descriptor (close-on-exec)
    that the kernel's requests for the new mount come from.

    ``options`` are the kernel's FUSE mount options (``allow_other``,
    ``default_permissions``); the mount is nosuid and nodev, and is named
    ``fsname`` of type ``fuse.<fsname>`` in /proc/mounts."""
    opts = sorted(options)
    if os.geteuid() == 0:
        return _mount_direct(mountpoint, fsname, opts)
    return _mount_fusermount(mountpoint, fsname, opts)


def _mount_direct(mountpoint: str, fsname: str, opts: list[str]) -> int:
    try:
        rootmode = stat.S_IFMT(os.stat(mountpoint).st_mode)
        fd = os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC)
    except OSError as exc:
        raise MountFailed(exc.errno, f"cannot mount {mountpoint}: {exc.strerror}") from None
    owner = [f"user_id={os.getuid()}", f"group_id={os.getgid()}"]
    data = ",".join([f"fd={fd}", f"rootmode={rootmode:o}", *owner, *opts])
    if _libc.mount(
        fsname.encode(),
        os.fsencode(mountpoint),
        f"fuse.{fsname}".encode(),
        MS_NOSUID | MS_NODEV,
        data.encode(),
    ):
        err = ctypes.get_errno()
        os.close(fd)
        raise MountFailed(err, f"cannot mount {mountpoint}: mount(2): {os.strerror(err)}")
    return fd


def _mount_fusermount(mountpoint: str, fsname: str, opts: list[str]) -> int:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with ours, theirs:
        env = dict(os.environ, _FUSE_COMMFD=str(theirs.fileno()))
        options = ",".join(["nosuid", "nodev", f"fsname={fsname}", f"subtype={fsname}", *opts])
        try:
            proc = subprocess.run(
                [FUSERMOUNT, "-o", options, "--", mountpoint],
                env=env,
                pass_fds=(theirs.fileno(),),
                capture_output=True,
                text=True,
                timeout=60,
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            why = f"cannot mount {mountpoint}: {FUSERMOUNT}: {exc}"
            raise MountFailed(errno.EIO, why) from None
        theirs.close()
        if proc.returncode != 0:
            why = proc.stderr.strip().splitlines()[-1:] or [f"exit status {proc.returncode}"]
            raise MountFailed(errno.EPERM, f"cannot mount {mountpoint}: {why[0]}")
        try:
            _, fds, _, _ = socket.recv_fds(ours, 1, 1)
        except OSError as exc:
            _undo(mountpoint)
            raise MountFailed(exc.errno, f"cannot mount {mountpoint}: {exc}") from None
    if not fds:
        _undo(mountpoint)
        raise MountFailed(errno.EIO, f"cannot mount {mountpoint}: {FUSERMOUNT} sent no descriptor")
    os.set_inheritable(fds[0], False)
    return fds[0]


def unmount(mountpoint: str) -> None:
    """Detach the mount (lazily: open files keep it until they close)."""
    if os.geteuid() == 0:
        if _libc.umount2(os.fsencode(mountpoint), MNT_DETACH) == 0:
            return
        err = ctypes.get_errno()
        if err in (errno.EINVAL, errno.ENOENT):
            return  # not mounted (any more)
        raise OSError(err, f"cannot unmount {mountpoint}: {os.strerror(err)}")
    subprocess.run(
        [FUSERMOUNT, "-u", "-q", "-z", "--", mountpoint],
        capture_output=True,
        timeout=60,
        check=False,
    )


def _undo(mountpoint: str) -> None:
    """fusermount3 mounted but we have no descriptor: nobody would ever serve
    the mount (ENOTCONN for every user of it), so it goes at once."""
    try:
        unmount(mountpoint)
    except Exception as exc:  # the mount error is what the caller must see
        log.warning("could not undo the mount of %s: %s", mountpoint, exc)
