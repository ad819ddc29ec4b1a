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

from .chunkstore import CKPTFS_DIR
from .manifest import MAGIC, ManifestError, is_tmp_name, read_manifest
from .walk import Problem, walk_files

log = logging.getLogger("ckptfs.retention")


def apply_retention(
    root: Path,
    pattern: str,
    keep_last: int,
    audit_log: Path,
    is_durable: Callable[[Path], bool] | None = None,
) -> list[Path]:
    """Delete the checkpoint directories under ``root`` beyond the newest ``keep_last``.

    ``root`` is a directory of the backing store; ``pattern`` a glob over the
    names directly under it (``checkpoint-*``, ``global_step*``). They are
    ordered by the numbers in their names, or by mtime if a name has none.
    ``is_durable`` tells whether a directory is fully durable; by default,
    whether it holds at least one file and all its manifests are durable.
    Returns the deleted directories.
    """
    if keep_last < 1:
        raise ValueError(f"keep_last must be at least 1, got {keep_last}")
    root, audit_log = Path(root), Path(audit_log)
    ordered = _ordered(_candidates(root, pattern))
    if len(ordered) <= keep_last:
        return []
    newest = ordered[-1]
    if not (is_durable or _all_durable)(newest):
        log.info("retention postponed: newest checkpoint %s is not durable yet", newest)
        return []
    deleted = []
    reason = f"beyond the last {keep_last} of {pattern!r}; newest {newest.name} is durable"
    for old in ordered[:-keep_last]:
        refusal = _foreign_content(old)
        if refusal is not None:
            log.warning("retention kept %s: %s", old, refusal)
            _audit(audit_log, "kept", old, refusal)
            continue
        try:
            shutil.rmtree(old)
        except OSError as exc:
            log.error("retention could not delete %s: %s", old, exc)
            _audit(audit_log, "failed", old, f"{reason}; delete failed: {exc}")
            continue
        log.info("retention deleted %s (%s)", old, reason)
        _audit(audit_log, "deleted", old, reason)
        deleted.append(old)
    return deleted


def _candidates(root: Path, pattern: str) -> list[Path]:
    with os.scandir(root) as it:
        return [
            Path(e.path)
            for e in it
            if e.is_dir(follow_symlinks=False)
            and e.name != CKPTFS_DIR
            and not is_tmp_name(e.name)
            and fnmatch.fnmatchcase(e.name, pattern)
        ]


def _natural_key(name: str) -> list[str | int]:
    # re.split with a group alternates text and digits, so the types line up.
    return [int(part) if i % 2 else part for i, part in enumerate(re.split(r"(\d+)", name))]


def _ordered(dirs: list[Path]) -> list[Path]:
    """Oldest first: by the numbers in the names, or by mtime if any name has none."""
    if all(re.search(r"\d", d.name) for d in dirs):
        return sorted(dirs, key=lambda d: (_natural_key(d.name), d.name))
    return sorted(dirs, key=lambda d: (os.lstat(d).st_mtime_ns, d.name))


def _all_durable(directory: Path) -> bool:
    errors: list[Problem] = []
    files = 0
    for path in walk_files(directory, include_tmp=True, errors=errors):
        if is_tmp_name(path.name):
            return False  # a manifest is being written right now
        files += 1
        try:
            manifest = read_manifest(path)
        except (ManifestError, OSError):
            return False
        if manifest is not None and manifest.state != "durable":
            return False
    # An empty directory is a save that has only just begun.
    return files > 0 and not errors


def _foreign_content(directory: Path) -> str | None:
    """Why ``directory`` holds something ckptfs did not write, or None if it does not."""
    try:
        for dirpath, dirnames, filenames in os.walk(directory, onerror=_raise):
            for name in dirnames:
                path = Path(dirpath) / name
                if name == CKPTFS_DIR or stat.S_ISLNK(os.lstat(path).st_mode):
                    return f"{path} is not a directory written through ckptfs"
            for name in filenames:
                path = Path(dirpath) / name
                if not _is_manifest(path):
                    return f"{path} is a plain file, not written through ckptfs"
    except OSError as exc:
        # Unknown content is foreign content: never delete what we cannot see.
        return f"cannot inspect {exc.filename or directory}: {exc.strerror or exc}"
    return None


def _raise(exc: OSError) -> None:
    raise exc


def _is_manifest(path: Path) -> bool:
    if not stat.S_ISREG(os.lstat(path).st_mode):
        return False
    if is_tmp_name(path.name):
        # Left by an interrupted manifest write; it need not parse.
        with open(path, "rb") as f:
            return f.read(len(MAGIC)) == MAGIC
    try:
        return read_manifest(path) is not None
    except ManifestError:
        return True  # starts with the magic line: ckptfs wrote it, even if it is damaged


def _audit(audit_log: Path, action: str, path: Path, reason: str) -> None:
    audit_log.parent.mkdir(parents=True, exist_ok=True)
    when = datetime.now(UTC).isoformat(timespec="seconds")
    line = f"{when}\t{action}\t{path}\t{reason}\n".encode()
    fd = os.open(audit_log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
        os.fsync(fd)
    finally:
        os.close(fd)
