"""The per-file manifest that ckptfs stores at the file's own path.

Format (see docs/FORMAT.md): the magic line ``CKPTFS-MANIFEST 1`` followed by
one JSON object. Anything that does not start with the magic line is a plain
file and is served read-through.

The manifest file itself carries the file's owner (uid/gid of the manifest
file), so every rewrite is created with the owner and mode of the file it
replaces.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

MAGIC = b"CKPTFS-MANIFEST 1\n"
HASH_NAME = "xxh3-128"
STATES = ("pending", "durable")
# A manifest is small; anything larger at a path is a plain file that merely
# happens to start with the magic bytes, and reading it whole would be wasteful.
MAX_MANIFEST_BYTES = 64 << 20


class ManifestError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class Chunk:
    offset: int
    length: int
    hash: str

    @property
    def end(self) -> int:
        return self.offset + self.length


@dataclass
class Manifest:
    file_id: str
    version: str
    size: int
    mode: int
    mtime_ns: int
    state: str = "pending"
    holders: list[str] = field(default_factory=list)
    chunks: list[Chunk] = field(default_factory=list)
    chunking: str = "fixed"
    atime_ns: int | None = None  # absent in older manifests: then equal to mtime_ns

    def to_bytes(self) -> bytes:
        body = asdict(self)
        body["hash"] = HASH_NAME
        body["chunks"] = [[c.offset, c.length, c.hash] for c in self.chunks]
        if self.atime_ns is None:
            del body["atime_ns"]
        return MAGIC + json.dumps(body, separators=(",", ":")).encode() + b"\n"

    def without_chunks(self) -> Manifest:
        """A copy without the chunk list and holders (what a check keeps)."""
        return Manifest(
            file_id=self.file_id,
            version=self.version,
            size=self.size,
            mode=self.mode,
            mtime_ns=self.mtime_ns,
            state=self.state,
            chunking=self.chunking,
            atime_ns=self.atime_ns,
        )

    @property
    def atime(self) -> int:
        return self.mtime_ns if self.atime_ns is None else self.atime_ns

    @classmethod
    def from_bytes(cls, data: bytes, where: str = "manifest") -> Manifest:
        if not data.startswith(MAGIC):
            raise ManifestError(f"{where}: missing magic line")
        try:
            body = json.loads(data[len(MAGIC) :])
            if not isinstance(body, dict):
                raise ManifestError(f"{where}: not a JSON object")
            if body.get("hash", HASH_NAME) != HASH_NAME:
                raise ManifestError(f"{where}: unsupported hash {body['hash']!r}")
            chunks = [Chunk(int(o), int(n), str(h)) for o, n, h in body.get("chunks", [])]
            atime = body.get("atime_ns")
            manifest = cls(
                file_id=str(body["file_id"]),
                version=str(body["version"]),
                size=int(body["size"]),
                mode=int(body["mode"]),
                mtime_ns=int(body["mtime_ns"]),
                state=str(body["state"]),
                holders=[str(h) for h in body.get("holders", [])],
                chunks=chunks,
                chunking=str(body.get("chunking", "fixed")),
                atime_ns=None if atime is None else int(atime),
            )
        except ManifestError:
            raise
        except (ValueError, KeyError, TypeError) as exc:
            raise ManifestError(f"{where}: malformed manifest ({exc})") from None
        manifest.validate(where)
        return manifest

    def validate(self, where: str = "manifest") -> None:
        if self.state not in STATES:
            raise ManifestError(f"{where}: unknown state {self.state!r}")
        if self.size < 0:
            raise ManifestError(f"{where}: negative size")
        end = 0
        for chunk in self.chunks:
            # Gaps between chunks are holes (zeros); overlaps and runs past
            # the size are not something ckptfs ever writes.
            if chunk.offset < end or chunk.length <= 0:
                raise ManifestError(f"{where}: chunk list overlaps or is unsorted at {end}")
            end = chunk.end
        if end > self.size:
            raise ManifestError(f"{where}: chunks end at {end}, past the size {self.size}")

    def covered(self) -> bool:
        """Whether the chunk list accounts for every byte (holes read as zeros)."""
        return self.state == "durable" or self.size == 0


def new_id() -> str:
    return secrets.token_hex(8)


def read_manifest(path: str | os.PathLike[str], *, dir_fd: int | None = None) -> Manifest | None:
    """Return the manifest at ``path``, or None if it is a plain file (blocking)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    try:
        return manifest_from_fd(fd, str(path))
    finally:
        os.close(fd)


