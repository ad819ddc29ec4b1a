"""What a name in the backing directory is: an Entry (a directory, symlink,
plain file, or a file's manifest), read beneath the root, one name or a whole
directory's listing. A manifest whose seal does not verify (one ckptfs did
not write) is the plain file it is, and is reported once. PlainFile is a
plain file as a writer adopted it; ``hidden`` says which names the mount
does not show. Everything here blocks; Backing runs it in store calls."""

from __future__ import annotations

import errno
import logging
import os
import stat
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from ckptfs.fs.store.beneath import check_dir, open_dir, parent_dir
from ckptfs.fs.store.manifest import Manifest, ManifestError, ParsedManifests, is_tmp_name
from ckptfs.fs.store.storedirs import CKPTFS_DIR

log = logging.getLogger("ckptfs.fs.store.backing")  # the backing namespace's logger


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


def entry_at(root: int, rel: str, key: bytes | None) -> Entry:
    start = time.monotonic()
    entry = _read_entry(root, rel, key)
    entry.read_at = start
    return entry


def _read_entry(root: int, rel: str, key: bytes | None) -> Entry:
    if not rel:
        return Entry("dir", os.fstat(root))
    with parent_dir(root, rel) as (dfd, name):
        return read_entry_in(dfd, name, rel, key)


def read_entry_in(dfd: int, name: str, rel: str, key: bytes | None, listing: bool = False) -> Entry:
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


def list_entries(
    root: int, rel: str, expect_ino: int | None, key: bytes | None
) -> list[tuple[str, Entry]]:
    dfd = open_dir(root, rel)
    try:
        check_dir(dfd, rel, expect_ino)
        names = sorted(os.listdir(dfd))
        entries = []
        for name in names:
            if hidden(rel, name):
                continue
            start = time.monotonic()
            try:
                entry = read_entry_in(
                    dfd, name, f"{rel}/{name}" if rel else name, key, listing=True
                )
            except FileNotFoundError:  # removed meanwhile (another node)
                continue
            entry.read_at = start
            entries.append((name, entry))
        return entries
    finally:
        os.close(dfd)
