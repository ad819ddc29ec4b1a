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
import hashlib
import hmac
import json
import os
import re
import secrets
import stat
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ckptfs.fs.store import beneath
from ckptfs.fs.store.beneath import parent_dir

MAGIC = b"CKPTFS-MANIFEST 1\n"
# Records of one manifest file read, at most, from its end (a flush appends one).
MAX_RECORDS = 8
HASH_NAME = "xxh3-128"
STATES = ("pending", "durable")
# A manifest is small; anything larger at a path is a plain file that merely
# happens to start with the magic bytes, and reading it whole would be wasteful.
MAX_MANIFEST_BYTES = 64 << 20
# What a manifest may say. Manifests are written by users too (a login
# node's NFS mount, a copy, a forgery): every field is checked before
# anything acts on it, and names that may become parts of paths (ids, chunk
# hashes) are plain names.
MAX_SIZE = 1 << 44  # the largest file ckptfs holds (cache.MAX_FILE_SIZE)
MAX_HOLDERS = 64
_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")
_CHUNKING = re.compile(r"[a-z0-9_-]{1,32}")
_HASH = re.compile(r"[0-9a-f]{32}")
# Times in ns: a FUSE time is a signed 64-bit count of seconds.
_TIME_NS = (-(1 << 63) * 10**9, ((1 << 63) - 1) * 10**9)


class ManifestError(ValueError):
    pass


def is_file_id(value: object) -> bool:
    """Whether ``value`` may be a file id or version: a plain name (it names
    fences and journal records)."""
    return isinstance(value, str) and _ID.fullmatch(value) is not None


def _int(body: dict[str, object], key: str, lo: int, hi: int, where: str) -> int:
    value = body[key]
    # bool is an int to Python, and a float or a string would be truncated
    # or parsed: only a JSON integer is one.
    if type(value) is not int or not lo <= value <= hi:
        raise ManifestError(f"{where}: {key} must be an integer in [{lo}, {hi}], not {value!r:.40}")
    return value


def _name(body: dict[str, object], key: str, pattern: re.Pattern[str], where: str) -> str:
    value = body[key]
    if not isinstance(value, str) or pattern.fullmatch(value) is None:
        raise ManifestError(f"{where}: bad {key} {value!r:.80}")
    return value


def _holder(value: object, where: str) -> str:
    """A node name, as the peers config allows one (peer/transport/auth.py): compared
    with configured names only, never part of a path."""
    if not isinstance(value, str) or not value.isprintable() or not 0 < len(value) <= 255:
        raise ManifestError(f"{where}: bad holder {value!r:.80}")
    return value


