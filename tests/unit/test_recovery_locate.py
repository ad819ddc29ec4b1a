"""Recovery's reading of the store (fs/cache/recovery.py ``locate``): which
failures decide that a crashed daemon's version is gone, and which leave it
undecided (kept, with its bytes, to be asked about again)."""

from __future__ import annotations

import errno
from typing import Any

import pytest
import trio
from ckptfs.fs.cache.recovery import Undecided, locate
from ckptfs.fs.store.blocking import BackingTimeout
from ckptfs.fs.store.manifest import Manifest, ManifestError, new_id

FILE_ID, VERSION = new_id(), new_id()


def pending(state: str = "pending", version: str = VERSION) -> Manifest:
    return Manifest(FILE_ID, version, 5, 0o644, 0, state, ["n1"], [])


class Store:
    """The two calls recovery makes of the backing store, answered from
    ``at`` (path -> a manifest, or an exception to raise) and ``moves``
    (path -> where renames led, or an exception)."""

    def __init__(
        self, at: dict[str, Any], moves: dict[str, Any] | None = None, aside: Any = False
    ) -> None:
        self.at, self.moves, self.aside = at, moves or {}, aside

    async def manifest(self, rel: str) -> Manifest | None:
        found = self.at.get(rel, FileNotFoundError(errno.ENOENT, rel))
        if isinstance(found, BaseException):
            raise found
        return found

    async def restore_aside(self, rel: str, file_id: str) -> bool:
        """``aside``: True (put back: the manifest is at ``rel`` now), False
        (none), or what the store raised (EBUSY: a takeover holds it)."""
        if isinstance(self.aside, BaseException):
            raise self.aside
        if self.aside:
            self.at[rel] = pending()
        return bool(self.aside)

    async def renamed_to(self, rel: str, file_id: str) -> str | None:
        moved = self.moves.get(rel)
        if isinstance(moved, BaseException):
            raise moved
        return moved


def run_locate(store: Store, **record: Any) -> tuple[Manifest | None, str]:
    rec = {"file_id": FILE_ID, "version": VERSION, "path": "a/x.pt", **record}
    return trio.run(locate, store, rec)


def test_a_pending_manifest_at_its_path_or_where_renames_led_is_found():
    m = pending()
    assert run_locate(Store({"a/x.pt": m})) == (m, "a/x.pt")
    assert run_locate(Store({"b/y.pt": m}, {"a/x.pt": "b/y.pt"})) == (m, "b/y.pt")
    assert run_locate(Store({"a/old.pt": m}), renamed_from="a/old.pt") == (m, "a/old.pt")


@pytest.mark.parametrize(
    "there",
    [
        pending("durable"),
        pending(version=new_id()),
        None,  # a plain file
        ManifestError("a/x.pt: bad file_id"),  # anyone may write into the store
        OSError(errno.ELOOP, "a symlink on the way"),
        NotADirectoryError(errno.ENOTDIR, "a/"),
    ],
)
def test_what_a_user_can_put_at_the_path_decides_the_version_is_gone(there: Any):
    assert run_locate(Store({"a/x.pt": there})) == (None, "a/x.pt")


@pytest.mark.parametrize(
    "failure",
    [
        OSError(errno.EIO, "I/O error"),
        OSError(errno.ESTALE, "stale file handle"),
        BackingTimeout("backing store did not answer within 2s (read manifest a/x.pt)"),
    ],
)
def test_a_store_that_does_not_answer_leaves_it_undecided(failure: OSError):
    with pytest.raises(Undecided, match="a/x.pt"):
        run_locate(Store({"a/x.pt": failure}))
    # The manifest is not there, and the rename records cannot be read:
    # a rename may have moved it, so it is not gone either.
    with pytest.raises(Undecided, match="renames of a/x.pt"):
        run_locate(Store({}, {"a/x.pt": failure}))
    # Renames led somewhere the store cannot read.
    with pytest.raises(Undecided, match="b/y.pt"):
        run_locate(Store({"b/y.pt": failure}, {"a/x.pt": "b/y.pt"}))


def test_a_manifest_a_takeover_moved_aside_is_put_back_or_left_undecided():
    """The name is empty: a takeover that died holding it left the manifest
    aside (put back, and found), or one under way holds it (undecided: not
    gone)."""
    m, path = run_locate(Store({}, aside=True))
    assert (m.file_id, m.version, path) == (FILE_ID, VERSION, "a/x.pt")
    with pytest.raises(Undecided, match="takeover"):
        run_locate(Store({}, aside=OSError(errno.EBUSY, "a/x.pt: a takeover holds it aside")))
