"""Renames that may have moved other nodes' pending files, recorded in the
backing store.

A node makes its pending file durable by publishing its manifest at the path
it knows. A rename done on another node (of the file, or of a directory
above it: a job's rank 0 renaming the checkpoint directory that ranks on
other nodes wrote into) moves that manifest away; the flusher then found no
name, took the file for removed and dropped its only copies. So the renaming
node writes a record (old path, new path) in ``.ckptfs/renamed`` before the
rename, in the same backing-store call, and a flusher that finds no name
follows the records to the path they lead to, and publishes there if the
manifest there is still its file.

Records are written only for renames that can move another node's pending
file: a directory, or a pending manifest whose writer (its first holder) is
another node. A node's renames of its own files need none (it moves its own
paths, and tells its buddy). Records older than RECORD_TTL are removed by
the next node that writes one. Everything here blocks: store-call threads only.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from dataclasses import dataclass

from ckptfs.fs.store.beneath import check_rel
from ckptfs.fs.store.manifest import (
    Manifest,
    ManifestError,
    fsync_dir,
    is_tmp_name,
    new_id,
    read_manifest,
    tmp_name,
    write_all,
)
from ckptfs.fs.store.storedirs import CKPTFS_DIR, RENAMED, StoreDirs

log = logging.getLogger(__name__)

RENAMED_DIR = f"{CKPTFS_DIR}/{RENAMED}"  # for messages
# Long enough for any flush to have ended (a store down for hours included):
# a pending file needs the records of the renames that moved it until then.
RECORD_TTL = 24 * 3600.0
# Paths a follow looks at, at most: a bound on a pathological log's cost.
MAX_PATHS = 1000


def needs_record(kind: str, manifest: Manifest | None, node: str) -> bool:
    """Whether renaming what is at a name (its entry's kind and manifest) may
    move a pending file that another node flushes."""
    if kind == "dir":
        return True
    return (
        manifest is not None
        and manifest.state == "pending"
        and bool(manifest.holders)
        and manifest.holders[0] != node
    )


def write_record(dirs: StoreDirs, old: str, new: str, node: str) -> None:
    """Record the rename of ``old`` to ``new`` (before doing it), durably."""
    dfd = dirs.private(RENAMED)
    now = time.time_ns()
    # The node's name is the operator's (config), but a name with a slash
    # must not become a path.
    name = f"{now:020d}-{node.replace('/', '_')}-{new_id()}"
    tmp = tmp_name(name)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(tmp, flags, 0o600, dir_fd=dfd)
    try:
        write_all(fd, json.dumps({"old": old, "new": new, "node": node}).encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.rename(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
    fsync_dir(dfd)
    _prune(dirs, now)


def _prune(dirs: StoreDirs, now_ns: int) -> None:
    dfd = dirs.private(RENAMED)
    for name in dirs.names(RENAMED):
        at = _time_of(name)
        try:
            if at is None:  # a temporary name a crash left: by its own age
                at = os.stat(name, dir_fd=dfd, follow_symlinks=False).st_mtime_ns
            if now_ns - at > RECORD_TTL * 1e9:
                os.unlink(name, dir_fd=dfd)
        except FileNotFoundError:
            pass  # another node pruned it first
        except OSError as exc:  # the record itself is written: only the pruning fails
            log.warning("rename record %s/%s not pruned: %s", RENAMED_DIR, name, exc)


def _time_of(name: str) -> int | None:
    head = name.split("-", 1)[0]
    return int(head) if head.isdigit() and not is_tmp_name(name) else None


@dataclass(frozen=True)
class RenameRecord:
    at_ns: int
    name: str
    old: str
    new: str

    def apply(self, path: str) -> str | None:
        """Where this rename moved ``path``; None if it did not move it."""
        if path == self.old:
            return self.new
        if path.startswith(self.old + "/"):
            return self.new + path[len(self.old) :]
        return None


class RenameLog:
    """The reading side: records are parsed once and kept (they never
    change), so a flusher that finds many names gone (a rotation that removed
    pending checkpoints) lists the directory, not every record, each time."""

    def __init__(self) -> None:
        self._parsed: dict[str, RenameRecord | None] = {}
        self._lock = threading.Lock()  # store calls run in several threads

    def records(self, dirs: StoreDirs) -> list[RenameRecord]:
        """Every record, each parsed once. A record that cannot be read now
        (EIO: the store failing) raises, after the others are read: without
        it the rename that moved a file may be missing, and a flusher would
        take the file for gone and drop it (fault trials, seed 1205, trial
        56). One removed since the listing is simply not there."""
        dfd = dirs.private(RENAMED)
        names = dirs.names(RENAMED)
        unread: OSError | None = None
        with self._lock:
            for name in names:
                if name not in self._parsed and _time_of(name) is not None:
                    try:
                        self._parsed[name] = _read(dfd, name)
                    except FileNotFoundError:
                        continue
                    except OSError as exc:  # read again next time: NFS hiccups pass
                        log.warning("rename record %s/%s not read: %s", RENAMED_DIR, name, exc)
                        unread = unread or exc
            for name in set(self._parsed) - set(names):
                del self._parsed[name]
            found = [r for r in self._parsed.values() if r is not None]
        if unread is not None:
            raise unread
        return sorted(found, key=lambda r: (r.at_ns, r.name))

    def follow(self, dirs: StoreDirs, path: str, file_id: str) -> str | None:
        """A path that recorded renames lead to from ``path`` where the
        manifest is ``file_id``'s; None if there is none.

        Which records moved the file, and in which order, is not known: a
        record from before the file came to ``path`` may match it too,
        nodes' clocks differ, and a rename that failed after its record was
        written leaves a record of nothing. So every chain of records from
        ``path`` is walked, in any order, and only the manifest at a path
        decides (file ids are unique: a wrong chain finds another file or
        nothing, never a wrong file)."""
        # Newest first: the rename that moved it is most likely recent (a
        # job renaming tmp to step_N at each save leaves a record per save).
        records = self.records(dirs)[::-1]
        seen = {path}
        frontier = [path]
        while frontier:
            at = frontier.pop(0)
            for r in records:
                moved = r.apply(at)
                if moved is None or moved in seen:
                    continue
                if len(seen) >= MAX_PATHS:
                    return None
                seen.add(moved)
                frontier.append(moved)
                # Only nothing there (or no manifest of ours) is skipped: any
                # other error (EIO: the store failing) raises, for the caller
                # to try again; taken for "not there", it would drop a file
                # that a rename moved (fault trials, seed 77, trial 3).
                try:
                    m = read_manifest(moved, dir_fd=dirs.root_fd, key=dirs.manifest_key())
                except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
                    continue
                except (ManifestError, ValueError):
                    continue
                if m is not None and m.sealed and m.file_id == file_id:
                    return moved
        return None


def _read(dfd: int, name: str) -> RenameRecord | None:
    """The record ``name`` in the directory ``dfd``; None (for good) if it
    does not parse, or names a path that is not beneath the backing root.
    OSError if it cannot be read now."""
    fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dfd)
    try:
        raw = os.read(fd, 1 << 16)
    finally:
        os.close(fd)
    try:
        body = json.loads(raw)
        old, new = body["old"], body["new"]
        if not isinstance(old, str) or not isinstance(new, str) or not old or not new:
            raise ValueError("old and new must be non-empty strings")
        return RenameRecord(int(name.split("-", 1)[0]), name, check_rel(old), check_rel(new))
    except (ValueError, KeyError, TypeError) as exc:
        log.warning("rename record %s/%s unreadable, ignored: %s", RENAMED_DIR, name, exc)
        return None
