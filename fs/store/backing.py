"""The namespace in the backing directory: names, directories and manifests.

Every call runs in a worker thread under the backing-store timeout (see
blocking.py). Paths are relative to the backing root (``""`` is the root) and
every call is made relative to a directory fd of the root, so a path near
PATH_MAX inside the mount still works although the backing root is longer
than the mountpoint. The ``.ckptfs`` directory and temporary names are hidden.

Users write this directory (through the mount, and directly from other
machines), and the daemon runs as root: every path is resolved beneath the
root without following a symlink (beneath.py), calls act on one name in a
directory held open or on an object held open, and an inode's directory or
object that was replaced since its lookup gets ESTALE, never the action.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import stat
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from ckptfs.fs.store.beneath import held, open_dir, parent_dir, via_fd
from ckptfs.fs.store.blocking import BackingIO, Call
from ckptfs.fs.store.manifest import (
    DirTimes,
    Manifest,
    ManifestError,
    ParsedManifests,
    dir_times_kept,
    fsync_dir,
    is_file_id,
    is_tmp_name,
    manifest_from_fd,
    read_manifest,
    tmp_name,
    write_manifest,
)
from ckptfs.fs.store.renamelog import RenameLog, needs_record, write_record
from ckptfs.fs.store.storedirs import CKPTFS_DIR, FENCE, StoreDirs

log = logging.getLogger(__name__)


class Published(Enum):
    """What became of an attempt to write a file's manifest."""

    DONE = "done"
    STALE = "stale"  # what would have been written is out of date: nothing written
    NAME_GONE = "name gone"  # the path no longer names this file


@dataclass
class Entry:
    """What a name in the backing directory is: a directory, symlink, plain file or manifest."""

    kind: str  # "dir" | "symlink" | "plain" | "file"
    st: os.stat_result
    manifest: Manifest | None = None
    # When the read of it began (time.monotonic()): how old what it says is.
    read_at: float = field(default_factory=time.monotonic, compare=False)

    def kept(self) -> Entry:
        """This entry without the manifest's chunk list and holders, to keep
        for a while: enough to tell which version the name held, and when."""
        m = self.manifest
        if m is None or not (m.chunks or m.holders):
            return self
        # Built directly: dataclasses.replace costs several times as much, and
        # this runs at each open's check.
        return Entry(self.kind, self.st, m.without_chunks(), self.read_at)

    @property
    def ident(self) -> tuple[str, object]:
        if self.manifest is not None:
            return ("file", self.manifest.file_id)
        return (self.kind, self.st.st_ino)


@dataclass(frozen=True)
class PlainFile:
    """A plain backing file as a writer adopted it. Another file put at its
    name since does not match: not by its inode number alone, which a file
    system hands to a new file as soon as the old one is deleted, and not if
    this one was rewritten in place (its size or mtime changed)."""

    ino: int
    size: int
    mtime_ns: int

    @classmethod
    def of(cls, st: os.stat_result) -> PlainFile:
        return cls(st.st_ino, st.st_size, st.st_mtime_ns)

    def matches(self, st: os.stat_result) -> bool:
        return self == PlainFile.of(st)


def hidden(rel_dir: str, name: str) -> bool:
    return (rel_dir == "" and name == CKPTFS_DIR) or is_tmp_name(name)


PARSED = ParsedManifests()
# Manifest files (by identity) already reported as not written by ckptfs:
# each is named once, not at every look.
_UNSEALED: OrderedDict[tuple[int, ...], None] = OrderedDict()
_UNSEALED_KEPT = 4096


_UNSEALED_LOCK = threading.Lock()  # store calls run in several threads


def _report_foreign(rel: str, st: os.stat_result, why: str) -> None:
    """A name that starts like a manifest but is none ckptfs may act on:
    said once per file (as the plain file it is served as)."""
    key = ParsedManifests.identity(st)
    with _UNSEALED_LOCK:
        if key in _UNSEALED:
            return
        _UNSEALED[key] = None
        if len(_UNSEALED) > _UNSEALED_KEPT:
            _UNSEALED.popitem(last=False)
    log.warning(
        "%s: %s (owner uid %d): served as the plain file it is, never as a file it names "
        "(ckptfs check lists it)",
        rel,
        why,
        st.st_uid,
    )


def _entry_at(root: int, rel: str, key: bytes | None) -> Entry:
    start = time.monotonic()
    entry = _read_entry(root, rel, key)
    entry.read_at = start
    return entry


