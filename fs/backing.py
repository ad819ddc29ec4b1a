"""The namespace in the backing directory: names, directories and manifests.

Every call runs in a worker thread under the backing-store timeout (see
blocking.py). Paths are relative to the backing root (``""`` is the root) and
every call is made relative to a directory fd of the root, so a path near
PATH_MAX inside the mount still works although the backing root is longer
than the mountpoint. The ``.ckptfs`` directory and temporary names are hidden.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .blocking import BackingIO, Call
from .chunkstore import CKPTFS_DIR
from .manifest import (
    DirTimes,
    Manifest,
    ManifestError,
    ParsedManifests,
    dir_times_kept,
    fsync_dir,
    is_tmp_name,
    manifest_from_fd,
    open_dir,
    read_manifest,
    tmp_name,
    write_manifest,
)
from .renamelog import RenameLog, needs_record, write_record
from .state import Published

log = logging.getLogger(__name__)


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


def _entry_at(root: int, rel: str) -> Entry:
    start = time.monotonic()
    entry = _read_entry(root, rel)
    entry.read_at = start
    return entry


def _read_entry(root: int, rel: str) -> Entry:
    st = os.stat(rel or ".", dir_fd=root, follow_symlinks=False)
    if stat.S_ISDIR(st.st_mode):
        return Entry("dir", st)
    if stat.S_ISLNK(st.st_mode):
        return Entry("symlink", st)
    if stat.S_ISREG(st.st_mode):
        # Opened every time (on NFS the open is what revalidates); read and
        # parsed only when the manifest file is not the one seen before.
        try:
            fd = os.open(
                rel, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=root
            )
        except OSError as exc:
            if exc.errno == errno.ELOOP:  # replaced by a symlink since the stat
                return Entry("symlink", os.stat(rel, dir_fd=root, follow_symlinks=False))
            raise
        try:
            st = os.fstat(fd)
            manifest = PARSED.read(fd, rel, st)
        except ManifestError as exc:
            raise OSError(errno.EIO, f"unreadable manifest: {exc}") from None
        finally:
            os.close(fd)
        return Entry("file", st, manifest) if manifest else Entry("plain", st)
    return Entry("plain", st)


def _list(root: int, rel: str) -> list[tuple[str, Entry]]:
    dfd = open_dir(rel, root)
    try:
        names = sorted(os.listdir(dfd))
        entries = []
        for name in names:
            if hidden(rel, name):
                continue
            try:
                entries.append((name, _entry_at(dfd, name)))
            except FileNotFoundError:  # removed meanwhile (another node)
                continue
        return entries
    finally:
        os.close(dfd)


def _rmdir(root: int, rel: str) -> None:
    try:
        os.rmdir(rel, dir_fd=root)
    except OSError as exc:
        if exc.errno != errno.ENOTEMPTY:
            raise
        # Leftover temporary files of an interrupted manifest write are not
        # visible through the mount and must not make rmdir fail.
        dfd = open_dir(rel, root)
        try:
            names = os.listdir(dfd)
            if not names or not all(is_tmp_name(n) for n in names):
                raise
            for name in names:
                os.unlink(name, dir_fd=dfd)
        finally:
            os.close(dfd)
        os.rmdir(rel, dir_fd=root)


def _create_manifest(
    call: Call[tuple[Entry, int]], root: int, rel: str, manifest: Manifest, uid: int, gid: int
) -> tuple[Entry, int]:
    """Write a new file's first manifest, owned by ``uid`` and the right group:
    the parent's under a setgid directory, else ``gid``. Returns (entry, gid)."""
    parent = os.stat(os.path.dirname(rel) or ".", dir_fd=root)
    if parent.st_mode & stat.S_ISGID:
        gid = parent.st_gid
    write_manifest(rel, manifest, dir_fd=root, owner=(uid, gid), abandoned=call.abandoned)
    return _entry_at(root, rel), gid


