"""The moves a file's state may make, and the one place that makes them.

Every change of ``CachedFile.state`` goes through :func:`move` (or, for a
file just built from a manifest or a journal record, :func:`start`), so the
table below is the whole state machine: docs/STATES.md describes each move,
and tests/unit/test_transitions.py checks that nothing else assigns a state.
A move the table does not allow is a bug in the caller: it raises rather
than leave a file in a state no other part of the cache expects.
"""

from __future__ import annotations

from ckptfs.fs.content.cachedfile import CachedFile
from ckptfs.fs.content.state import FileState

_M, _PUB, _P, _D, _L, _U = (
    FileState.MODIFIED,
    FileState.PUBLISHING,
    FileState.PENDING,
    FileState.DURABLE,
    FileState.LOST,
    FileState.UNLINKED,
)

ALLOWED: dict[FileState, frozenset[FileState]] = {
    # a commit begins; a buddy's mirror is committed (its pages came first);
    # the file is removed or retired
    _M: frozenset({_PUB, _P, _U}),
    # the pending manifest is written; a write meanwhile, or the publish failed;
    # the name went meanwhile
    _PUB: frozenset({_P, _M, _U}),
    # a write or truncate (a fork keeps the old content), a mirror's new pages;
    # the flush made it durable; its holders failed (another node's file);
    # removed, replaced by a newer version, or a mirror let go of
    _P: frozenset({_M, _D, _L, _U}),
    # a write or truncate; removed, or another node's version replaced it
    _D: frozenset({_M, _U}),
    # a truncate to 0 (a full rewrite); another node's file whose holders are
    # back, or that was made durable meanwhile; removed
    _L: frozenset({_M, _P, _D, _U}),
    # the end: a removed file's handles may still write, it stays UNLINKED
    _U: frozenset(),
}

# What a file built from a manifest, a journal record or a mirror starts as.
STARTS = frozenset({_M, _P, _D, _L})


class IllegalTransition(RuntimeError):
    """A state change the table does not allow: a bug, named with the file."""


def move(f: CachedFile, to: FileState) -> None:
    """``f`` goes to state ``to`` (staying where it is is always allowed)."""
    if to is not f.state and to not in ALLOWED[f.state]:
        raise IllegalTransition(f"{f.path}: {f.state.name} -> {to.name} is not allowed")
    f.state = to


def start(f: CachedFile, state: FileState) -> None:
    """The first state of ``f``, built just now and known to nobody else yet."""
    if state not in STARTS:
        raise IllegalTransition(f"{f.path}: a file cannot start {state.name}")
    f.state = state