def _read_entry(root: int, rel: str, key: bytes | None) -> Entry:
    if not rel:
        return Entry("dir", os.fstat(root))
    with parent_dir(root, rel) as (dfd, name):
        return _read_entry_in(dfd, name, rel, key)


def _read_entry_in(
    dfd: int, name: str, rel: str, key: bytes | None, listing: bool = False
) -> Entry:
    """The entry ``name`` in the directory ``dfd`` (``rel`` for messages). A
    manifest whose seal does not verify under ``key`` (one ckptfs did not
    write: a copy, an edit, a forgery) is a plain file: served as the bytes
    it is, never as a file it names. ``listing``: a file whose stat shows
    one already parsed is not opened again (a listing's stats are what a
    plain ``ls -l`` sees; an open or a lookup opens it, which on NFS is
    what revalidates)."""
    st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
    if stat.S_ISDIR(st.st_mode):
        return Entry("dir", st)
    if stat.S_ISLNK(st.st_mode):
        return Entry("symlink", st)
    if listing and stat.S_ISREG(st.st_mode):
        known = PARSED.known(st)
        if known is None:
            return Entry("plain", st)
        if isinstance(known, Manifest) and known.sealed:
            return Entry("file", st, known)
    if stat.S_ISREG(st.st_mode):
        # Opened every time (on NFS the open is what revalidates); read and
        # parsed only when the manifest file is not the one seen before.
        try:
            fd = os.open(
                name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dfd
            )
        except OSError as exc:
            if exc.errno == errno.ELOOP:  # replaced by a symlink since the stat
                return Entry("symlink", os.stat(name, dir_fd=dfd, follow_symlinks=False))
            raise
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):  # replaced since the stat
                return Entry("plain", st)
            manifest = PARSED.read(fd, rel, st, key)
        except ManifestError as exc:
            _report_foreign(rel, st, f"its manifest does not parse ({exc})")
            return Entry("plain", st)
        finally:
            os.close(fd)
        if manifest is None:
            return Entry("plain", st)
        if not manifest.sealed:
            _report_foreign(rel, st, "a manifest ckptfs did not write, or one changed outside it")
            return Entry("plain", st)
        return Entry("file", st, manifest)
    return Entry("plain", st)


def _list(
    root: int, rel: str, expect_ino: int | None, key: bytes | None
) -> list[tuple[str, Entry]]:
    dfd = open_dir(root, rel)
    try:
        _check_dir(dfd, rel, expect_ino)
        names = sorted(os.listdir(dfd))
        entries = []
        for name in names:
            if hidden(rel, name):
                continue
            start = time.monotonic()
            try:
                entry = _read_entry_in(
                    dfd, name, f"{rel}/{name}" if rel else name, key, listing=True
                )
            except FileNotFoundError:  # removed meanwhile (another node)
                continue
            entry.read_at = start
            entries.append((name, entry))
        return entries
    finally:
        os.close(dfd)


def _check_dir(dfd: int, rel: str, expect_ino: int | None) -> None:
    """ESTALE if the directory held open as ``dfd`` is not the one an inode
    was bound to (``expect_ino``; None: not checked): a directory a user
    replaced (renamed another in its place) since the kernel looked it up
    must not receive what was meant for it."""
    if expect_ino is not None and os.fstat(dfd).st_ino != expect_ino:
        raise OSError(errno.ESTALE, f"{rel or '/'}: replaced since it was looked up")


@contextlib.contextmanager
def _in_parent(root: int, rel: str, expect_parent: int | None) -> Iterator[tuple[int, str]]:
    """(fd of ``rel``'s directory, its name), that directory checked against
    ``expect_parent`` (its inode's backing st_ino; None: not checked)."""
    with parent_dir(root, rel) as (dfd, name):
        _check_dir(dfd, os.path.dirname(rel), expect_parent)
        yield dfd, name


def _rmdir(root: int, rel: str, expect_parent: int | None) -> None:
    with _in_parent(root, rel, expect_parent) as (pfd, name):
        try:
            os.rmdir(name, dir_fd=pfd)
        except OSError as exc:
            if exc.errno != errno.ENOTEMPTY:
                raise
            # Leftover temporary files of an interrupted manifest write are not
            # visible through the mount and must not make rmdir fail.
            dfd = open_dir(pfd, name)
            try:
                names = os.listdir(dfd)
                if not names or not all(is_tmp_name(n) for n in names):
                    raise
                for tmp in names:
                    os.unlink(tmp, dir_fd=dfd)
            finally:
                os.close(dfd)
            os.rmdir(name, dir_fd=pfd)


