"""The backing root and ckptfs's own directory in it, held open.

``<backing>/.ckptfs`` holds every file's bytes (chunks), the rename records
other nodes' flushes follow, takeover fences and the history. Whoever could
change it could make the root daemon write chunks and records elsewhere (a
symlink put at its name before the mount) or feed it records and chunks of
their own. So it, and each directory under it that the daemon uses, must be
a real directory owned by the daemon's user and writable by no one else;
a mount refuses otherwise (preflight.check_backing), and each is opened once
and used through its descriptor from then on, so a name swapped later does
not redirect anything.
"""

from __future__ import annotations

import errno
import os
import secrets
import stat
import threading
from pathlib import Path

from ckptfs.fs.store.beneath import NotPrivate, private_dir

CKPTFS_DIR = ".ckptfs"
# The directories under .ckptfs, by use.
CHUNKS = "chunks"
FENCE = "fence"
RENAMED = "renamed"
HISTORY = "history"
KEY = "manifest.key"  # in .ckptfs: what seals manifests (manifest.seal_of)
KEY_BYTES = 32


class StoreDirs:
    """``root_fd``: the backing root (the operator's path, trusted as given);
    :meth:`private`: ``.ckptfs`` and the directories under it, each
    verified (see beneath.private_dir) and opened once. Thread-safe."""

    def __init__(self, root: Path, *, create: bool = True) -> None:
        self.root = Path(root)
        self.create = create
        self._root_fd = -1
        self._fds: dict[str, int] = {}
        self._key: bytes | None = None
        self._lock = threading.RLock()  # root_fd is taken under it too

    @property
    def root_fd(self) -> int:
        """The backing root, opened at the first use (a store a test makes
        for its chunks alone may not exist before its first chunk)."""
        if self._root_fd < 0:
            with self._lock:
                if self._root_fd < 0:
                    if self.create:
                        self.root.mkdir(parents=True, exist_ok=True)
                    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
                    self._root_fd = os.open(self.root, flags)
        return self._root_fd

    def path(self, sub: str = "") -> Path:
        base = self.root / CKPTFS_DIR
        return base / sub if sub else base

    def private(self, sub: str = "") -> int:
        """The fd of ``.ckptfs`` (``sub`` empty) or of ``.ckptfs/<sub>``.
        NotPrivate (EPERM) naming the path if it is not ours alone;
        FileNotFoundError if it is missing and this is a read-only use."""
        with self._lock:
            fd = self._fds.get(sub)
            if fd is not None:
                return fd
            if sub and "" not in self._fds:
                self._fds[""] = self._open(self.root_fd, CKPTFS_DIR, "")
            parent = self._fds[""] if sub else self.root_fd
            fd = self._open(parent, sub or CKPTFS_DIR, sub)
            self._fds[sub] = fd
            return fd

    def names(self, sub: str = "") -> list[str]:
        """The names in ``.ckptfs/<sub>``, listed through a descriptor of its
        own. A listing of the shared one (:meth:`private`) would read from a
        directory offset that other threads' listings move at the same time
        (every dup of a descriptor shares it), and miss names."""
        fd = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=self.private(sub))
        try:
            return os.listdir(fd)
        finally:
            os.close(fd)

    def manifest_key(self) -> bytes:
        """The key that seals this store's manifests, made by the first
        daemon that needs one (another node's, if it made it first)."""
        if self._key is not None:
            return self._key
        fd = self.private()
        with self._lock:
            if self._key is None:
                self._key = _read_key(fd, self.path(KEY)) or _make_key(fd, self.path(KEY))
            return self._key

    def _open(self, parent: int, name: str, sub: str) -> int:
        try:
            fd = private_dir(parent, name, 0o700, create=self.create, label=str(self.path(sub)))
        except NotPrivate as exc:
            raise NotPrivate(
                errno.EPERM,
                f"{exc.strerror}: ckptfs keeps every file's bytes and its records there; "
                "remove it or give it to this user",
            ) from None
        if os.geteuid() == 0 and not sub:
            # Chunks hold every file's bytes whatever the file's mode: only
            # the daemon (and root's offline tools) read them. Users read
            # through the mount, where each file's owner and mode hold.
            os.fchmod(fd, 0o700)
        return fd

    def __del__(self) -> None:
        # A store used without close (an offline tool's ChunkStore, a test's)
        # gives its descriptors back when it goes.
        try:
            self.close()
        except (AttributeError, OSError):
            pass

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()
        if self._root_fd >= 0:
            os.close(self._root_fd)
            self._root_fd = -1


def _read_key(dfd: int, where: Path) -> bytes | None:
    try:
        fd = os.open(KEY, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dfd)
    except FileNotFoundError:
        return None
    try:
        st = os.fstat(fd)
        key = os.pread(fd, KEY_BYTES + 1, 0)
    finally:
        os.close(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or len(key) != KEY_BYTES:
        raise NotPrivate(
            errno.EPERM,
            f"{where} is not a {KEY_BYTES}-byte file of uid {os.geteuid()}: "
            "manifests cannot be verified",
        )
    return key


def _make_key(dfd: int, where: Path) -> bytes:
    """A new key, put in place with link(2), which fails if another node's
    daemon put one first: then that one is every node's."""
    tmp = f".{KEY}.{secrets.token_hex(4)}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o400,
                 dir_fd=dfd)  # fmt: skip
    try:
        os.write(fd, secrets.token_bytes(KEY_BYTES))
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.link(tmp, KEY, src_dir_fd=dfd, dst_dir_fd=dfd, follow_symlinks=False)
    except FileExistsError:
        pass
    finally:
        os.unlink(tmp, dir_fd=dfd)
    os.fsync(dfd)
    key = _read_key(dfd, where)
    assert key is not None
    return key
