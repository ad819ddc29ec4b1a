"""``ckptfs gc``: remove chunks that no manifest references, offline.

Safety comes before freed space; a chunk is removed only when all hold:

- no manifest in the backing tree names it (every state, and temporary
  manifests that are about to be renamed into place);
- every manifest could be read: an unreadable one might name any chunk, so
  then nothing is removed at all;
- its mtime is older than the grace period, and older than the grace period
  before the oldest pending manifest was written: a file whose flush is still
  running has stored chunks that its (not yet durable) manifest does not name;
- it was not touched while being removed: the chunk is first renamed aside,
  then its mtime checked again, and put back if a writer refreshed it.

The last point makes deduplication safe when writers refresh the mtime of a
chunk they reuse instead of writing it (see docs/FORMAT.md).
"""

from __future__ import annotations

import os
import re
import secrets
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from ckptfs.fs.store.chunkstore import ChunkStore
from ckptfs.fs.store.manifest import ManifestError, is_tmp_name
from ckptfs.tools.offline.walk import Problem, walk_files

_CHUNK_NAME = re.compile(r"[0-9a-f]{32}")
# ChunkStore.put's temporary names, and ours for a chunk being removed.
_TEMP_NAME = re.compile(r"[0-9a-f]{32}\.(tmp|gc)\..+")


@dataclass
class GcResult:
    dry_run: bool
    manifests: int = 0
    referenced: int = 0  # distinct chunks named by manifests
    chunks: int = 0  # chunk files in the store
    removed: list[Path] = field(default_factory=list)  # (or would be, in a dry run)
    freed_bytes: int = 0
    kept_young: int = 0  # unreferenced, but within the grace period
    cutoff: float = 0.0  # files with an older mtime were eligible
    pending: list[Path] = field(default_factory=list)  # pending manifests seen
    refused: str | None = None  # why nothing was removed
    problems: list[Problem] = field(default_factory=list)


def collect_garbage(
    backing: Path,
    grace_seconds: float = 3600,
    dry_run: bool = False,
    progress: Callable[[str], None] | None = None,
) -> GcResult:
    """Remove unreferenced chunks and stale temporary files older than the
    grace period. ``progress`` is told ``"manifest"`` for each manifest read
    and ``"chunk"`` for each file of the chunk store looked at."""
    tick = progress or (lambda what: None)
    if grace_seconds < 0:
        raise ValueError(f"grace_seconds must not be negative, got {grace_seconds}")
    backing = Path(backing)
    store = ChunkStore(backing, create=False)
    if not store.root.is_dir():
        raise FileNotFoundError(f"{backing} has no chunk store ({store.root} is missing)")
    # Only a store no user may change is walked and pruned by path (a
    # .ckptfs a user made a symlink would lead the removals elsewhere).
    store.fd  # noqa: B018 (NotPrivate, naming it, if it is not)
    result = GcResult(dry_run=dry_run, cutoff=time.time() - grace_seconds)
    referenced = _referenced_chunks(backing, grace_seconds, result, tick)
    result.referenced = len(referenced)
    if result.problems:
        result.refused = (
            f"{len(result.problems)} manifest(s) or directories could not be read and may "
            f"reference chunks; first: {result.problems[0]}"
        )
        return result
    for path, name, st in _store_files(store):
        tick("chunk")
        if _CHUNK_NAME.fullmatch(name):
            result.chunks += 1
            if name in referenced:
                continue
        elif not _TEMP_NAME.fullmatch(name):
            continue  # not ours: leave it alone
        if st.st_mtime >= result.cutoff:
            result.kept_young += 1
            continue
        if dry_run or _remove(path, result.cutoff):
            result.removed.append(path)
            result.freed_bytes += st.st_size
        else:
            result.kept_young += 1
    return result


def _referenced_chunks(
    backing: Path, grace_seconds: float, result: GcResult, tick: Callable[[str], None]
) -> set[str]:
    referenced: set[str] = set()
    for found in walk_files(backing, include_tmp=True, errors=result.problems):
        tick("manifest")
        path = found.path
        tmp = is_tmp_name(path.name)
        try:
            st = found.stat()
            # Every manifest counts, sealed or not: keeping a chunk one names
            # costs space; removing one a real file needs loses it.
            manifest = found.read_manifest()
        except FileNotFoundError:
            continue  # renamed or removed meanwhile; its new name is walked or gone
        except (ManifestError, OSError) as exc:
            # A temporary manifest may be half written: its complete version
            # names chunks stored just now, which the grace period protects.
            if not tmp:
                result.problems.append(Problem(path, f"unreadable manifest ({exc})"))
            continue
        if manifest is None:
            continue
        result.manifests += 1
        referenced.update(c.hash for c in manifest.chunks)
        if manifest.state != "durable":
            result.pending.append(path)
            # Its flush started after it was written (and after the file's
            # last modification): protect every chunk stored since then.
            written = min(st.st_mtime, manifest.mtime_ns / 1e9)
            result.cutoff = min(result.cutoff, written - grace_seconds)
    return referenced


def _store_files(store: ChunkStore) -> Iterator[tuple[Path, str, os.stat_result]]:
    """Files two levels down in the store (``ab/cd/<name>``), with their lstat."""
    for level1 in _subdirs(store.root):
        for level2 in _subdirs(level1):
            with os.scandir(level2) as it:
                for entry in it:
                    try:
                        if entry.is_file(follow_symlinks=False):
                            yield Path(entry.path), entry.name, entry.stat(follow_symlinks=False)
                    except FileNotFoundError:
                        continue


def _subdirs(path: Path) -> list[Path]:
    with os.scandir(path) as it:
        return sorted(Path(e.path) for e in it if e.is_dir(follow_symlinks=False))


def _remove(path: Path, cutoff: float) -> bool:
    """Remove ``path`` unless a writer refreshed its mtime meanwhile; True if removed."""
    aside = path.with_name(f"{path.name[:32]}.gc.{secrets.token_hex(4)}")
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return False  # removed by someone else
    # A writer that reused the chunk just before the rename has refreshed its
    # mtime; one that comes after the rename finds it missing and stores it anew.
    if os.lstat(aside).st_mtime >= cutoff:
        os.rename(aside, path)  # identical bytes even if it was stored again meanwhile
        return False
    os.unlink(aside)
    return True