def manifest_from_fd(fd: int, where: str) -> Manifest | None:
    """The manifest in the open file ``fd`` (read from its start), or None."""
    head = os.pread(fd, len(MAGIC), 0)
    if head != MAGIC:
        return None
    size = os.fstat(fd).st_size
    if size > MAX_MANIFEST_BYTES:
        return None
    parts, off = [head], len(head)
    while chunk := os.pread(fd, max(size - off, 1 << 16), off):
        parts.append(chunk)
        off += len(chunk)
    return Manifest.from_bytes(b"".join(parts), where=where)


class ParsedManifests:
    """Parsed manifests by the identity of the manifest file (device, inode,
    size, mtime, ctime). A manifest file is never changed in place (every
    publish renames a new file over it), so an unchanged identity means an
    unchanged manifest, and a re-validation (every open, close-to-open) or a
    listing need not read and parse it again: that cost 0.9 ms for a 2 GiB
    checkpoint and 60 ms for 100 GiB, holding the GIL. Thread-safe; bounded
    by the manifests' total size (a parsed manifest takes a few times its
    size in memory)."""

    def __init__(self, max_bytes: int = 16 << 20) -> None:
        self.max_bytes = max_bytes
        self._bytes = 0
        self._lock = threading.Lock()
        self._items: OrderedDict[tuple[int, ...], Manifest | None] = OrderedDict()

    @staticmethod
    def identity(st: os.stat_result) -> tuple[int, ...]:
        return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)

    def read(self, fd: int, where: str, st: os.stat_result | None = None) -> Manifest | None:
        """The manifest in ``fd`` (whose fstat is ``st``, if the caller has
        it), parsed once per identity."""
        key = self.identity(os.fstat(fd) if st is None else st)
        with self._lock:
            if key in self._items:
                self._items.move_to_end(key)
                return self._items[key]
        manifest = manifest_from_fd(fd, where)
        size = key[2]
        if size > self.max_bytes // 4:
            return manifest  # one huge manifest would push out everything else
        with self._lock:
            if key not in self._items:
                self._items[key] = manifest
                self._bytes += size
            while self._bytes > self.max_bytes:
                old, _ = self._items.popitem(last=False)
                self._bytes -= old[2]
        return manifest


def tmp_name(name: str) -> str:
    # Shortened so that a name near NAME_MAX still has a temporary name.
    return f".{name[:128]}.ckptfs-tmp.{secrets.token_hex(4)}"


def tmp_name_for(path: Path) -> Path:
    return path.with_name(tmp_name(path.name))


def is_tmp_name(name: str | bytes) -> bool:
    text = name.decode("utf-8", "surrogateescape") if isinstance(name, bytes) else name
    return text.startswith(".") and ".ckptfs-tmp." in text