def _create_manifest(
    call: Call[tuple[Entry, int]],
    root: int,
    rel: str,
    manifest: Manifest,
    uid: int,
    gid: int,
    expect_parent: int | None,
    key: bytes | None,
) -> tuple[Entry, int]:
    """Write a new file's first manifest, owned by ``uid`` and the right group:
    the parent's under a setgid directory, else ``gid``. Returns (entry, gid)."""
    with _in_parent(root, rel, expect_parent) as (dfd, name):
        parent = os.fstat(dfd)
        if parent.st_mode & stat.S_ISGID:
            gid = parent.st_gid
        write_manifest(
            name, manifest, dir_fd=dfd, owner=(uid, gid), abandoned=call.abandoned, key=key
        )
        start = time.monotonic()
        entry = _read_entry_in(dfd, name, rel, key)
        entry.read_at = start
        return entry, gid


def _replace_manifest(
    call: Call[Published],
    root: int,
    fence_dir: Callable[[], int],
    rel: str,
    manifest: Manifest,
    owner: tuple[int, int],
    file_id: str,
    expect_version: str | None,
    plain: PlainFile | None,
    before: Callable[[], None] | None,
    key: bytes | None,
) -> Published:
    """Replace the manifest at ``rel`` if it still belongs to ``file_id`` (and,
    with ``expect_version``, is still that version), or, with ``plain``, if
    that plain file is still there; ``before`` runs first."""
    try:
        try:
            current, st = _manifest_and_stat(root, rel, key)
        except FileNotFoundError:
            # A takeover may have moved it aside for an instant (see
            # _takeover_manifest): wait for it before calling the name gone,
            # and never call it gone while the takeover still holds it.
            if not _wait_for_fence(fence_dir(), file_id):
                raise
            try:
                current, st = _manifest_and_stat(root, rel, key)
            except FileNotFoundError:
                raise OSError(
                    errno.EBUSY, f"{rel}: a takeover of this file holds its name; try again"
                ) from None
    except FileNotFoundError:
        return Published.NAME_GONE
    if current is None and (plain is None or not plain.matches(st)):
        return Published.NAME_GONE  # a plain file was put at the path (another one)
    if current is not None and current.file_id != file_id:
        return Published.NAME_GONE
    if expect_version is not None and (
        current is None or not _ours_or_older(current, expect_version, manifest.seq)
    ):
        return Published.STALE
    if before is not None:
        before()
    write_manifest(
        rel,
        manifest,
        dir_fd=root,
        owner=owner,
        abandoned=call.abandoned,
        keep_dir_times=True,
        key=key,
    )
    return Published.DONE


def _ours_or_older(current: Manifest, version: str, seq: int) -> bool:
    """Whether a rewrite of ``version`` (of order ``seq``: made durable, new
    metadata) may replace ``current``, the same file's manifest at its name:
    ``current`` is that version, or an older one (by seq) that landed over it.

    Why the second: a node's check of the version and its rename are one
    store call but not atomic across nodes. Node A's durable V, checked
    just before node B published its newer V' (B's close returned), lands
    over V'; B's flush then finds V at the name. V' is the newer content, so
    B publishes it again; dropping it as "rewritten elsewhere" would lose a
    closed file. A version of unknown order (seq 0: an older manifest) or a
    newer one (another close after ours) stays."""
    if current.version == version:
        return True
    return 0 < current.seq < seq


def _manifest_and_stat(
    root: int, rel: str, key: bytes | None
) -> tuple[Manifest | None, os.stat_result]:
    """The manifest at ``rel`` and the stat of that file. None for a plain
    file, and for an unreadable or unsealed manifest: neither is ours to
    replace, unless it is the very plain file a writer adopted."""
    with parent_dir(root, rel) as (dfd, name):
        try:
            fd = os.open(
                name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dfd
            )
        except OSError as exc:
            if exc.errno != errno.ELOOP:
                raise
            # A symlink at the name: another file there, not ours to replace.
            return None, os.stat(name, dir_fd=dfd, follow_symlinks=False)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return None, st
        try:
            m = manifest_from_fd(fd, rel, key, st)
            return (m if m is not None and m.sealed else None), st
        except ManifestError:
            return None, st
    finally:
        os.close(fd)


# Seconds after which a fence left by a dead takeover is broken: longer than a
# backing-store call may take (backing_timeout, 120 s by default), so a live
# takeover whose call the loop gave up on is never overtaken.
FENCE_STALE = 300.0
FENCE_WAIT = 5.0  # longest a publish waits for a takeover's fence to go


