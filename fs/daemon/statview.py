"""What ``ckptfs stat`` tells each caller about files.

Root sees every file. Any other caller (the mount's owner included) sees by
name only files it owns (``CachedFile.uid``, a history record's owner): a
file of another user may lie in a directory the caller cannot list, and
stat must not tell what the mount would not. Those files are counted, not
named, in ``not_shown`` (their path, file id, version and holders are left
out). The counts cover the whole mount whatever PATH was asked, so that a
guessed name given as PATH cannot be confirmed by a count. Whatever names a
file is filtered: the file lists, the files being flushed, the history,
mirrors held here and the paths whose mirroring fell back; the message of
the store's last error (it names the file whose write failed) is reduced to
its errno's text. The remaining counters (cache, peer reads, representative
fetches, ``progress``) are numbers only, over the whole mount.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

from ckptfs.fs.content.cachedfile import CachedFile
from ckptfs.fs.content.state import FileRole, FileState, stat_state
from ckptfs.fs.namespace.posix import in_subtree
from ckptfs.fs.store.history import Recent

T = TypeVar("T")

# The per-file states (stat_state) that ``progress`` sums: this node's files
# not yet durable, and the durable files in its cache.
PROGRESS_STATES = ("dirty", "mirrored", "flushing", "durable")

# The sections of the reply that name files; ``not_shown`` has a count for each.
SECTIONS = (
    "files",
    "taken_over",
    "lost",
    "flushing",
    "history",
    "mirrored_files",
    "fallback_paths",
)


@dataclass(frozen=True)
class Viewer:
    uid: int

    @property
    def sees_all(self) -> bool:
        return self.uid == 0

    def sees(self, owner: int) -> bool:
        return self.sees_all or owner == self.uid


class StatView:
    """Builds the file-naming parts of one stat reply for ``viewer``; counts
    what it leaves out in ``not_shown``."""

    def __init__(self, viewer: Viewer) -> None:
        self.viewer = viewer
        self.not_shown = dict.fromkeys(SECTIONS, 0)

    def _split(self, section: str, items: Iterable[T], owner: Callable[[T], int]) -> list[T]:
        """The items the viewer sees; the others counted in ``section``."""
        shown = []
        for item in items:
            if self.viewer.sees(owner(item)):
                shown.append(item)
            else:
                self.not_shown[section] += 1
        return shown

    def _mine(self, files: Iterable[CachedFile], prefix: str) -> list[CachedFile]:
        return [f for f in files if self.viewer.sees(f.uid) and in_subtree(f.path, prefix)]

    def files(
        self, linked: list[CachedFile], taken: list[CachedFile], prefix: str
    ) -> dict[str, list[dict[str, Any]]]:
        """``files``, ``taken_over`` and ``lost`` under ``prefix``, from every
        linked file of the mount and every file taken over from a dead buddy."""
        lost = [f for f in linked if f.state is FileState.LOST]
        # Others' files are counted in the whole mount: a count that depended
        # on PATH would confirm a guessed name.
        every_taken = {f.file_id for f in taken}
        self._split("files", (f for f in linked if not _shadowed(f, every_taken)), _uid)
        self._split("taken_over", taken, _uid)
        self._split("lost", lost, _uid)
        # A file taken over is listed once, as such, not also as the remote
        # file this node's mount sees at its path.
        taken_here = {f.file_id for f in taken if in_subtree(f.path, prefix)}
        return {
            "files": [
                f.describe()
                for f in sorted(self._mine(linked, prefix), key=_path)
                if not _shadowed(f, taken_here)
            ],
            "taken_over": [{**f.describe(), "origin": f.origin} for f in self._mine(taken, prefix)],
            "lost": [
                {"path": f.path, "reason": f.lost_reason}
                for f in sorted(self._mine(lost, prefix), key=_path)
            ],
        }

    def flush(self, stats: dict[str, Any], active: Iterable[CachedFile]) -> dict[str, Any]:
        """The flusher's stats with ``active`` naming only the viewer's files."""
        shown = self._split("flushing", active, _uid)
        return {**stats, "active": sorted(f.path for f in shown)}

    def backing_error(self, trouble: dict[str, Any] | None) -> dict[str, Any] | None:
        """The store's last error (BackingIO.describe_trouble); its message
        names the file that failed, so others see the errno's text only."""
        if trouble is None or self.viewer.sees_all:
            return trouble
        number = getattr(errno, str(trouble.get("errno")), None)
        text = os.strerror(number) if isinstance(number, int) else "error"
        return {**trouble, "error": text}

    def history(self, recent: Iterable[Recent]) -> list[dict[str, Any]]:
        return [r.record for r in self._split("history", recent, lambda r: r.uid)]

    def mirroring(
        self, stats: dict[str, Any], mirrors: Iterable[CachedFile], own_paths: set[str]
    ) -> dict[str, Any]:
        """The peer's mirroring stats (peer/node.py ``mirror_stats``) with the
        mirrors held here and the writer's fallback paths filtered."""
        if not stats:
            return stats
        pending = [f for f in mirrors if f.state is FileState.PENDING]
        shown = self._split("mirrored_files", pending, _uid)
        out = dict(stats)
        if not self.viewer.sees_all:
            # As peer/mirror/server.py lists them: origin node, then path (or id).
            out["mirrored_files"] = sorted(f"{f.origin}:{f.path or f.file_id}" for f in shown)[:50]
        writer = stats.get("writer")
        if writer:
            # Paths only: shown if a file of the viewer's is at that path now.
            paths = writer.get("fallback_paths", [])
            kept = [p for p in paths if self.viewer.sees_all or p in own_paths]
            self.not_shown["fallback_paths"] += len(paths) - len(kept)
            out["writer"] = {**writer, "fallback_paths": kept}
        return out


def progress(files: Iterable[CachedFile], rate: float) -> dict[str, Any]:
    """Files and bytes by state (PROGRESS_STATES), and how long until the
    bytes not yet durable are, at ``rate`` (bytes/s of files flushed,
    measured): None when nothing was flushed lately, as no time can be told.
    Over whole files of the whole mount, whoever asks and whatever PATH (a
    count that depended on PATH would confirm a guessed name); files
    written elsewhere (remote) are left out, as lost and unlinked ones are."""
    out: dict[str, Any] = {state: {"files": 0, "bytes": 0} for state in PROGRESS_STATES}
    out["flushing"]["flushed"] = 0
    for f in files:
        state = stat_state(f.state, f.flushing is not None, f.mirror, f.role)
        if state not in out:
            continue
        out[state]["files"] += 1
        out[state]["bytes"] += f.size
        if state == "flushing":
            out[state]["flushed"] += min(f.flushed_bytes, f.size)
    flushing = out["flushing"]
    to_store = (
        out["dirty"]["bytes"] + out["mirrored"]["bytes"] + flushing["bytes"] - flushing["flushed"]
    )
    out["to_store"] = to_store
    out["rate"] = rate
    out["eta_seconds"] = 0.0 if not to_store else round(to_store / rate, 1) if rate else None
    return out


def daemon_health(terminating: bool, flush_failing: int) -> str:
    """``ok``, or what an operator must know of the daemon itself: it is
    unmounting, or its flushes fail (the log says why)."""
    if terminating:
        return "unmounting"
    if flush_failing:
        return "flush failing"
    return "ok"


def _uid(f: CachedFile) -> int:
    return f.uid


def _path(f: CachedFile) -> str:
    return f.path


def _shadowed(f: CachedFile, taken_ids: set[str]) -> bool:
    return f.role is FileRole.REMOTE and f.file_id in taken_ids
