"""Recovery's kept (unconfirmed) records and the arena's slots, on a real
cache and journal, with the store's answers given by the test: which record
owns a slot two records list, which slots go back, and when."""

from __future__ import annotations

import errno
from pathlib import Path
from typing import Any

import trio
from caches import make_cache
from ckptfs.fs.cache.cache import Cache
from ckptfs.fs.cache.recovery import confirm_later, recover
from ckptfs.fs.store.manifest import Manifest, new_id

PAGE = 1 << 20


def record(path: str, slots: list[int], file_id: str | None = None) -> dict[str, Any]:
    """A journal record of a pending version whose pages are in ``slots``."""
    return {
        "file_id": file_id or new_id(), "version": new_id(), "path": path,
        "size": len(slots) * PAGE, "mode": 0o644, "uid": 0, "gid": 0, "mtime_ns": 1,
        "dirty": {str(p): [slot, PAGE] for p, slot in enumerate(slots)},
        "spilled": {}, "base": [], "base_end": 0,
    }  # fmt: skip


def pending(r: dict[str, Any]) -> Manifest:
    return Manifest(r["file_id"], r["version"], r["size"], 0o644, 1, "pending", ["n1"], [])


class Store:
    """Answers for manifests by path: a manifest, nothing, or EIO."""

    def __init__(self, at: dict[str, Manifest | None | OSError]) -> None:
        self.at = at

    async def manifest(self, rel: str) -> Manifest | None:
        found = self.at.get(rel)
        if isinstance(found, OSError):
            raise found
        if found is None:
            raise FileNotFoundError(errno.ENOENT, rel)
        return found

    async def restore_aside(self, rel: str, file_id: str) -> bool:
        return False

    async def renamed_to(self, rel: str, file_id: str) -> str | None:
        return None


def journaled(tmp_path: Path, *records: dict[str, Any]) -> Cache:
    tmp_path.mkdir(parents=True, exist_ok=True)
    cache = make_cache(tmp_path, capacity=8 * PAGE, slot_size=PAGE)
    for r in records:
        cache.journal.write_now((r["file_id"], r["version"]), r)
    return cache


def keys_on_disk(cache: Cache) -> set[tuple[str, str]]:
    return {(r["file_id"], r["version"]) for r in cache.journal.load()}


def test_a_kept_stale_record_does_not_cost_the_live_one_sharing_its_slot(tmp_path: Path):
    """A (dropped lazily: its version is gone) lists slot 1, which B, a live
    pending version, reuses. A's manifest cannot be read: B is adopted all
    the same, whatever the order, and A is let go, since B owns slot 1."""
    a, b = record("a.pt", [0, 1]), record("b.pt", [1, 2])
    for order in ((a, b), (b, a)):
        cache = journaled(tmp_path / str(id(order)), *order)
        store = Store({"a.pt": OSError(errno.EIO, "I/O error"), "b.pt": pending(b)})
        assert trio.run(recover, cache, store) == 1
        assert cache.files[b["file_id"]].path == "b.pt"
        assert len(cache.unconfirmed) == 0
        assert keys_on_disk(cache) == {(b["file_id"], b["version"])}
        assert cache.arena.used_slots == 2


def test_two_kept_records_sharing_a_slot_give_it_back_only_once_both_are_gone(tmp_path: Path):
    a, b = record("a.pt", [0, 1]), record("b.pt", [1, 2])
    cache = journaled(tmp_path, a, b)
    eio = OSError(errno.EIO, "I/O error")
    store = Store({"a.pt": eio, "b.pt": eio})
    assert trio.run(recover, cache, store) == 0
    assert len(cache.unconfirmed) == 2 and cache.arena.used_slots == 3

    async def let_go() -> None:
        await cache.discard_unconfirmed((a["file_id"], a["version"]), "test")
        assert cache.arena.used_slots == 2  # slot 1 is still b's
        await cache.discard_unconfirmed((b["file_id"], b["version"]), "test")
        assert cache.arena.used_slots == 0

    trio.run(let_go)
    assert keys_on_disk(cache) == set()


def test_adopting_a_kept_record_lets_go_of_those_sharing_its_slots(tmp_path: Path):
    """Once the store answers, B is confirmed: A, sharing slot 1, is let go
    without giving slot 1 back; C, sharing nothing, is adopted too."""
    a, b, c = record("a.pt", [0, 1]), record("b.pt", [1, 2]), record("c.pt", [3])
    cache = journaled(tmp_path, a, b, c)
    eio = OSError(errno.EIO, "I/O error")
    assert trio.run(recover, cache, Store({"a.pt": eio, "b.pt": eio, "c.pt": eio})) == 0
    assert len(cache.unconfirmed) == 3

    async def main() -> None:
        store = Store({"a.pt": eio, "b.pt": pending(b), "c.pt": pending(c)})
        async with trio.open_nursery() as nursery:
            nursery.start_soon(cache.journal.run)
            with trio.fail_after(30):
                await confirm_later(cache, store)
            nursery.cancel_scope.cancel()

    trio.run(main)
    assert {f.path for f in cache.all_files()} == {"b.pt", "c.pt"}
    assert cache.arena.used_slots == 3  # b's two, c's one
    assert keys_on_disk(cache) == {(b["file_id"], b["version"]), (c["file_id"], c["version"])}
