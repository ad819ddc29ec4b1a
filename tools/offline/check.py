"""``ckptfs check``: verify manifests and their chunks in the backing store, offline.

Every manifest must parse; every chunk of a durable manifest must exist and
match its hash. A chunk shared by many files (deduplication) is read once.
A pending manifest is reported with its holders and age: its bytes are only
in the RAM of its holders, so it is healthy only while a daemon of one of
them serves this backing directory. Which daemons run is the caller's
question (the CLI asks the control sockets); this module reads only files.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from ckptfs.fs.store.chunkstore import ChunkCorrupt, ChunkStore
from ckptfs.fs.store.manifest import ManifestError
from ckptfs.tools.offline.walk import Problem, chunk_problem, resolve_under, walk_files


@dataclass(frozen=True)
class PendingFile:
    """A manifest that is not durable yet."""

    path: Path
    size: int
    holders: tuple[str, ...]
    age: float  # seconds since the manifest was last written
    covered: bool  # its chunk list accounts for every byte (an empty file)
    file_id: str
    version: str


@dataclass
class CheckResult:
    manifests: int = 0  # manifests found (durable or pending)
    plain: int = 0  # plain files, served read-through and not checked
    chunks: int = 0  # distinct chunks checked
    bytes: int = 0  # bytes of the distinct chunks checked
    pending: list[PendingFile] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def damaged_files(self) -> list[Path]:
        return sorted({p.path for p in self.problems})


def check(backing: Path, path: Path | None = None, *, verify_data: bool = True) -> CheckResult:
    """Check the manifests under ``path`` (default: the whole backing directory).

    With ``verify_data`` false only the chunks' presence and sizes are checked,
    which reads no chunk data (quick on a large store).
    """
    backing = Path(backing)
    top = resolve_under(backing, path)
    store = ChunkStore(backing, create=False)
    seal = _key(store)
    result = CheckResult()
    verdicts: dict[tuple[str, int], str | None] = {}  # (hash, length) -> problem or None
    for found in walk_files(top, errors=result.problems):
        file = found.path
        try:
            manifest = found.read_manifest(seal)
        except FileNotFoundError:
            continue  # removed meanwhile
        except (ManifestError, OSError) as exc:
            result.problems.append(Problem(file, f"unreadable manifest ({exc})"))
            continue
        if manifest is None:
            result.plain += 1
            continue
        if seal is not None and not manifest.sealed:
            # Served as a plain file through the mount: never acted on.
            result.problems.append(
                Problem(
                    file,
                    "a manifest ckptfs did not write, or one changed outside it (its seal "
                    "does not verify): served as the plain file it is; remove it if it is "
                    "not wanted",
                )
            )
            continue
        result.manifests += 1
        if manifest.state != "durable":
            try:
                age = max(0.0, time.time() - found.stat().st_mtime)
            except OSError:
                age = 0.0
            result.pending.append(
                PendingFile(
                    file,
                    manifest.size,
                    tuple(manifest.holders),
                    age,
                    manifest.covered(),
                    manifest.file_id,
                    manifest.version,
                )
            )
            continue
        for chunk in manifest.chunks:
            key = (chunk.hash, chunk.length)
            if key not in verdicts:
                verdicts[key] = _check_chunk(store, chunk.hash, chunk.length, verify_data)
                result.chunks += 1
                result.bytes += chunk.length
            if verdicts[key] is not None:
                result.problems.append(Problem(file, verdicts[key], chunk=chunk.hash))
    return result


def _key(store: ChunkStore) -> bytes | None:
    """The store's manifest key; None for a tree without one (no daemon
    ever mounted it: nothing is sealed, nothing is checked for it)."""
    try:
        return store.dirs.manifest_key()
    except FileNotFoundError:
        return None


def _check_chunk(store: ChunkStore, digest: str, length: int, verify_data: bool) -> str | None:
    if verify_data:
        try:
            store.get(digest, length)
        except ChunkCorrupt as exc:
            return chunk_problem(exc, digest)
        except OSError as exc:
            return f"cannot read {store.path_for(digest)}: {exc.strerror or exc}"
        return None
    try:
        size = store.size_of(digest)
    except FileNotFoundError:
        return f"is missing from {store.path_for(digest)}"
    except OSError as exc:
        return f"cannot stat {store.path_for(digest)}: {exc.strerror or exc}"
    return None if size == length else f"has {size} bytes, expected {length}"
