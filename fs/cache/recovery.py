"""Adopting the pending files a crashed daemon left in the arena.

The journal (journal.py) lists, for each version this node published but had
not made durable, which arena slots hold its bytes. A record is adopted only
if the manifest at its path (or, for a record a rename rewrote just before
renaming, at the path it had: ``renamed_from``) still names its file id and
version as pending (or the path renames recorded by other nodes moved it
to, renamelog.py): then nothing changed those slots (a change drops the
record first), and the file is queued for flushing as if it had just been
closed. A record whose manifest says otherwise is stale (the version became
durable, was replaced or removed) and is deleted.

A record the store cannot answer for (EIO, a hung NFS server: the manifest
or a rename record unreadable) is neither: deleting it would lose a closed
file whose only copy is in this arena. It is kept, with its slots, as
*unconfirmed* (unconfirmed.py); the mount comes up all the same, and
``confirm_later`` asks the store again with a growing pause (or at once, for
a ``flush --wait``) until each is adopted or found stale. A lookup that
reads the manifest meanwhile adopts it at once (``Cache.load``). Manifests
are read through the backing-store runner, so a hung store delays the
mount by the backing timeout, not forever.
"""

from __future__ import annotations

import errno
import logging
import random
from typing import Any

from ckptfs.fs.cache.cache import Cache
from ckptfs.fs.cache.journal import Key
from ckptfs.fs.cache.unconfirmed import slots_of
from ckptfs.fs.content.state import FileRole
from ckptfs.fs.store.backing import Backing
from ckptfs.fs.store.blocking import BackingTimeout
from ckptfs.fs.store.manifest import Manifest

log = logging.getLogger("ckptfs.recovery")
# Errors that say the store did not answer, not what is at a path: the
# record is kept to be checked again. Anything else at a path (nothing, a
# directory, a symlink, a file that is no valid manifest; a user can put
# those there) decides that the record's version is not there.
# (Not EAGAIN: a user's lease on their own manifest gives that, for as long
# as they like.)
STORE_FAILING = frozenset(
    {
        errno.EIO, errno.ETIMEDOUT, errno.ESTALE, errno.ENOTCONN, errno.EHOSTDOWN,
        errno.EHOSTUNREACH, errno.ENETUNREACH, errno.ENETDOWN, errno.ECONNRESET,
        errno.ECONNREFUSED, errno.ECONNABORTED, errno.ENOLINK, errno.EREMOTEIO, errno.EINTR,
        errno.ENOMEM, errno.ENFILE, errno.EMFILE, errno.ENOLCK,
    }
)  # fmt: skip
# Pauses between looks at the unconfirmed records: from the first to the last.
CONFIRM_PAUSES = (2.0, 60.0)


class Undecided(Exception):
    """The store did not answer for a record (its cause in ``args[0]``)."""


def _store_failing(exc: OSError) -> bool:
    return isinstance(exc, BackingTimeout) or exc.errno in STORE_FAILING


async def _pending_at(backing: Backing, path: str, key: Key) -> Manifest | None:
    """The manifest at ``path`` if it names version ``key`` as pending."""
    try:
        manifest = await backing.manifest(path)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        if isinstance(exc, OSError) and _store_failing(exc):
            raise Undecided(f"cannot read the manifest of {path}: {exc}") from None
        log.error("cannot read the manifest of %s to recover it: %s", path, exc)
        return None
    if manifest is None or (manifest.file_id, manifest.version) != key:
        return None
    return manifest if manifest.state == "pending" else None


async def locate(backing: Backing, record: dict[str, Any]) -> tuple[Manifest | None, str]:
    """The pending manifest of ``record``'s version (None if there is none)
    and its path: the record's, the one before a rename the crash cut short,
    or where other nodes' renames moved it. Raises Undecided if the store
    did not answer."""
    key = (record.get("file_id", "?"), record.get("version", "?"))
    path = record.get("path", "?")
    tried = [path]
    manifest = await _pending_at(backing, path, key)
    if manifest is None and isinstance(record.get("renamed_from"), str):
        # The daemon died between rewriting the record and the rename.
        tried.append(record["renamed_from"])
        path = record["renamed_from"]
        manifest = await _pending_at(backing, path, key)
    if manifest is not None:
        return manifest, path
    for start in tried:
        # Renamed by another node (meanwhile, or while this one was down).
        try:
            moved = await backing.renamed_to(start, key[0])
        except OSError as exc:
            if _store_failing(exc):
                raise Undecided(f"cannot follow the renames of {start}: {exc}") from None
            log.error("cannot follow the renames of %s to recover it: %s", start, exc)
            moved = None
        if moved is not None:
            manifest = await _pending_at(backing, moved, key)
            if manifest is not None:
                return manifest, moved
    for start in tried:
        # Left aside by a takeover that failed or died (publish._link_over).
        try:
            restored = await backing.restore_aside(start, key[0])
        except OSError as exc:
            if _store_failing(exc) or exc.errno == errno.EBUSY:  # EBUSY: a takeover holds it
                raise Undecided(f"cannot look for the manifest of {start}: {exc}") from None
            restored = False
        if restored:
            manifest = await _pending_at(backing, start, key)
            if manifest is not None:
                return manifest, start
    return None, path