def _replace_manifest(
    call: Call[Published],
    root: int,
    rel: str,
    manifest: Manifest,
    owner: tuple[int, int],
    file_id: str,
    expect_version: str | None,
    plain: PlainFile | None,
    before: Callable[[], None] | None,
) -> Published:
    """Replace the manifest at ``rel`` if it still belongs to ``file_id`` (and,
    with ``expect_version``, is still that version), or, with ``plain``, if
    that plain file is still there; ``before`` runs first."""
    try:
        try:
            current, st = _manifest_and_stat(root, rel)
        except FileNotFoundError:
            # A takeover may have moved it aside for an instant (see
            # _takeover_manifest): wait for it before calling the name gone,
            # and never call it gone while the takeover still holds it.
            if not _wait_for_fence(root, file_id):
                raise
            try:
                current, st = _manifest_and_stat(root, rel)
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
    if expect_version is not None and (current is None or current.version != expect_version):
        return Published.STALE
    if before is not None:
        before()
    write_manifest(
        rel, manifest, dir_fd=root, owner=owner, abandoned=call.abandoned, keep_dir_times=True
    )
    return Published.DONE


def _manifest_and_stat(root: int, rel: str) -> tuple[Manifest | None, os.stat_result]:
    """The manifest at ``rel`` and the stat of that file. None for a plain
    file, and for an unreadable manifest: neither is ours to replace, unless
    it is the very plain file a writer adopted."""
    fd = os.open(rel, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=root)
    try:
        st = os.fstat(fd)
        try:
            return manifest_from_fd(fd, rel), st
        except ManifestError:
            return None, st
    finally:
        os.close(fd)


FENCE_DIR = f"{CKPTFS_DIR}/fence"
# Seconds after which a fence left by a dead takeover is broken: longer than a
# backing-store call may take (backing_timeout, 120 s by default), so a live
# takeover whose call the loop gave up on is never overtaken.
FENCE_STALE = 300.0
FENCE_WAIT = 5.0  # longest a publish waits for a takeover's fence to go


def _fence(file_id: str) -> str:
    return f"{FENCE_DIR}/{file_id}"


def _wait_for_fence(root: int, file_id: str) -> bool:
    """True if a takeover of ``file_id`` was fenced (and has ended, or waited long enough)."""
    try:
        os.stat(_fence(file_id), dir_fd=root)
    except FileNotFoundError:
        return False
    deadline = time.monotonic() + FENCE_WAIT
    while time.monotonic() < deadline:
        time.sleep(0.005)
        try:
            os.stat(_fence(file_id), dir_fd=root)
        except FileNotFoundError:
            break
    return True


def _take_fence(root: int, file_id: str) -> bool:
    for d in (CKPTFS_DIR, FENCE_DIR):
        try:
            os.mkdir(d, 0o700, dir_fd=root)
        except FileExistsError:
            pass
    for _ in range(2):
        try:
            os.close(
                os.open(_fence(file_id), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600, dir_fd=root)
            )
            return True
        except FileExistsError:
            try:
                age = time.time() - os.stat(_fence(file_id), dir_fd=root).st_mtime
            except FileNotFoundError:
                continue
            if age < FENCE_STALE:
                return False
            os.unlink(_fence(file_id), dir_fd=root)  # left by a takeover that died
    return False


