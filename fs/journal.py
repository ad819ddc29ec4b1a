"""The cache journal: which arena slots hold which published file, on tmpfs.

Written when a file is published (closed) and removed when it becomes
durable or is written again, so that after a daemon crash the new daemon can
adopt the closed-but-not-durable files from the arena and finish flushing
them. A record is only trusted if the manifest at its path still names the
same file id and version.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from .cachedfile import CachedFile
from .manifest import Chunk

log = logging.getLogger("ckptfs.journal")


class Journal:
    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.dir.mkdir(parents=True, exist_ok=True)

    def _path(self, file_id: str) -> Path:
        return self.dir / f"{file_id}.json"

    @staticmethod
    def record(f: CachedFile) -> dict[str, Any]:
        """A snapshot of ``f``'s slots, taken on the event loop (nothing moves then)."""
        return {
            "file_id": f.file_id,
            "version": f.version,
            "path": f.path,
            "size": f.size,
            "mode": f.mode,
            "mtime_ns": f.mtime_ns,
            "pages": list(f.pages),
            "fill": list(f.fill),
            "base": [[c.offset, c.length, c.hash] for c in f.base],
            "base_end": f.base_end,
            "spilled": {str(p): [c.offset, c.length, c.hash] for p, c in f.spilled.items()},
        }

    def write(self, record: dict[str, Any]) -> None:
        tmp = self._path(record["file_id"]).with_suffix(".tmp")
        tmp.write_text(json.dumps(record))
        os.replace(tmp, self._path(record["file_id"]))

    def remove(self, f: CachedFile) -> None:
        self._path(f.file_id).unlink(missing_ok=True)

    def load(self) -> list[dict[str, Any]]:
        records = []
        for path in sorted(self.dir.glob("*.json")):
            try:
                records.append(json.loads(path.read_text()))
            except (OSError, ValueError) as exc:
                log.error("cache journal %s is unreadable (%s); ignoring it", path, exc)
        return records

    def restore(self, record: dict[str, Any], f: CachedFile) -> None:
        f.pages = list(record["pages"])
        f.fill = list(record["fill"])
        f.page_gen = [0] * len(f.pages)
        f.dirty_pages = {p for p, s in enumerate(f.pages) if s >= 0}
        f.set_base([Chunk(*c) for c in record["base"]], record["base_end"])
        f.spilled = {int(p): Chunk(*c) for p, c in record["spilled"].items()}
