"""Checkpoint retention: keep the last N checkpoint directories, offline.

Deletes only what ckptfs itself wrote (directories whose every file is a
manifest) and only once the newest checkpoint is durable, so a crash right
after a deletion still leaves a complete checkpoint in the backing store.
Every deletion (and every directory kept for safety) is appended to an audit
log. Deleting manifests frees no chunks by itself; ``ckptfs gc`` does that.
"""

from __future__ import annotations

import fnmatch
import logging
import os
import re
import shutil
import stat
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

from ckptfs.fs.store.beneath import open_dir
from ckptfs.fs.store.manifest import MAGIC, ManifestError, is_tmp_name, read_manifest
from ckptfs.fs.store.storedirs import CKPTFS_DIR

log = logging.getLogger("ckptfs.retention")

# (action, the directory deleted or kept, why): one line of the audit log.
Audit = Callable[[str, str, str], None]


def apply_retention(
    root: Path,
    pattern: str,
    keep_last: int,
    audit_log: Path,
    is_durable: Callable[[Path], bool] | None = None,
    key: bytes | None = None,
) -> list[Path]:
    """Delete the checkpoint directories under ``root`` beyond the newest
    ``keep_last`` (see :func:`retain`); ``root`` is the operator's path, and
    ``is_durable(path)`` says whether one under it is durable."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    durable = None if is_durable is None else (lambda _, name: is_durable(root / name))
    try:
        deleted = retain(fd, str(root), pattern, keep_last, file_audit(audit_log), durable, key)
    finally:
        os.close(fd)
    return [root / name for name in deleted]


def retain(
    dfd: int,
    label: str,
    pattern: str,
    keep_last: int,
    audit: Audit,
    is_durable: Callable[[int, str], bool] | None = None,
    key: bytes | None = None,
) -> list[str]:
    """Delete the checkpoint directories in the directory ``dfd`` (``label``
    in messages) beyond the newest ``keep_last``; returns their names.

    ``pattern`` is a glob over the names directly in it (``checkpoint-*``,
    ``global_step*``). They are ordered by the numbers in their names, or
    by mtime if a name has none. ``is_durable(dfd, name)`` tells whether a
    directory is fully durable; by default, whether it holds at least one
    file and all its manifests are durable and sealed (with ``key``; see
    manifest.seal_of). Everything is read and deleted through ``dfd``
    without following a symlink: a user's directory swapped for one while
    this runs (as root) leads nowhere.
    """
    if keep_last < 1:
        raise ValueError(f"keep_last must be at least 1, got {keep_last}")
    ordered = _ordered(dfd, _candidates(dfd, pattern))
    if len(ordered) <= keep_last:
        return []
    newest = ordered[-1]
    durable = is_durable or (lambda d, name: _all_durable(d, name, key))
    if not durable(dfd, newest):
        log.info("retention postponed: newest checkpoint %s/%s is not durable yet", label, newest)
        return []
    deleted = []
    reason = f"beyond the last {keep_last} of {pattern!r}; newest {newest} is durable"
    for old in ordered[:-keep_last]:
        where = f"{label}/{old}"
        refusal = _foreign_content(dfd, old, key)
        if refusal is not None:
            log.warning("retention kept %s: %s", where, refusal)
            audit("kept", where, refusal)
            continue
        try:
            # rmtree with dir_fd walks by descriptors and follows no symlink.
            shutil.rmtree(old, dir_fd=dfd)
        except OSError as exc:
            log.error("retention could not delete %s: %s", where, exc)
            audit("failed", where, f"{reason}; delete failed: {exc}")
            continue
        log.info("retention deleted %s (%s)", where, reason)
        audit("deleted", where, reason)
        deleted.append(old)
    return deleted


def _candidates(dfd: int, pattern: str) -> list[str]:
    with os.scandir(dfd) as it:
        return [
            e.name
            for e in it
            if e.is_dir(follow_symlinks=False)
            and e.name != CKPTFS_DIR
            and not is_tmp_name(e.name)
            and fnmatch.fnmatchcase(e.name, pattern)
        ]


def _natural_key(name: str) -> list[str | int]:
    # re.split with a group alternates text and digits, so the types line up.
    return [int(part) if i % 2 else part for i, part in enumerate(re.split(r"(\d+)", name))]


def _ordered(dfd: int, names: list[str]) -> list[str]:
    """Oldest first: by the numbers in the names, or by mtime if any name has none."""
    if all(re.search(r"\d", n) for n in names):
        return sorted(names, key=lambda n: (_natural_key(n), n))
    return sorted(
        names, key=lambda n: (os.stat(n, dir_fd=dfd, follow_symlinks=False).st_mtime_ns, n)
    )


def _walk(dfd: int, name: str) -> list[tuple[int, list[str], list[str]]]:
    """(directory fd, its subdirectories, its other names) for ``name`` and
    everything under it, by descriptors (os.fwalk follows no symlink), the
    fds valid until the next step: so the whole listing is read first."""
    found = []
    for _, dirnames, filenames, fd in os.fwalk(name, dir_fd=dfd, onerror=_raise):
        found.append((os.dup(fd), list(dirnames), list(filenames)))
    return found


def _all_durable(dfd: int, name: str, key: bytes | None) -> bool:
    files = 0
    try:
        walked = _walk(dfd, name)
    except OSError:
        return False
    try:
        for fd, _, filenames in walked:
            for fname in filenames:
                if is_tmp_name(fname):
                    return False  # a manifest is being written right now
                files += 1
                try:
                    manifest = read_manifest(fname, dir_fd=fd, key=key)
                except (ManifestError, OSError):
                    return False
                if manifest is not None and (
                    manifest.state != "durable" or (key is not None and not manifest.sealed)
                ):
                    return False
    finally:
        for fd, _, _ in walked:
            os.close(fd)
    # An empty directory is a save that has only just begun.
    return files > 0


def _foreign_content(dfd: int, name: str, key: bytes | None) -> str | None:
    """Why the directory ``name`` holds something ckptfs did not write, or None."""
    try:
        walked = _walk(dfd, name)
    except OSError as exc:
        # Unknown content is foreign content: never delete what we cannot see.
        return f"cannot inspect {exc.filename or name}: {exc.strerror or exc}"
    try:
        for fd, dirnames, filenames in walked:
            for sub in dirnames:
                if sub == CKPTFS_DIR:
                    return f"{name}: {sub} is not a directory written through ckptfs"
            for fname in filenames:
                why = _not_ours(fd, fname, key)
                if why is not None:
                    return f"{name}: {fname} {why}"
    except OSError as exc:
        return f"cannot inspect {exc.filename or name}: {exc.strerror or exc}"
    finally:
        for fd, _, _ in walked:
            os.close(fd)
    return None


def _raise(exc: OSError) -> None:
    raise exc


def _not_ours(dfd: int, name: str, key: bytes | None) -> str | None:
    """Why ``name`` in ``dfd`` is not a manifest ckptfs wrote, or None."""
    st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
    if stat.S_ISLNK(st.st_mode):
        return "is a symlink, not written through ckptfs"
    if not stat.S_ISREG(st.st_mode):
        return "is not a regular file"
    if is_tmp_name(name):
        # Left by an interrupted manifest write; it need not parse.
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dfd)
        try:
            return None if os.pread(fd, len(MAGIC), 0) == MAGIC else "is a plain file"
        finally:
            os.close(fd)
    try:
        manifest = read_manifest(name, dir_fd=dfd, key=key)
    except ManifestError:
        return None  # starts with the magic line: ckptfs wrote it, even if it is damaged
    if manifest is None:
        return "is a plain file, not written through ckptfs"
    if key is not None and not manifest.sealed:
        return "is a manifest ckptfs did not write (its seal does not verify)"
    return None


def file_audit(audit_log: Path) -> Audit:
    """An audit log at ``audit_log`` (the operator's path)."""

    def audit(action: str, path: str, reason: str) -> None:
        audit_log.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(audit_log, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
        _audit_line(fd, action, path, reason)

    return audit


def fd_audit(dfd: int, name: str) -> Audit:
    """An audit log named ``name`` in the directory ``dfd`` (.ckptfs)."""

    def audit(action: str, path: str, reason: str) -> None:
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
        _audit_line(os.open(name, flags, 0o600, dir_fd=dfd), action, path, reason)

    return audit


def _audit_line(fd: int, action: str, path: str, reason: str) -> None:
    when = datetime.now(UTC).isoformat(timespec="seconds")
    try:
        os.write(fd, f"{when}\t{action}\t{path}\t{reason}\n".encode())
        os.fsync(fd)
    finally:
        os.close(fd)


def retain_beneath(
    root_fd: int,
    rel: str,
    pattern: str,
    keep_last: int,
    audit: Audit,
    key: bytes | None,
) -> list[str]:
    """:func:`retain` in the directory ``rel`` beneath the backing root."""
    dfd = open_dir(root_fd, rel)
    try:
        return retain(dfd, rel or ".", pattern, keep_last, audit, key=key)
    finally:
        os.close(dfd)