def _own(manifest: Manifest, node: str) -> bool:
    # Only a file this node wrote has its bytes here: adopting another
    # node's (a record of a rename of it) would flush zeros for it.
    return not manifest.holders or manifest.holders[0] == node


async def recover(cache: Cache, backing: Backing) -> int:
    """Adopt what can be adopted, keep what the store cannot answer for as
    unconfirmed; returns the number of files recovered.

    Two passes: every record's manifest is looked at first, then the
    adopted claim their slots, in order, and only then the kept ones, and
    only slots no adopted record holds. A record may list a slot that a
    newer record reuses (a durable or replaced version's record is dropped
    lazily): the record the store confirms owns it, whatever the order."""
    journal, arena = cache.journal, cache.arena
    records = await journal.run_sync(journal.load)
    found: list[tuple[dict[str, Any], Manifest | None, Undecided | None]] = []
    for record in records:
        key = (record.get("file_id", "?"), record.get("version", "?"))
        if max(slots_of(record), default=-1) >= arena.nslots:
            await journal.run_sync(journal.remove_now, key)
            continue
        try:
            manifest, record["path"] = await locate(backing, record)
        except Undecided as why:
            found.append((record, None, why))
            continue
        if manifest is not None and not _own(manifest, cache.node):
            log.warning("not recovering %s: written by %s, not this node", record["path"],
                        manifest.holders[0])  # fmt: skip
            manifest = None
        found.append((record, manifest, None))
    claimed: set[int] = set()
    adopted: set[Key] = set()
    for record, manifest, undecided in found:
        slots = slots_of(record)
        if manifest is None or undecided is not None or slots & claimed:
            continue
        claimed |= slots
        f = cache.adopt(record, manifest.holders)
        cache.on_pending(f)
        adopted.add((f.file_id, f.version))
        log.info("recovered %s (%d bytes) from the cache; flushing it", f.path, f.size)
    adopted_slots = set(claimed)
    for record, _, undecided in found:
        key = (record["file_id"], record["version"])
        if key in adopted:
            continue
        if undecided is not None and not slots_of(record) & adopted_slots:
            log.error(
                "%s (%d bytes) is kept in the cache unconfirmed, to be checked again: %s",
                record.get("path"), record.get("size", 0), undecided,
            )  # fmt: skip
            claimed |= slots_of(record)
            cache.unconfirmed.add(key, record)
        else:
            await journal.run_sync(journal.remove_now, key)
    arena.claim(claimed)
    return len(adopted)


async def confirm_later(cache: Cache, backing: Backing) -> None:
    """Ask the store about the unconfirmed records until none is left
    (adopted, here or at an open, or found stale). Runs for the mount."""
    pause = CONFIRM_PAUSES[0]
    while cache.unconfirmed.busy():
        await cache.unconfirmed.pause(pause)
        pause = min(pause * 2, CONFIRM_PAUSES[1])
        kept = cache.unconfirmed.items()
        random.shuffle(kept)  # one that hangs does not hold the others back each time
        try:
            await cache.release_let_go()
            for key, record in kept:
                await _confirm_one(cache, backing, key, record)
        except Exception:  # the mount goes on; what is left is asked about again
            log.exception("checking the files kept from before a crash failed")


async def _confirm_one(cache: Cache, backing: Backing, key: Key, record: dict[str, Any]) -> None:
    # Under the record's journal lock, which a rename here holds from before
    # its store call until the kept record names where it went: a look that
    # read the old path as the rename landed would let a live file go.
    async with cache.journal.locked(key):
        if cache.unconfirmed.get(key) is not record:
            return  # adopted at an open, or renamed here, meanwhile
        try:
            manifest, path = await locate(backing, record)
        except Undecided as why:
            log.warning("%s still unconfirmed: %s", record.get("path"), why)
            return
        # Decided after an await: an open may have adopted it meanwhile.
        if cache.unconfirmed.get(key) is not record:
            return
        current = cache.files.get(key[0])
        if manifest is not None and current is not None and current.role is not FileRole.REMOTE:
            # Opened and changed here since (at a name another node's rename
            # gave it): what is written here now is newer.
            await cache.discard_unconfirmed(key, "a newer version of it is written here", held=True)
        elif manifest is not None and _own(manifest, cache.node):
            f = cache.confirm(key, manifest, path)
            log.info("recovered %s (%d bytes) once the store answered; flushing it",
                     f.path, f.size)  # fmt: skip
        elif manifest is not None:
            why = f"written by {manifest.holders[0]}, not this node"
            await cache.discard_unconfirmed(key, why, held=True)
        else:
            why = "the store no longer names that version pending"
            await cache.discard_unconfirmed(key, why, held=True)