def _chunk(entry: object, where: str) -> Chunk:
    if not isinstance(entry, list) or len(entry) != 3:
        raise ManifestError(f"{where}: a chunk must be [offset, length, hash], not {entry!r:.80}")
    fields = dict(zip(("offset", "length", "hash"), entry, strict=True))
    return Chunk(
        _int(fields, "offset", 0, MAX_SIZE, where),
        _int(fields, "length", 1, MAX_SIZE, where),
        _name(fields, "hash", _HASH, where),
    )


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
    # Orders the versions of one file: a new version's is above the one it
    # replaced and at least its close's time (ns), so nodes' publishes can
    # tell an older version from a newer one (0: unknown, older manifests).
    seq: int = 0
    # Whether ckptfs wrote it: True for one made here; for one read from the
    # store, whether its seal verified (see seal_of). Not part of the format.
    sealed: bool = field(default=True, compare=False)

    @property
    def order(self) -> tuple[int, str]:
        """Where this version stands among the file's versions: by seq, the
        version id breaking a tie, so that every node ranks two versions of
        one file the same way."""
        return (self.seq, self.version)

    def to_bytes(self, key: bytes | None = None, owner: tuple[int, int] | None = None) -> bytes:
        """The manifest file's bytes; with ``key``, sealed for a manifest
        file owned by ``owner`` (uid, gid)."""
        return MAGIC + self.record(key, owner)

    def record(self, key: bytes | None = None, owner: tuple[int, int] | None = None) -> bytes:
        """The manifest as one record (a line of JSON): a manifest file's
        first, or one appended to it (see ``from_bytes``)."""
        body = asdict(self)
        del body["sealed"]
        body["hash"] = HASH_NAME
        body["chunks"] = [[c.offset, c.length, c.hash] for c in self.chunks]
        if self.atime_ns is None:
            del body["atime_ns"]
        text = _dumps(body)
        if key is not None:
            assert owner is not None
            body["mac"] = seal_of(key, text, owner)
            text = _dumps(body)
        return text + b"\n"

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
            seq=self.seq,
        )

    @property
    def atime(self) -> int:
        return self.mtime_ns if self.atime_ns is None else self.atime_ns

    @classmethod
    def from_bytes(
        cls,
        data: bytes,
        where: str = "manifest",
        key: bytes | None = None,
        owner: tuple[int, int] | None = None,
    ) -> Manifest:
        """The manifest in ``data``, every field checked (ManifestError);
        ``sealed`` if ``key`` is given and its seal verifies for a manifest
        file owned by ``owner``.

        A manifest file holds one record per line after the magic line: the
        one its publish wrote, and any that a flush appended since (its
        durable state, written into the very file it checked, so that a
        rename by another node in between cannot be overwritten; see
        publish.replace_manifest). The last record is the manifest. A last
        line that is torn (an append cut short) or, with ``key``, unsealed
        (appended by someone other than ckptfs) is passed over for the
        record before it."""
        if not data.startswith(MAGIC):
            raise ManifestError(f"{where}: missing magic line")
        lines = [line for line in data[len(MAGIC) :].split(b"\n") if line.strip()]
        if not lines:
            raise ManifestError(f"{where}: no record")
        first_error: ManifestError | None = None
        unsealed: Manifest | None = None
        for line in reversed(lines[-MAX_RECORDS:]):
            try:
                m = cls._from_record(line, where, key, owner)
            except ManifestError as exc:
                first_error = first_error or exc
                continue
            if m.sealed or key is None or owner is None:
                return m
            unsealed = unsealed or m
        if unsealed is not None:
            return unsealed
        assert first_error is not None
        raise first_error

    @classmethod
    def _from_record(
        cls, text: bytes, where: str, key: bytes | None, owner: tuple[int, int] | None
    ) -> Manifest:
        """One record (a line of JSON), every field checked."""
        try:
            body = json.loads(text)
            if not isinstance(body, dict):
                raise ManifestError(f"{where}: not a JSON object")
            mac = body.pop("mac", None)
            sealed = (
                key is not None
                and owner is not None
                and isinstance(mac, str)
                and hmac.compare_digest(mac, seal_of(key, _unsealed_text(text, mac, body), owner))
            )
            if body.get("hash", HASH_NAME) != HASH_NAME:
                raise ManifestError(f"{where}: unsupported hash {body['hash']!r}")
            raw_chunks = body.get("chunks", [])
            holders = body.get("holders", [])
            if not isinstance(raw_chunks, list) or not isinstance(holders, list):
                raise ManifestError(f"{where}: chunks and holders must be lists")
            if len(holders) > MAX_HOLDERS:
                raise ManifestError(f"{where}: more than {MAX_HOLDERS} holders")
            body.setdefault("chunking", "fixed")
            manifest = cls(
                file_id=_name(body, "file_id", _ID, where),
                version=_name(body, "version", _ID, where),
                size=_int(body, "size", 0, MAX_SIZE, where),
                mode=_int(body, "mode", 0, 0o177777, where),  # (used & 0o7777)
                mtime_ns=_int(body, "mtime_ns", *_TIME_NS, where),
                state=str(body["state"]),
                holders=[_holder(h, where) for h in holders],
                chunks=[_chunk(c, where) for c in raw_chunks],
                chunking=_name(body, "chunking", _CHUNKING, where),
                atime_ns=(
                    None
                    if body.get("atime_ns") is None
                    else _int(body, "atime_ns", *_TIME_NS, where)
                ),
                seq=_int(body, "seq", 0, (1 << 63) - 1, where) if "seq" in body else 0,
                sealed=sealed,
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


def _dumps(body: dict[str, object]) -> bytes:
    return json.dumps(body, separators=(",", ":")).encode()


def _unsealed_text(record: bytes, mac: str, body: dict[str, object]) -> bytes:
    """The JSON a seal covers: the record as written without its last
    member, the seal (ckptfs writes it last), without encoding the body
    again (a fifth of a listing's time on a fresh mount); else the body
    encoded."""
    tail = f',"mac":"{mac}"}}'.encode()
    text = record.rstrip(b"\n")
    if text.endswith(tail):
        return text[: -len(tail)] + b"}"
    return _dumps(body)


def seal_of(key: bytes, text: bytes, owner: tuple[int, int]) -> str:
    """The seal of a manifest's JSON ``text`` (without its seal) in a file
    owned by ``owner``: an HMAC under the backing store's key
    (``.ckptfs/manifest.key``, which only the daemons' user reads).

    Users can write manifests (a copy, an edit, a forgery naming another
    file's id and version, from a login node's mount): the seal tells one
    ckptfs wrote from one it did not, which is never acted on (served as the
    plain file it is). The owner is part of it, since a manifest's owner is
    the file's: a copy owned by someone else is another file."""
    mac = hmac.new(key, text + f"\n{owner[0]}:{owner[1]}".encode(), hashlib.sha256)
    return mac.hexdigest()[:32]


def new_id() -> str:
    return secrets.token_hex(8)


def read_manifest(
    path: str | os.PathLike[str], *, dir_fd: int | None = None, key: bytes | None = None
) -> Manifest | None:
    """Return the manifest at ``path``, or None if it is a plain file or not
    a regular one (blocking). With ``dir_fd``, ``path`` is resolved beneath
    it without following a symlink (beneath.py). With ``key``, its seal is
    checked (``Manifest.sealed``)."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    if dir_fd is None:
        fd = os.open(path, flags)
    else:
        with parent_dir(dir_fd, os.fspath(path)) as (dfd, name):
            fd = os.open(name, flags, dir_fd=dfd)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        return manifest_from_fd(fd, str(path), key)
    finally:
        os.close(fd)


def manifest_from_fd(
    fd: int, where: str, key: bytes | None = None, st: os.stat_result | None = None
) -> Manifest | None:
    """The manifest in the open file ``fd`` (read from its start; ``st`` its
    fstat if the caller has it), or None; sealed as from_bytes says."""
    head = os.pread(fd, len(MAGIC), 0)
    if head != MAGIC:
        return None
    st = st or os.fstat(fd)
    size = st.st_size
    if size > MAX_MANIFEST_BYTES:
        return None
    parts, off = [head], len(head)
    while chunk := os.pread(fd, max(size - off, 1 << 16), off):
        parts.append(chunk)
        off += len(chunk)
    return Manifest.from_bytes(b"".join(parts), where, key, (st.st_uid, st.st_gid))


# What ParsedManifests charges a plain file's entry (its key and the node).
NOT_A_MANIFEST_BYTES = 256


class ParsedManifests:
    """Parsed manifests by the identity of the manifest file (device, inode,
    size, mtime, ctime). A manifest file is only ever replaced (a publish
    renames a new file over it) or appended to (a flush's record, which
    changes its size and times), so an unchanged identity means an
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
        # A chown or chmod moves the ctime: the seal (owner) is checked again.
        return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)

    _UNKNOWN = object()

    def known(self, st: os.stat_result) -> Manifest | None | object:
        """What the file of stat ``st`` was parsed as, if it was (a manifest
        or None: a plain file); else ``ParsedManifests._UNKNOWN``."""
        key = self.identity(st)
        with self._lock:
            if key in self._items:
                self._items.move_to_end(key)
                return self._items[key]
        return self._UNKNOWN

    def read(
        self, fd: int, where: str, st: os.stat_result | None = None, seal: bytes | None = None
    ) -> Manifest | None:
        """The manifest in ``fd`` (whose fstat is ``st``, if the caller has
        it), parsed once per identity; its seal checked with ``seal`` (one
        store's key per file: the identity names the file)."""
        st = os.fstat(fd) if st is None else st
        key = self.identity(st)
        with self._lock:
            if key in self._items:
                self._items.move_to_end(key)
                return self._items[key]
        manifest = manifest_from_fd(fd, where, seal, st)
        size = self._charge(key, manifest)
        if size > self.max_bytes // 4:
            return manifest  # one huge manifest would push out everything else
        with self._lock:
            if key not in self._items:
                self._items[key] = manifest
                self._bytes += size
            while self._bytes > self.max_bytes:
                self._bytes -= self._charge(*self._items.popitem(last=False))
        return manifest

    @staticmethod
    def _charge(key: tuple[int, ...], manifest: Manifest | None) -> int:
        """What an item counts against ``max_bytes``: a manifest its size; a
        plain file, whatever its size, only its key (a directory of many small
        plain files must not push the manifests out, nor each other out at
        each listing)."""
        return key[2] if manifest is not None else NOT_A_MANIFEST_BYTES


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
    """An fd for directory ``rel``: beneath ``dir_fd`` without following a
    symlink ("" is ``dir_fd`` itself), or, without ``dir_fd``, as given."""
    if dir_fd is None:
        return os.open(rel or ".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    return beneath.open_dir(dir_fd, rel)


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
    key: bytes | None = None,
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
    ``key``: the store's manifest key, to seal it with (see seal_of).
    """
    parent, name = os.path.split(os.fspath(path))
    dfd = open_dir(parent, dir_fd)
    try:
        if keep_dir_times:
            with dir_times_kept(dfd) as times:
                _write_at(dfd, name, path, manifest, owner, sync, abandoned, times, key)
        else:
            _write_at(dfd, name, path, manifest, owner, sync, abandoned, dir_times, key)
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
    key: bytes | None = None,
) -> None:
    """write_manifest's temporary file and rename, in the directory ``dfd``."""
    ours = times.change if times is not None else contextlib.nullcontext
    tmp = tmp_name(name)
    mode = manifest.mode & 0o7777
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
    with ours():
        fd = os.open(tmp, flags, 0o600, dir_fd=dfd)
    try:
        if owner is not None:
            os.fchown(fd, *owner)
        os.fchmod(fd, mode)  # after fchown, which may clear setuid/setgid
        st = os.fstat(fd)  # the owner it has (a setgid directory's group, too): sealed with
        write_all(fd, manifest.to_bytes(key, (st.st_uid, st.st_gid)))
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
