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

What a name is, and listings: entries.py. Publishing a file's manifest:
publish.py. Resolution beneath the root and the checks of a directory or
object held open: beneath.py.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ckptfs.fs.store import publish
from ckptfs.fs.store.beneath import held, in_parent, open_dir, parent_dir, via_fd
from ckptfs.fs.store.blocking import BackingIO, Call
from ckptfs.fs.store.entries import Entry, PlainFile, entry_at, list_entries, read_entry_in
from ckptfs.fs.store.manifest import Manifest, is_tmp_name, read_manifest
from ckptfs.fs.store.publish import Published
from ckptfs.fs.store.renamelog import RenameLog, needs_record, write_record
from ckptfs.fs.store.storedirs import FENCE, StoreDirs

log = logging.getLogger(__name__)


def _rmdir(root: int, rel: str, expect_parent: int | None) -> None:
    with in_parent(root, rel, expect_parent) as (pfd, name):
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
                return entry_at(self.root_fd, rel, self.key)
            start = time.monotonic()
            with in_parent(self.root_fd, rel, expect_parent) as (dfd, name):
                found = read_entry_in(dfd, name, rel, self.key)
            found.read_at = start
            return found

        return await self.io.run(entry, what=f"stat {rel or '/'}", interruptible=True)

    async def listdir(self, rel: str, expect: int | None = None) -> list[tuple[str, Entry]]:
        return await self.io.run(
            list_entries,
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
            publish.create_manifest,
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
            publish.replace_manifest,
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
        self, rel: str, manifest: Manifest, *, file_id: str, expect_version: str, holder: str = ""
    ) -> Published:
        """Publish a taken-over file's manifest, fenced (see publish.takeover_manifest)
        by node ``holder``."""
        return await self.io.run(
            lambda call: publish.takeover_manifest(
                call,
                self.root_fd,
                self._fence_dir(),
                rel,
                manifest,
                file_id,
                expect_version,
                self.key,
                holder,
            ),
            what=f"take over manifest {rel}",
            with_call=True,
        )

    async def restore_own_fences(self, node: str) -> list[str]:
        """Put back what this node's takeovers had moved aside when it died
        (publish.restore_own_fences); the paths put back."""
        return await self.io.run(
            publish.restore_own_fences, self.root_fd, self._fence_dir(), node,
            what="put back what this node's takeovers left aside",
        )  # fmt: skip

    async def restore_aside(self, rel: str, file_id: str) -> bool:
        """Put back at ``rel`` a manifest of ``file_id`` that a takeover which
        failed or died left aside (publish.restore_aside); whether it did."""
        return await self.io.run(
            publish.restore_aside, self.root_fd, self._fence_dir(), rel, file_id,
            what=f"look for the manifest of {rel} aside",
        )  # fmt: skip

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
            with in_parent(self.root_fd, rel, expect_parent) as (pfd, name):
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
            with in_parent(self.root_fd, rel, expect_parent) as (pfd, name):
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
            in_parent(self.root_fd, old, expect_parents[0]) as (ofd, oname),
            in_parent(self.root_fd, new, expect_parents[1]) as (nfd, nname),
        ):
            if before is not None and not call.abandoned():
                before()
            if call.abandoned():
                raise OSError(errno.ETIMEDOUT, f"rename {old} -> {new}: given up on")
            if record_as is not None:
                try:
                    write_record(self.dirs, old, new, record_as)
                except OSError as exc:
                    # Unrecorded, the rename would lose every other node's
                    # pending file it moves: their flushes could not follow
                    # it. It fails instead, and moves nothing.
                    raise OSError(
                        exc.errno, f"rename {old} -> {new}: its record was not written: {exc}"
                    ) from exc
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
                in_parent(self.root_fd, old, expect_parents[0]) as (ofd, oname),
                in_parent(self.root_fd, new, expect_parents[1]) as (nfd, nname),
            ):
                start = time.monotonic()
                source = read_entry_in(ofd, oname, old, self.key)
                source.read_at = start
                if expect_source is not None and not expect_source(source):
                    raise OSError(errno.ESTALE, f"{old}: replaced since it was looked up")
                try:
                    target: Entry | None = read_entry_in(nfd, nname, new, self.key)
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
            with in_parent(self.root_fd, rel, expect_parent) as (pfd, name):
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
