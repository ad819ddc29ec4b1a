"""Adopting the pending files a crashed daemon left in the arena.

The journal (journal.py) lists, for each version this node published but had
not made durable, which arena slots hold its bytes. A record is adopted only
if the manifest at its path (or, for a record a rename rewrote just before
renaming, at the path it had: ``renamed_from``) still names its file id and
version as pending (or the path renames recorded by other nodes moved it
to, renamelog.py): then nothing changed those slots (a change drops the record first), and the
file is queued for flushing as if it had just been closed. Every other record
is stale (the version became durable, was replaced or removed) and is deleted.
Manifests are read through the backing-store runner, so a hung NFS server
delays the mount by the backing timeout, not forever.
"""

from __future__ import annotations

import logging
from typing import Any

from ckptfs.fs.cache.cache import Cache
from ckptfs.fs.cache.journal import Journal
from ckptfs.fs.content.arena import Arena
from ckptfs.fs.store.backing import Backing
from ckptfs.fs.store.manifest import Manifest

log = logging.getLogger("ckptfs.recovery")


def _slots(record: dict[str, Any]) -> set[int]:
    return {int(entry[0]) for entry in record["dirty"].values()}


async def _pending_at(backing: Backing, path: str, key: tuple[str, str]) -> Manifest | None:
    """The manifest at ``path`` if it names version ``key`` as pending."""
    try:
        manifest = await backing.manifest(path)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        log.error("cannot read the manifest of %s to recover it: %s", path, exc)
        return None
    if manifest is None or (manifest.file_id, manifest.version) != key:
        return None
    return manifest if manifest.state == "pending" else None


def _own(manifest: Manifest, node: str) -> bool:
    # A daemon from before 2bee09f journaled other nodes' files it renamed:
    # adopting one (no bytes here) would flush zeros for it.
    return not manifest.holders or manifest.holders[0] == node


async def recover(cache: Cache, journal: Journal, backing: Backing, arena: Arena) -> int:
    """Adopt what can be adopted; returns the number of files recovered."""
    records = await journal.run_sync(journal.load)
    claimed: set[int] = set()
    adopted = 0
    for record in records:
        key = (record.get("file_id", "?"), record.get("version", "?"))
        path = record.get("path", "?")
        tried = [path]
        manifest = await _pending_at(backing, path, key)
        if manifest is None and isinstance(record.get("renamed_from"), str):
            # The daemon died between rewriting the record and the rename.
            tried.append(record["renamed_from"])
            path = record["path"] = record["renamed_from"]
            manifest = await _pending_at(backing, path, key)
        for start in tried if manifest is None else []:
            # Renamed by another node (meanwhile, or while this one was down).
            try:
                moved = await backing.renamed_to(start, key[0])
            except OSError as exc:
                log.error("cannot follow the renames of %s to recover it: %s", start, exc)
                moved = None
            if moved is not None:
                manifest = await _pending_at(backing, moved, key)
                if manifest is not None:
                    path = record["path"] = moved
                    break
        slots = _slots(record)
        if manifest is not None and not _own(manifest, cache.node):
            log.warning("not recovering %s: written by %s, not this node", path,
                        manifest.holders[0])  # fmt: skip
            manifest = None
        if manifest is None or slots & claimed or max(slots, default=-1) >= arena.nslots:
            await journal.run_sync(journal.remove_now, key)
            continue
        claimed |= slots
        f = cache.adopt(record, manifest.holders)
        cache.on_pending(f)
        adopted += 1
        log.info("recovered %s (%d bytes) from the cache; flushing it", path, f.size)
    arena.claim(claimed)
    return adopted