def _fence(file_id: str) -> str:
    """The fence's name in ``.ckptfs/fence``: the file id, which a manifest
    (user input) gave, so only if it is a plain name."""
    if not is_file_id(file_id):
        raise OSError(errno.EINVAL, f"not a file id: {file_id!r}")
    return file_id


def _wait_for_fence(fence_fd: int, file_id: str) -> bool:
    """True if a takeover of ``file_id`` was fenced (and has ended, or waited long enough)."""
    try:
        os.stat(_fence(file_id), dir_fd=fence_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    deadline = time.monotonic() + FENCE_WAIT
    while time.monotonic() < deadline:
        time.sleep(0.005)
        try:
            os.stat(_fence(file_id), dir_fd=fence_fd, follow_symlinks=False)
        except FileNotFoundError:
            break
    return True


def _take_fence(fence_fd: int, file_id: str) -> bool:
    name = _fence(file_id)
    flags = os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC
    for _ in range(2):
        try:
            os.close(os.open(name, flags, 0o600, dir_fd=fence_fd))
            return True
        except FileExistsError:
            try:
                age = time.time() - os.stat(name, dir_fd=fence_fd, follow_symlinks=False).st_mtime
            except FileNotFoundError:
                continue
            if age < FENCE_STALE:
                return False
            os.unlink(name, dir_fd=fence_fd)  # left by a takeover that died
    return False


def _takeover_manifest(
    call: Call[Published],
    root: int,
    fence_fd: int,
    rel: str,
    manifest: Manifest,
    file_id: str,
    expect_version: str,
    key: bytes | None = None,
) -> Published:
    """Publish ``manifest`` at ``rel`` only over exactly ``expect_version``.

    The fenced publish of a takeover (docs/STATES.md, "Takeover and
    fencing"): the manifest there is moved aside atomically (rename), checked,
    and the new one linked into place with link(2), which fails if anything
    was published at the name meanwhile. So whatever another node (the
    writer, if it only seemed dead) publishes concurrently wins, and a
    takeover never puts its version over a newer one. A publish that finds
    the name missing in that instant waits for the fence (_replace_manifest).
    """
    if not _take_fence(fence_fd, file_id):
        # Not STALE: the flusher would take that as "rewritten elsewhere" and
        # drop the only copy. An error makes it try again later.
        raise OSError(errno.EBUSY, f"{rel}: another takeover of this file is under way")
    try:
        parent, name = os.path.split(rel)
        try:
            dfd = open_dir(root, parent)
        except (FileNotFoundError, NotADirectoryError):
            # Its directory was removed (a job's rotation, rmtree, on another
            # node), or a file put in its place: so was the name. Had this
            # raised, the flusher would have retried for ever, after the first
            # time against its own fence.
            return Published.NAME_GONE
        try:
            # It rewrites the name's manifest as a flush does: the
            # directory's times stay (DirTimes).
            with dir_times_kept(dfd) as times:
                return _link_over(call, dfd, name, manifest, file_id, expect_version, times, key)
        finally:
            os.close(dfd)
    finally:
        try:
            os.unlink(_fence(file_id), dir_fd=fence_fd)
        except FileNotFoundError:
            pass


def _link_over(
    call: Call[Published],
    dfd: int,
    name: str,
    manifest: Manifest,
    file_id: str,
    expect_version: str,
    times: DirTimes,
    key: bytes | None = None,
) -> Published:
    """The fenced publish itself, in the directory ``dfd`` (see
    _takeover_manifest), each change of the directory's names counted in
    ``times``."""
    aside = tmp_name(name)
    new = tmp_name(name)
    try:
        # The new manifest is written first, so the name is missing only for
        # a rename, a read and a link.
        try:
            st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
        except FileNotFoundError:
            return Published.NAME_GONE
        # In the directory held open: by path, a directory removed and made
        # again since would get the temporary name, and keep it.
        write_manifest(
            new, manifest, dir_fd=dfd, owner=(st.st_uid, st.st_gid), dir_times=times, key=key
        )
        try:
            with times.change():
                os.rename(name, aside, src_dir_fd=dfd, dst_dir_fd=dfd)
        except FileNotFoundError:
            return Published.NAME_GONE
        try:
            try:
                current = read_manifest(aside, dir_fd=dfd, key=key)
            except ManifestError:
                current = None
            if current is not None and not current.sealed:
                current = None  # not a manifest ckptfs wrote: not the version taken over
            if (
                current is None
                or current.file_id != file_id
                or current.version != expect_version
                or current.state != "pending"
            ):
                # Not exactly the pending version taken over (its writer,
                # who only seemed dead, made it durable or replaced it):
                # what is there stays.
                try:
                    with times.change():
                        os.link(
                            aside, name, src_dir_fd=dfd, dst_dir_fd=dfd, follow_symlinks=False
                        )  # put it back
                except FileExistsError:
                    pass  # something newer was published meanwhile: it stays
                fsync_dir(dfd)
                if current is None or current.file_id != file_id:
                    return Published.NAME_GONE
                return Published.STALE
            try:
                with times.change():
                    if call.abandoned():
                        os.link(aside, name, src_dir_fd=dfd, dst_dir_fd=dfd, follow_symlinks=False)
                        return Published.STALE
                    os.link(new, name, src_dir_fd=dfd, dst_dir_fd=dfd, follow_symlinks=False)
            except FileExistsError:
                return Published.STALE  # newer than what we took over: it stays
            finally:
                fsync_dir(dfd)
            return Published.DONE
        finally:
            try:
                with times.change():
                    os.unlink(aside, dir_fd=dfd)
            except FileNotFoundError:
                pass
    finally:
        try:
            with times.change():
                os.unlink(new, dir_fd=dfd)
        except FileNotFoundError:
            pass


def _close_quietly(fd: int | None) -> None:
    if fd is None:
        return
    try:
        os.close(fd)
    except OSError:
        pass


class Backing:
    """The backing namespace, one store call per method. ``expect_*``
    arguments are the backing st_ino of the directory (or object) an inode
    was bound to, None where it is not known (the root): a call through an
    inode whose directory or object was replaced since gets ESTALE."""

    def __init__(self, root: Path, io: BackingIO, dirs: StoreDirs | None = None) -> None:
        self.root = root
        self.io = io
        # Opened once at mount; the root itself never moves.
        self.dirs = dirs or StoreDirs(root)
        self.root_fd = self.dirs.root_fd
        # Made or read at mount (preflight made .ckptfs): every manifest
        # written is sealed with it, every one read checked against it.
        self.key = self.dirs.manifest_key()
        self.euid = os.geteuid()
        self.umask = os.umask(0)
        os.umask(self.umask)
        self.renames = RenameLog()

    def close(self) -> None:
        self.dirs.close()

    def _fence_dir(self) -> int:
        return self.dirs.private(FENCE)

    async def entry(self, rel: str, expect_parent: int | None = None) -> Entry:
        def entry() -> Entry:
            if expect_parent is None or not rel:
                return _entry_at(self.root_fd, rel, self.key)
            start = time.monotonic()
            with _in_parent(self.root_fd, rel, expect_parent) as (dfd, name):
                found = _read_entry_in(dfd, name, rel, self.key)
            found.read_at = start
            return found

        return await self.io.run(entry, what=f"stat {rel or '/'}", interruptible=True)

    async def listdir(self, rel: str, expect: int | None = None) -> list[tuple[str, Entry]]:
        return await self.io.run(
            _list,
            self.root_fd,
            rel,
            expect,
            self.key,
            what=f"readdir {rel or '/'}",
            interruptible=True,
        )

    async def manifest(self, rel: str) -> Manifest | None:
        """The manifest at ``rel``; None for a plain file, or one whose seal
        does not verify (never acted on)."""

        def manifest() -> Manifest | None:
            m = read_manifest(rel, dir_fd=self.root_fd, key=self.key)
            return m if m is not None and m.sealed else None

        return await self.io.run(
            manifest,
            what=f"read manifest {rel}",
            interruptible=True,
        )

    async def create_manifest(
        self, rel: str, manifest: Manifest, uid: int, gid: int, expect_parent: int | None = None
    ) -> tuple[Entry, int]:
        """A new file's manifest, in one backing-store call; returns (entry, group)."""
        return await self.io.run(
            _create_manifest,
            self.root_fd,
            rel,
            manifest,
            uid,
            gid,
            expect_parent,
            self.key,
            what=f"write manifest {rel}",
            with_call=True,
        )

    async def replace_manifest(
        self,
        rel: str,
        manifest: Manifest,
        owner: tuple[int, int],
        *,
        file_id: str,
        expect_version: str | None = None,
        plain: PlainFile | None = None,
        before: Callable[[], None] | None = None,
    ) -> Published:
        """Check what is at ``rel`` and replace it, in one backing-store call."""
        return await self.io.run(
            _replace_manifest,
            self.root_fd,
            self._fence_dir,
            rel,
            manifest,
            owner,
            file_id,
            expect_version,
            plain,
            before,
            self.key,
            what=f"write manifest {rel}",
            with_call=True,
            # Nothing is replaced once the call is abandoned (write_manifest).
            interruptible=True,
        )

    async def takeover_manifest(
        self, rel: str, manifest: Manifest, *, file_id: str, expect_version: str
    ) -> Published:
        """Publish a taken-over file's manifest, fenced (see _takeover_manifest)."""
        return await self.io.run(
            lambda call: _takeover_manifest(
                call,
                self.root_fd,
                self._fence_dir(),
                rel,
                manifest,
                file_id,
                expect_version,
                self.key,
            ),
            what=f"take over manifest {rel}",
            with_call=True,
        )

    def _new_owner(self, pfd: int, owner: tuple[int, int]) -> tuple[tuple[int, int] | None, bool]:
        """For a name made in the directory ``pfd`` for ``owner`` (the
        caller's uid, gid): the owner to give it (None: it has it already),
        and whether the directory is setgid (then the group is its)."""
        parent = os.fstat(pfd)
        setgid = bool(parent.st_mode & stat.S_ISGID)
        uid, gid = owner[0], parent.st_gid if setgid else owner[1]
        return (None if (uid, gid) == (self.euid, os.getegid()) else (uid, gid)), setgid

    async def mkdir(
        self, rel: str, mode: int, owner: tuple[int, int], expect_parent: int | None = None
    ) -> None:
        """A new directory for ``owner`` (the caller's uid and gid: see
        _new_owner) with exactly ``mode`` (and S_ISGID under a setgid one)."""

        def mkdir() -> None:
            with _in_parent(self.root_fd, rel, expect_parent) as (pfd, name):
                chown, setgid = self._new_owner(pfd, owner)
                os.mkdir(name, 0o700, dir_fd=pfd)
                fd = open_dir(pfd, name)
                try:
                    _check_made_dir(fd, rel, self.euid)
                    if chown is not None:
                        os.fchown(fd, *chown)
                    # The caller's mode, not the daemon's umask; after the
                    # chown, which clears setuid/setgid. A directory inherits
                    # the setgid bit itself.
                    os.fchmod(fd, mode | (stat.S_ISGID if setgid else 0))
                finally:
                    os.close(fd)

        await self.io.run(mkdir, what=f"mkdir {rel}")

    async def rmdir(self, rel: str, expect_parent: int | None = None) -> None:
        await self.io.run(_rmdir, self.root_fd, rel, expect_parent, what=f"rmdir {rel}")

    async def unlink(
        self, rel: str, expect_parent: int | None = None, expect: Entry | None = None
    ) -> None:
        """Remove the name ``rel``; with ``expect``, only if it still holds
        that entry's object (ESTALE if another was put there since)."""

        def unlink() -> None:
            with _in_parent(self.root_fd, rel, expect_parent) as (pfd, name):
                if expect is not None:
                    st = os.stat(name, dir_fd=pfd, follow_symlinks=False)
                    if (st.st_dev, st.st_ino) != (expect.st.st_dev, expect.st.st_ino):
                        raise OSError(errno.ESTALE, f"{rel}: replaced since it was looked up")
                os.unlink(name, dir_fd=pfd)

        await self.io.run(unlink, what=f"unlink {rel}")

    async def rename(
        self,
        old: str,
        new: str,
        *,
        before: Callable[[], None] | None = None,
        record_as: str | None = None,
        expect_parents: tuple[int | None, int | None] = (None, None),
    ) -> None:
        """``before`` runs in the same call, just before the rename; neither
        runs if the loop gave up on the call (a timeout) before. With
        ``record_as`` (this node), the rename is recorded first for other
        nodes' flushes (renamelog.py)."""

        await self.io.run(
            self._rename_in_call,
            old,
            new,
            before,
            record_as,
            expect_parents,
            what=f"rename {old} -> {new}",
            with_call=True,
        )

    def _rename_in_call(
        self,
        call: Call[Any],
        old: str,
        new: str,
        before: Callable[[], None] | None,
        record_as: str | None,
        expect_parents: tuple[int | None, int | None],
    ) -> None:
        """In a store call's thread: ``before``, then the rename, each only
        if the loop has not given up on the call (its locks are gone then)."""
        with (
            _in_parent(self.root_fd, old, expect_parents[0]) as (ofd, oname),
            _in_parent(self.root_fd, new, expect_parents[1]) as (nfd, nname),
        ):
            if before is not None and not call.abandoned():
                before()
            if call.abandoned():
                raise OSError(errno.ETIMEDOUT, f"rename {old} -> {new}: given up on")
            if record_as is not None:
                try:
                    write_record(self.dirs, old, new, record_as)
                except OSError as exc:
                    log.error(
                        "rename %s -> %s not recorded (%s): another node's pending file "
                        "it moves is dropped by that node's flush",
                        old,
                        new,
                        exc,
                    )
                if call.abandoned():  # the record took longer than the store call may
                    raise OSError(errno.ETIMEDOUT, f"rename {old} -> {new}: given up on")
            os.rename(oname, nname, src_dir_fd=ofd, dst_dir_fd=nfd)

    async def renamed_to(self, rel: str, file_id: str) -> str | None:
        """Where renames recorded by any node moved ``file_id`` from ``rel``
        (renamelog.py); None if to nowhere it still is."""
        return await self.io.run(
            self.renames.follow, self.dirs, rel, file_id, what=f"follow renames of {rel}"
        )

    async def rename_reading(
        self,
        old: str,
        new: str,
        *,
        noreplace: bool,
        rename: bool = True,
        before: Callable[[], None] | None = None,
        node: str = "",
        record_ids: frozenset[str] = frozenset(),
        expect_parents: tuple[int | None, int | None] = (None, None),
        expect_source: Callable[[Entry], bool] | None = None,
    ) -> tuple[Entry, Entry | None, Entry | None]:
        """What is at ``old`` and at ``new`` (None: nothing), then, with
        ``rename``, the rename, all in one backing-store call: the kernel holds
        the replaced file's inode lock for as long as a RENAME takes, and a
        reader's lseek(SEEK_END) of that file waits for it. ``before`` runs
        in the same call just before the rename; neither runs if the loop gave
        up on the call before (a timeout); a rename that may move a pending
        file of a node other than ``node`` is recorded (renamelog.py), and
        so is one of a file in ``record_ids`` (this node's own, pending
        under a path another node's rename left stale: its recovery after a
        crash follows the records).
        FileNotFoundError if ``old`` is
        gone; FileExistsError with ``noreplace`` if ``new`` is not; ESTALE if
        ``expect_source`` (whether an entry is what its inode was bound to)
        says no of what is at ``old`` now. The third
        entry is the source as the rename left it (its new ctime): None if
        not renamed here, or if its stat did not find the same file."""

        def rename_(
            call: Call[tuple[Entry, Entry | None, Entry | None]],
        ) -> tuple[Entry, Entry | None, Entry | None]:
            with (
                _in_parent(self.root_fd, old, expect_parents[0]) as (ofd, oname),
                _in_parent(self.root_fd, new, expect_parents[1]) as (nfd, nname),
            ):
                start = time.monotonic()
                source = _read_entry_in(ofd, oname, old, self.key)
                source.read_at = start
                if expect_source is not None and not expect_source(source):
                    raise OSError(errno.ESTALE, f"{old}: replaced since it was looked up")
                try:
                    target: Entry | None = _read_entry_in(nfd, nname, new, self.key)
                except FileNotFoundError:
                    target = None
                if target is not None and noreplace:
                    raise FileExistsError(errno.EEXIST, f"{new} exists")
                if not rename:
                    return source, target, None
                recorded = needs_record(source.kind, source.manifest, node) or (
                    source.manifest is not None and source.manifest.file_id in record_ids
                )
                record = node if recorded else None
                self._rename_in_call(call, old, new, before, record, expect_parents)
                try:
                    st = os.stat(nname, dir_fd=nfd, follow_symlinks=False)
                except OSError:
                    return source, target, None
                if not PlainFile.of(source.st).matches(st):
                    return source, target, None  # replaced again since, from elsewhere
                return source, target, Entry(source.kind, st, source.manifest, source.read_at)

        return await self.io.run(rename_, what=f"rename {old} -> {new}", with_call=True)

    async def symlink(
        self, target: bytes, rel: str, owner: tuple[int, int], expect_parent: int | None = None
    ) -> None:
        """A new symlink for ``owner`` (the caller's uid and gid: see _new_owner)."""

        def symlink() -> None:
            with _in_parent(self.root_fd, rel, expect_parent) as (pfd, name):
                chown, _ = self._new_owner(pfd, owner)
                os.symlink(target, name, dir_fd=pfd)
                if chown is None:
                    return
                with held(pfd, name) as (fd, st):
                    # Ours, just made, unless swapped in that instant: then
                    # nothing is given away.
                    if not stat.S_ISLNK(st.st_mode) or st.st_uid != self.euid:
                        raise OSError(errno.EBUSY, f"{rel}: replaced while being made")
                    os.chown(via_fd(fd), *chown)

        await self.io.run(symlink, what=f"symlink {rel}")

    async def readlink(self, rel: str, expect: int | None = None) -> bytes:
        """The target of the symlink at ``rel``; ESTALE if it is not the one
        whose st_ino is ``expect``, or no symlink now (the kernel then looks
        the name up again)."""

        def readlink() -> bytes:
            with held(self.root_fd, rel, expect) as (fd, st):
                if not stat.S_ISLNK(st.st_mode):
                    raise OSError(errno.ESTALE, f"{rel}: not a symlink now")
                return os.readlink(b"", dir_fd=fd)  # the held link's own target

        return await self.io.run(readlink, what=f"readlink {rel}", interruptible=True)

    async def set_attributes(
        self,
        rel: str,
        expect: int | None,
        *,
        mode: int | None = None,
        uid: int = -1,
        gid: int = -1,
        atime_ns: int | None = None,
        mtime_ns: int | None = None,
    ) -> None:
        """chmod, chown and utime (each only if asked; a time None stays as
        it is) of the directory, plain file or symlink at ``rel``, all on the
        one object held open: ESTALE if it is not the one whose st_ino is
        ``expect`` (None: not checked, the root). A symlink has no mode of
        its own: asked for one, ESTALE too (what is there is not what the
        kernel knew)."""

        def set_attributes() -> None:
            with held(self.root_fd, rel, expect) as (fd, st):
                at = via_fd(fd)  # the held object itself, a symlink included
                if mode is not None and stat.S_ISLNK(st.st_mode):
                    raise OSError(errno.ESTALE, f"{rel}: a symlink now")
                if uid != -1 or gid != -1:
                    os.chown(at, uid, gid)
                if mode is not None:  # after chown, which clears setuid/setgid
                    os.chmod(at, mode)
                if atime_ns is not None or mtime_ns is not None:
                    times = (
                        st.st_atime_ns if atime_ns is None else atime_ns,
                        st.st_mtime_ns if mtime_ns is None else mtime_ns,
                    )
                    os.utime(at, ns=times)

        await self.io.run(set_attributes, what=f"setattr {rel or '.'}")

    async def open_plain(
        self, rel: str, expect: Callable[[os.stat_result], bool] | None = None
    ) -> int:
        """A read-only fd of the plain file at ``rel``; ESTALE if ``expect``
        says that another file is there now (a manifest written at its name),
        or if it is not a regular file (a FIFO, a device: never opened for
        what they would do)."""

        def open_() -> int:
            with parent_dir(self.root_fd, rel) as (dfd, name):
                flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
                st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
                if not stat.S_ISREG(st.st_mode):
                    raise OSError(errno.ESTALE, f"{rel}: not a regular file")
                fd = os.open(name, flags, dir_fd=dfd)
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or (expect is not None and not expect(st)):
                os.close(fd)
                raise OSError(errno.ESTALE, f"{rel}: another file is at its name now")
            return fd

        return await self.io.run(open_, what=f"open {rel}", late=_close_quietly, interruptible=True)

    async def pread(self, fd: int, size: int, off: int, rel: str) -> bytes:
        return await self.io.run(os.pread, fd, size, off, what=f"read {rel}", interruptible=True)

    async def close_fd(self, fd: int) -> None:
        await self.io.run(os.close, fd, what="close", essential=True)

    async def statvfs(self) -> os.statvfs_result:
        return await self.io.run(os.fstatvfs, self.root_fd, what="statfs", interruptible=True)


def _check_made_dir(fd: int, rel: str, euid: int) -> None:
    """The directory just made at ``rel`` (held as ``fd``) is the one we
    made: ours, empty, with mkdir's mode. Another put at the name in that
    instant (an empty one, or one of a user's) is not given away."""
    st = os.fstat(fd)
    # (Under a setgid parent it also has S_ISGID.)
    if st.st_uid != euid or st.st_mode & 0o777 != 0o700 or os.listdir(fd):
        raise OSError(errno.EBUSY, f"{rel}: replaced while being made")