def _takeover_manifest(
    call: Call[Published],
    root: int,
    rel: str,
    manifest: Manifest,
    file_id: str,
    expect_version: str,
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
    if not _take_fence(root, file_id):
        # Not STALE: the flusher would take that as "rewritten elsewhere" and
        # drop the only copy. An error makes it try again later.
        raise OSError(errno.EBUSY, f"{rel}: another takeover of this file is under way")
    try:
        parent, name = os.path.split(rel)
        try:
            dfd = open_dir(parent, root)
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
                return _link_over(call, dfd, name, manifest, file_id, expect_version, times)
        finally:
            os.close(dfd)
    finally:
        try:
            os.unlink(_fence(file_id), dir_fd=root)
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
            st = os.stat(name, dir_fd=dfd)
        except FileNotFoundError:
            return Published.NAME_GONE
        # In the directory held open: by path, a directory removed and made
        # again since would get the temporary name, and keep it.
        write_manifest(new, manifest, dir_fd=dfd, owner=(st.st_uid, st.st_gid), dir_times=times)
        try:
            with times.change():
                os.rename(name, aside, src_dir_fd=dfd, dst_dir_fd=dfd)
        except FileNotFoundError:
            return Published.NAME_GONE
        try:
            try:
                current = read_manifest(aside, dir_fd=dfd)
            except ManifestError:
                current = None
            if current is None or current.file_id != file_id or current.version != expect_version:
                try:
                    with times.change():
                        os.link(aside, name, src_dir_fd=dfd, dst_dir_fd=dfd)  # put it back
                except FileExistsError:
                    pass  # something newer was published meanwhile: it stays
                fsync_dir(dfd)
                if current is None or current.file_id != file_id:
                    return Published.NAME_GONE
                return Published.STALE
            try:
                with times.change():
                    if call.abandoned():
                        os.link(aside, name, src_dir_fd=dfd, dst_dir_fd=dfd)
                        return Published.STALE
                    os.link(new, name, src_dir_fd=dfd, dst_dir_fd=dfd)
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
    def __init__(self, root: Path, io: BackingIO) -> None:
        self.root = root
        self.io = io
        # Opened once at mount; the root itself never moves.
        self.root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        self.umask = os.umask(0)
        os.umask(self.umask)
        self.renames = RenameLog()

    def close(self) -> None:
        os.close(self.root_fd)

    def entry_here(self, rel: str) -> Entry | None:
        """The entry at ``rel``, read in the calling thread: for the FUSE
        request thread, whose store calls its session bounds (storecall.py).
        None while the store is not healthy: the loop's :meth:`entry`, with
        its timeout, then asks instead."""
        if self.io.health != "normal":
            return None
        return _entry_at(self.root_fd, rel)

    async def entry(self, rel: str) -> Entry:
        return await self.io.run(
            _entry_at, self.root_fd, rel, what=f"stat {rel or '/'}", interruptible=True
        )

    async def listdir(self, rel: str) -> list[tuple[str, Entry]]:
        return await self.io.run(
            _list, self.root_fd, rel, what=f"readdir {rel or '/'}", interruptible=True
        )

    async def manifest(self, rel: str) -> Manifest | None:
        return await self.io.run(
            lambda: read_manifest(rel, dir_fd=self.root_fd),
            what=f"read manifest {rel}",
            interruptible=True,
        )

    async def create_manifest(
        self, rel: str, manifest: Manifest, uid: int, gid: int
    ) -> tuple[Entry, int]:
        """A new file's manifest, in one backing-store call; returns (entry, group)."""
        return await self.io.run(
            _create_manifest,
            self.root_fd,
            rel,
            manifest,
            uid,
            gid,
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
            rel,
            manifest,
            owner,
            file_id,
            expect_version,
            plain,
            before,
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
            _takeover_manifest,
            self.root_fd,
            rel,
            manifest,
            file_id,
            expect_version,
            what=f"take over manifest {rel}",
            with_call=True,
        )

    async def mkdir(self, rel: str, mode: int) -> None:
        def mkdir() -> None:
            os.mkdir(rel, mode, dir_fd=self.root_fd)
            if mode & (self.umask | 0o7000):  # the caller's mode, not the daemon's umask
                os.chmod(rel, mode, dir_fd=self.root_fd)

        await self.io.run(mkdir, what=f"mkdir {rel}")

    async def rmdir(self, rel: str) -> None:
        await self.io.run(_rmdir, self.root_fd, rel, what=f"rmdir {rel}")

    async def unlink(self, rel: str) -> None:
        await self.io.run(lambda: os.unlink(rel, dir_fd=self.root_fd), what=f"unlink {rel}")

    async def rename(
        self,
        old: str,
        new: str,
        *,
        before: Callable[[], None] | None = None,
        record_as: str | None = None,
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
    ) -> None:
        """In a store call's thread: ``before``, then the rename, each only
        if the loop has not given up on the call (its locks are gone then)."""
        if before is not None and not call.abandoned():
            before()
        if call.abandoned():
            raise OSError(errno.ETIMEDOUT, f"rename {old} -> {new}: given up on")
        if record_as is not None:
            try:
                write_record(self.root_fd, old, new, record_as)
            except OSError as exc:
                log.error("rename %s -> %s not recorded (%s): another node's pending file it "
                          "moves is dropped by that node's flush", old, new, exc)  # fmt: skip
            if call.abandoned():  # the record took longer than the store call may
                raise OSError(errno.ETIMEDOUT, f"rename {old} -> {new}: given up on")
        os.rename(old, new, src_dir_fd=self.root_fd, dst_dir_fd=self.root_fd)

    async def renamed_to(self, rel: str, file_id: str) -> str | None:
        """Where renames recorded by any node moved ``file_id`` from ``rel``
        (renamelog.py); None if to nowhere it still is."""
        return await self.io.run(
            self.renames.follow, self.root_fd, rel, file_id, what=f"follow renames of {rel}"
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
        gone; FileExistsError with ``noreplace`` if ``new`` is not. The third
        entry is the source as the rename left it (its new ctime): None if
        not renamed here, or if its stat did not find the same file."""

        def rename_(
            call: Call[tuple[Entry, Entry | None, Entry | None]],
        ) -> tuple[Entry, Entry | None, Entry | None]:
            source = _entry_at(self.root_fd, old)
            try:
                target: Entry | None = _entry_at(self.root_fd, new)
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
            self._rename_in_call(call, old, new, before, record)
            try:
                st = os.stat(new, dir_fd=self.root_fd, follow_symlinks=False)
            except OSError:
                return source, target, None
            if not PlainFile.of(source.st).matches(st):
                return source, target, None  # replaced again since, from elsewhere
            return source, target, Entry(source.kind, st, source.manifest, source.read_at)

        return await self.io.run(rename_, what=f"rename {old} -> {new}", with_call=True)

    async def symlink(self, target: bytes, rel: str) -> None:
        await self.io.run(
            lambda: os.symlink(target, rel, dir_fd=self.root_fd), what=f"symlink {rel}"
        )

    async def readlink(self, rel: str) -> bytes:
        return await self.io.run(
            lambda: os.readlink(os.fsencode(rel), dir_fd=self.root_fd),
            what=f"readlink {rel}",
            interruptible=True,
        )

    async def chmod(self, rel: str, mode: int) -> None:
        # Only for directories and plain files (symlinks have no mode of their own).
        await self.io.run(
            lambda: os.chmod(rel or ".", mode, dir_fd=self.root_fd), what=f"chmod {rel or '.'}"
        )

    async def chown(self, rel: str, uid: int, gid: int) -> None:
        def chown() -> None:
            os.chown(rel or ".", uid, gid, dir_fd=self.root_fd, follow_symlinks=False)

        await self.io.run(chown, what=f"chown {rel}")

    async def utime(self, rel: str, atime_ns: int, mtime_ns: int) -> None:
        def utime() -> None:
            os.utime(
                rel or ".", ns=(atime_ns, mtime_ns), dir_fd=self.root_fd, follow_symlinks=False
            )

        await self.io.run(utime, what=f"utime {rel}")

    async def open_plain(
        self, rel: str, expect: Callable[[os.stat_result], bool] | None = None
    ) -> int:
        """A read-only fd of the plain file at ``rel``; ESTALE if ``expect``
        says that another file is there now (a manifest written at its name)."""

        def open_() -> int:
            fd = os.open(rel, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self.root_fd)
            if expect is not None and not expect(os.fstat(fd)):
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
