"""The named states of a cached file and of its pages.

Every transition between them is made by :class:`ckptfs.fs.cache.Cache`; other
modules read these states but never assign them. docs/STATES.md describes the
transitions, the awaits they cross and what a crash leaves behind in each.
"""

from __future__ import annotations

from enum import Enum


class FileState(Enum):
    """Where a file's content stands relative to what the backing store names."""

    # Changed here since it was last published (or never published). Only a
    # commit (close, fsync, umount) moves it on; something always holds it open
    # or is committing it, so it never waits forever.
    MODIFIED = "modified"
    # A commit took a snapshot and is writing the journal record and the pending
    # manifest. A write now sends it back to MODIFIED.
    PUBLISHING = "publishing"
    # The pending manifest names exactly this content, which is in RAM (and
    # spilled chunks) and in the crash journal; the flusher owes it.
    PENDING = "pending"
    # The durable manifest names exactly this content; RAM pages are clean copies.
    DURABLE = "durable"
    # The published version's bytes are gone (no holder has them): reads fail
    # with EIO until a full rewrite (truncation to 0) replaces it.
    LOST = "lost"
    # No name refers to this content any more (unlinked, renamed over, replaced
    # by a newer version, or its name vanished from the backing store). Open
    # handles keep reading it; nothing publishes or flushes it; its slots are
    # released when the last handle closes.
    UNLINKED = "unlinked"


class FileRole(Enum):
    """Who is responsible for this content reaching the backing store."""

    LOCAL = "local"  # written on this node: this node flushes it
    MIRROR = "mirror"  # a buddy's file mirrored here: flushed here only on takeover
    # A mirrored file whose writer died: this node flushes it, and publishes
    # only over the very version it mirrored (fenced, see docs/STATES.md).
    TAKEOVER = "takeover"
    REMOTE = "remote"  # written elsewhere: this node only reads it
    # A mirror whose writer let go of it (that version became durable, or was
    # replaced or removed there) while handles here read that version: kept
    # for them (and served to peers), never flushed, dropped with the last.
    KEPT = "kept"


class MirrorState(Enum):
    """Whether a LOCAL file's buddy holds its bytes (durability ``buddy``)."""

    NONE = "none"  # no buddy is involved (durability local/backing, or no peers)
    STREAMING = "streaming"  # pages are being sent; not every generation is acknowledged
    ACKED = "acked"  # the buddy acknowledged every page generation of the snapshot
    FALLBACK = "fallback"  # the buddy failed; this file fell back to local durability


class PageState(Enum):
    """One page (one arena slot's worth of the file) in the page table."""

    CLEAN = "clean"  # in RAM, equal to what the base chunks (or zeros) hold
    DIRTY = "dirty"  # in RAM and newer than anything stored
    SPILLED = "spilled"  # not in RAM: written early to a chunk under memory pressure


def stat_state(
    state: FileState, flushing: bool, mirror: MirrorState, role: FileRole = FileRole.LOCAL
) -> str:
    """The per-file state `ckptfs stat` shows (DESIGN.md's vocabulary)."""
    if state is FileState.DURABLE:
        return "durable"
    if state is FileState.PENDING and role is FileRole.REMOTE:
        return "remote"  # pending on its holders, read from them
    if state is FileState.LOST:
        return "lost"
    if state is FileState.UNLINKED:
        return "unlinked"
    if flushing:
        return "flushing"
    if mirror is MirrorState.ACKED and state is FileState.PENDING:
        return "mirrored"
    return "dirty"
