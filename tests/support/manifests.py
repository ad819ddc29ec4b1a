"""Manifests written into a backing directory as another node's daemon of
that store would write them (sealed with the store's key)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ckptfs.fs.store.manifest import MAGIC, Manifest, read_manifest, write_manifest
from ckptfs.fs.store.storedirs import CKPTFS_DIR, StoreDirs


def store_key(path: Path, backing: Path | None = None) -> bytes:
    """The manifest key of the backing directory ``backing`` (made if it has
    none), or of the first at or above ``path`` with a .ckptfs: what a
    daemon of that store seals its manifests with."""
    if backing is None:
        backing = next((r for r in (path, *path.parents) if (r / CKPTFS_DIR).is_dir()), None)
    if backing is None:
        raise AssertionError(f"no backing directory (with .ckptfs) at or above {path}")
    dirs = StoreDirs(backing)
    try:
        return dirs.manifest_key()
    finally:
        dirs.close()


def write_store_manifest(
    path: Path, manifest: Any, backing: Path | None = None, **kwargs: Any
) -> None:
    """A manifest written into a backing directory as a ckptfs daemon of that
    store would (sealed): for tests that stand for another node."""
    write_manifest(path, manifest, key=store_key(path.parent, backing), **kwargs)


def manifest_body(path: Path) -> dict[str, Any]:
    """The JSON of the manifest file at ``path``: its last record, the one
    in force (docs/FORMAT.md: a flush appends its durable record)."""
    magic, records = path.read_bytes().split(b"\n", 1)
    assert magic + b"\n" == MAGIC, path
    return json.loads(records.splitlines()[-1])


def manifest_now(path: Path) -> Manifest | None:
    """The manifest at ``path`` as a poll sees it: None while nothing is
    there. A takeover's fenced publish moves the name aside for an instant
    (docs/STATES.md, Takeover and fencing), so a poll may find it missing."""
    try:
        return read_manifest(path)
    except FileNotFoundError:
        return None


def durable_now(path: Path, holders: list[str] | None = None) -> bool:
    """Whether ``path`` holds a durable manifest now (named ``holders``, if given)."""
    m = manifest_now(path)
    return m is not None and m.state == "durable" and (holders is None or m.holders == holders)