def write_all(fd: int, data: bytes | memoryview) -> None:
    """os.write until every byte is written (a short write is not an error)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def fsync_dir(fd: int) -> None:
    os.fsync(fd)


def open_dir(rel: str, dir_fd: int | None) -> int:
    """An fd for directory ``rel`` (relative to ``dir_fd``; "" is ``dir_fd`` itself)."""
    return os.open(rel or ".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=dir_fd)


def write_manifest(
    path: str | os.PathLike[str],
    manifest: Manifest,
    *,
    dir_fd: int | None = None,
    owner: tuple[int, int] | None = None,
    sync: bool = True,
    abandoned: Callable[[], bool] = lambda: False,
    keep_dir_times: bool = False,
    dir_times: DirTimes | None = None,
) -> None:
    """Atomically replace ``path`` with ``manifest`` (blocking).

    Written to a temporary name in the same directory, owned by ``owner`` with
    the manifest's mode, fsynced, renamed, and the directory fsynced: a reader
    on any node sees the old or the new manifest, never a torn one, and the
    rename survives a crash of the NFS client. Paths are relative to
    ``dir_fd`` when given, so the backing root does not count against
    PATH_MAX. If ``abandoned()`` is true just before the rename (the caller
    gave up waiting, a newer manifest may be on its way), nothing is replaced.

    ``keep_dir_times``: the name already holds this file (a rewrite of its
    manifest: the close's, the flusher's, a chmod's), so, as on any POSIX
    filesystem, the directory's mtime does not move (see DirTimes).
    ``dir_times``: one step of a longer rewrite whose caller keeps the
    times (``dir_times_kept``): the changes made here are counted as ours.
    """
    parent, name = os.path.split(os.fspath(path))
    dfd = open_dir(parent, dir_fd)
    try:
        if keep_dir_times:
            with dir_times_kept(dfd) as times:
                _write_at(dfd, name, path, manifest, owner, sync, abandoned, times)
        else:
            _write_at(dfd, name, path, manifest, owner, sync, abandoned, dir_times)
        if sync:
            fsync_dir(dfd)
    finally:
        os.close(dfd)


def _write_at(
    dfd: int,
    name: str,
    path: str | os.PathLike[str],
    manifest: Manifest,
    owner: tuple[int, int] | None,
    sync: bool,
    abandoned: Callable[[], bool],
    times: DirTimes | None,
) -> None:
    """write_manifest's temporary file and rename, in the directory ``dfd``."""
    ours = times.change if times is not None else contextlib.nullcontext
    tmp = tmp_name(name)
    mode = manifest.mode & 0o7777
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
    with ours():
        fd = os.open(tmp, flags, 0o600, dir_fd=dfd)
    try:
        write_all(fd, manifest.to_bytes())
        if owner is not None:
            os.fchown(fd, *owner)
        os.fchmod(fd, mode)  # after fchown, which may clear setuid/setgid
        if sync:
            os.fsync(fd)
    except BaseException:
        os.close(fd)
        os.unlink(tmp, dir_fd=dfd)
        raise
    os.close(fd)
    try:
        if abandoned():
            raise TimeoutError(f"{path}: manifest write abandoned; not replacing")
        with ours():
            os.rename(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
    except BaseException:
        os.unlink(tmp, dir_fd=dfd)
        raise


_DIR_LOCKS = tuple(threading.Lock() for _ in range(64))


def _dir_lock(dfd: int) -> threading.Lock:
    """This process's lock for the directory ``dfd`` (striped: a bounded set,
    two directories may share one)."""
    st = os.fstat(dfd)
    return _DIR_LOCKS[hash((st.st_dev, st.st_ino)) % len(_DIR_LOCKS)]


@contextlib.contextmanager
def dir_times_kept(dfd: int) -> Iterator[DirTimes]:
    """For a rewrite of a name's manifest in the directory ``dfd`` made of
    several changes (each inside ``DirTimes.change``): the directory's times
    put back when it ends without an error. This process's rewrites in one
    directory go one at a time: a concurrent one's temporary file would look
    like another process's change, and neither would put the times back."""
    with _dir_lock(dfd):
        # Read under the lock: another rewrite's temporary file must not be
        # taken for the times before.
        times = DirTimes(dfd)
        yield times
        times.restore()


class DirTimes:
    """A directory's atime and mtime, put back after a rewrite of a manifest
    in it, which the directory's own filesystem counts as several changes of
    it (a temporary file created, then renamed over the name; a takeover's
    fenced publish also moves the old one aside, links, unlinks).

    Why: a directory's times are its backing directory's, and a job sorts
    its checkpoint directories by them (HF Trainer rotates the oldest mtime
    out): a flush or a takeover finishing late would make an older
    checkpoint look the newest. Only our own changes are undone: if the
    directory's mtime moved between two of ours (another process, another
    node, while the manifest was being written and synced), it is left as it
    is. A change between one of ours and the look right after it, or
    between our last one and the restore (single system calls), or in the
    same tick of a filesystem's coarse clock (ext4's), is not told from ours
    and is undone too: the directory's mtime then shows the time before it."""

    def __init__(self, dfd: int) -> None:
        self._dfd = dfd
        self._before = os.fstat(dfd)
        # The mtime right after our last change; None before the first,
        # which follows this look at once (no second look needed).
        self._ours: int | None = None
        self._changed_by_others = False

    @contextlib.contextmanager
    def change(self) -> Iterator[None]:
        """Around one change of ours to the directory (a create, a rename, a
        link, an unlink): the mtime moved since our last one only if someone
        else changed the directory in between (a manifest's write and sync)."""
        if self._ours is not None and os.fstat(self._dfd).st_mtime_ns != self._ours:
            self._changed_by_others = True
        try:
            yield
        finally:
            self._ours = os.fstat(self._dfd).st_mtime_ns

    def restore(self) -> None:
        if self._changed_by_others or self._ours in (None, self._before.st_mtime_ns):
            return
        try:
            os.utime(self._dfd, ns=(self._before.st_atime_ns, self._before.st_mtime_ns))
        except PermissionError:
            pass  # a daemon not root, in a directory it does not own: the times move
