"""Buddy mirroring and the takeover's fenced publish, without FUSE or sockets."""

from __future__ import annotations

import errno
import json
import os
import threading
import time
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from caches import make_cache
from ckptfs.fs.cache.cache import Cache
from ckptfs.fs.cache.journal import record_of
from ckptfs.fs.content.cachedfile import CachedFile, ChunkMap
from ckptfs.fs.content.state import FileRole, FileState, MirrorState, PageState
from ckptfs.fs.store import publish as backing_mod
from ckptfs.fs.store.backing import Backing
from ckptfs.fs.store.blocking import BackingIO
from ckptfs.fs.store.entries import PlainFile
from ckptfs.fs.store.manifest import MAGIC, Chunk, Manifest, read_manifest
from ckptfs.fs.store.publish import Published
from ckptfs.peer.mirror.client import MirrorClient
from ckptfs.peer.mirror.server import MirrorServer
from ckptfs.peer.mirror.wire import COMMIT, DROP, PAGE, page_digest
from ckptfs.peer.reads.reads import MOVED_ON, READ, ReadServer
from ckptfs.peer.transport.transport import Request, Response
from manifests import write_store_manifest
from mirrors import (
    PS,
    GatedLink,
    commit,
    commit_request,
    durable,
    mirror_client,
    pending,
    small_cache,
)

MiB = 1 << 20


def test_a_takeover_publishes_only_over_the_version_it_mirrored(tmp_path: Path):
    (tmp_path / "d").mkdir()
    write_store_manifest(
        tmp_path / "d" / "a.pt",
        pending("f1", "v1", ["n1", "n2"]),
        backing=tmp_path,
    )

    async def main() -> None:
        b = Backing(tmp_path, BackingIO(5))
        # Another version there (the writer published a newer one): it stays.
        write_store_manifest(tmp_path / "d" / "a.pt", pending("f1", "v2", ["n1"]), backing=tmp_path)
        r = await b.takeover_manifest("d/a.pt", durable("f1", "v1"), file_id="f1",
                                      expect_version="v1")  # fmt: skip
        assert r is Published.STALE
        assert read_manifest(tmp_path / "d" / "a.pt").version == "v2"
        # Another file at the name: not ours.
        write_store_manifest(tmp_path / "d" / "a.pt", pending("f9", "v1", ["n3"]), backing=tmp_path)
        r = await b.takeover_manifest("d/a.pt", durable("f1", "v1"), file_id="f1",
                                      expect_version="v1")  # fmt: skip
        assert r is Published.NAME_GONE
        assert read_manifest(tmp_path / "d" / "a.pt").file_id == "f9"
        # No name at all.
        r = await b.takeover_manifest("d/b.pt", durable("f1", "v1"), file_id="f1",
                                      expect_version="v1")  # fmt: skip
        assert r is Published.NAME_GONE
        # No directory either (a rotation's rmtree on another node): gone,
        # and the fence is let go, or every later try would wait for it.
        r = await b.takeover_manifest("gone/c.pt", durable("f1", "v1"), file_id="f1",
                                      expect_version="v1")  # fmt: skip
        assert r is Published.NAME_GONE
        assert os.listdir(tmp_path / ".ckptfs" / "fence") == []
        # A plain file where its directory was: gone too (it retried for ever).
        (tmp_path / "plain").write_bytes(b"not a directory")
        r = await b.takeover_manifest("plain/c.pt", durable("f1", "v1"), file_id="f1",
                                      expect_version="v1")  # fmt: skip
        assert r is Published.NAME_GONE
        assert os.listdir(tmp_path / ".ckptfs" / "fence") == []
        # Exactly the mirrored version: published, owner kept, no leftovers.
        write_store_manifest(
            tmp_path / "d" / "a.pt",
            pending("f1", "v1", ["n1", "n2"]),
            owner=(7, 8),
            backing=tmp_path,
        )
        r = await b.takeover_manifest("d/a.pt", durable("f1", "v1"), file_id="f1",
                                      expect_version="v1")  # fmt: skip
        assert r is Published.DONE
        m = read_manifest(tmp_path / "d" / "a.pt")
        assert m.state == "durable" and m.version == "v1" and m.holders == ["n2"]
        st = os.stat(tmp_path / "d" / "a.pt")
        assert (st.st_uid, st.st_gid, st.st_nlink) == (7, 8, 1)
        assert os.listdir(tmp_path / "d") == ["a.pt"]
        assert os.listdir(tmp_path / ".ckptfs" / "fence") == []

    trio.run(main)


def test_a_takeover_publish_keeps_its_directory_times(tmp_path: Path):
    """A takeover rewrites a name's manifest (moved aside, the new one
    linked in), as a flush does: the checkpoint directory's mtime, by which
    HF Trainer rotates checkpoints out, must not move. A change of the
    directory by someone else meanwhile still moves it."""
    d = tmp_path / "checkpoint-4"
    d.mkdir()
    t = 1_700_000_000_000_000_000
    write_store_manifest(d / "a.pt", pending("f1", "v1", ["n1", "n2"]), backing=tmp_path)
    write_store_manifest(
        d / "b.pt",
        pending("f2", "v2", ["n1"]),
        backing=tmp_path,
    )  # a newer version than mirrored
    os.utime(d, ns=(t, t))

    async def main() -> None:
        b = Backing(tmp_path, BackingIO(5))
        r = await b.takeover_manifest("checkpoint-4/a.pt", durable("f1", "v1"), file_id="f1",
                                      expect_version="v1")  # fmt: skip
        assert r is Published.DONE
        assert read_manifest(d / "a.pt").state == "durable"
        assert os.stat(d).st_mtime_ns == t
        r = await b.takeover_manifest("checkpoint-4/b.pt", durable("f2", "v1"), file_id="f2",
                                      expect_version="v1")  # fmt: skip
        assert r is Published.STALE  # put back
        assert read_manifest(d / "b.pt").version == "v2"
        assert os.stat(d).st_mtime_ns == t
        assert sorted(os.listdir(d)) == ["a.pt", "b.pt"]

    trio.run(main)


def test_a_change_by_another_node_during_a_takeover_moves_the_directory_mtime(
    tmp_path: Path, monkeypatch
):
    t = 1_700_000_000_000_000_000
    real_write = backing_mod.write_manifest

    def write_then_another_node_creates(*args, **kwargs):
        real_write(*args, **kwargs)  # the new manifest, under its temporary name
        (tmp_path / "d" / "extra.json").write_bytes(b"{}")  # meanwhile, elsewhere

    (tmp_path / "d").mkdir()
    write_store_manifest(
        tmp_path / "d" / "a.pt",
        pending("f1", "v1", ["n1", "n2"]),
        backing=tmp_path,
    )
    os.utime(tmp_path / "d", ns=(t, t))
    monkeypatch.setattr(backing_mod, "write_manifest", write_then_another_node_creates)

    async def main() -> None:
        b = Backing(tmp_path, BackingIO(5))
        r = await b.takeover_manifest("d/a.pt", durable("f1", "v1"), file_id="f1",
                                      expect_version="v1")  # fmt: skip
        assert r is Published.DONE

    trio.run(main)
    assert os.stat(tmp_path / "d").st_mtime_ns > t
    assert sorted(os.listdir(tmp_path / "d")) == ["a.pt", "extra.json"]


def _race(tmp_path: Path, monkeypatch, writer_publishes) -> tuple[Published, Published]:
    """Run a takeover of v1 and stop it right after it moved the manifest
    aside; ``writer_publishes(backing)`` runs then, in that instant."""
    write_store_manifest(tmp_path / "a.pt", pending("f1", "v1", ["n1", "n2"]), backing=tmp_path)
    moved_aside = threading.Event()
    carry_on = threading.Event()
    real_read = backing_mod.read_manifest

    def slow_read(path, **kwargs):  # the takeover's read of the moved-aside manifest
        if ".ckptfs-tmp." in str(path) and not moved_aside.is_set():
            moved_aside.set()
            assert carry_on.wait(10)
        return real_read(path, **kwargs)

    monkeypatch.setattr(backing_mod, "read_manifest", slow_read)
    results: dict[str, Published] = {}

    async def main() -> None:
        b = Backing(tmp_path, BackingIO(30))

        async def takeover() -> None:
            results["takeover"] = await b.takeover_manifest(
                "a.pt", durable("f1", "v1"), file_id="f1", expect_version="v1"
            )

        async def writer() -> None:
            await trio.to_thread.run_sync(moved_aside.wait)
            assert not (tmp_path / "a.pt").exists()  # the instant the name is missing

            def release_soon() -> None:
                time.sleep(0.2)
                carry_on.set()

            threading.Thread(target=release_soon).start()
            results["writer"] = await writer_publishes(b)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(takeover)
            nursery.start_soon(writer)

    trio.run(main)
    assert read_manifest(tmp_path / "a.pt").version == "v2"  # the newer version stays
    assert sorted(os.listdir(tmp_path)) == [".ckptfs", "a.pt"]  # nothing left aside
    return results["takeover"], results["writer"]


def test_a_publish_that_lands_while_the_name_is_aside_wins(tmp_path: Path, monkeypatch):
    """The writer's rename of V2 lands in the instant the takeover has V1
    moved aside: the takeover's link(2) fails and V2 stays."""

    async def rename_in(b: Backing) -> Published:
        await trio.to_thread.run_sync(
            write_store_manifest, tmp_path / "a.pt", pending("f1", "v2", []), tmp_path
        )
        return Published.DONE

    takeover, _ = _race(tmp_path, monkeypatch, rename_in)
    assert takeover is Published.STALE


def test_a_publish_that_finds_the_name_aside_waits_for_the_fence(tmp_path: Path, monkeypatch):
    """The writer's publish finds the name missing: it waits for the fence
    instead of calling the name gone; the takeover's V1 lands first and the
    writer's V2 replaces it (order kept, nothing lost)."""

    async def publish(b: Backing) -> Published:
        return await b.replace_manifest("a.pt", pending("f1", "v2", ["n1"]), (0, 0), file_id="f1")

    takeover, writer = _race(tmp_path, monkeypatch, publish)
    assert (takeover, writer) == (Published.DONE, Published.DONE)


def entry(page: int, gen: int, data: bytes) -> list[int]:
    """A batch's entry for a page: (page, generation, fill, digest)."""
    return [page, gen, len(data), page_digest(data, page, gen)]


async def _no_manifest(path: str) -> Manifest | None:
    return None


async def _unreachable_peers(*args: object) -> bytes:
    raise OSError(errno.EHOSTUNREACH, "no peer answers in this test")


def buddy_of_n1(cache: Cache) -> MirrorServer:
    """The mirror server of n1's buddy over ``cache``; n1 is alive, and its
    busy batches wait at most 0.1 s (half of a 0.2 s timeout)."""
    return MirrorServer(cache, mirrored_for=("n1",), timeout=0.2, manifest_at=_no_manifest,
                        is_alive=lambda name: True)  # fmt: skip


def test_a_mirror_serves_a_version_only_once_its_page_table_matches(tmp_path: Path):
    async def main() -> None:
        cache = make_cache(tmp_path, "n2")
        queued = []
        cache.on_pending = queued.append
        page0, page1 = os.urandom(MiB), os.urandom(1000)
        assert await cache.mirror_page("n1", "m1", "f1", 0, 5, memoryview(page0), timeout=1)
        m = Manifest("f1", "v1", MiB + 1000, 0o644, 1, "pending", ["n1", "n2"])
        # Page 1 never arrived, page 0 at another generation: both asked for again.
        ram = {0: (6, MiB), 1: (7, 1000)}
        assert cache.mirror_commit("n1", "m1", m, "a.pt", 0, 0, ram, {}, ChunkMap(), 7) == [0, 1]
        assert cache.held_version("f1", "v1") is None
        assert await cache.mirror_page("n1", "m1", "f1", 0, 6, memoryview(page0), timeout=1)
        assert await cache.mirror_page("n1", "m1", "f1", 1, 7, memoryview(page1), timeout=1)
        assert cache.mirror_commit("n1", "m1", m, "a.pt", 0, 0, ram, {}, ChunkMap(), 7) == []
        f = cache.held_version("f1", "v1")
        assert f is not None and f.role is FileRole.MIRROR and f.state is FileState.PENDING
        assert await cache.read(f, 0, MiB + 1000) == page0 + page1
        assert cache.mirrored_bytes() == 2 * MiB
        # Only its writer may change it.
        try:
            await cache.mirror_page("n3", "m1", "f1", 0, 9, memoryview(page1), timeout=1)
            raise AssertionError("another node changed a mirror")
        except OSError:
            pass
        # A page arriving after the commit: the version is no longer held as-is.
        assert await cache.mirror_page("n1", "m1", "f1", 1, 8, memoryview(page0[:10]), timeout=1)
        assert cache.held_version("f1", "v1") is None
        assert cache.mirror_commit("n1", "m1", m, "a.pt", 0, 0, {0: (6, MiB), 1: (8, 10)},
                                   {}, ChunkMap(), 8) == []  # fmt: skip
        # The writer dies: the committed mirror is taken over and queued.
        assert cache.take_over(f) and f.role is FileRole.TAKEOVER and queued == [f]
        assert f.holders == ["n2"] and f.owes_flush
        # A stale drop (another version) is ignored; uncommitted mirrors of a
        # dead writer are dropped, not flushed.
        assert not cache.mirror_drop("n1", "m1", "v0")
        assert await cache.mirror_page("n1", "m2", "f2", 0, 1, memoryview(page1), timeout=1)
        assert not cache.take_over(cache.mirrors["m2"]) and "m2" not in cache.mirrors
        assert cache.mirror_slots == 2

    trio.run(main)


def test_a_holder_whose_content_is_being_changed_says_so_to_a_reader(tmp_path: Path):
    """A peer's read of a version the node no longer holds as-is because its
    content is being changed (here a buddy's mirror taking a changed page)
    is refused with MOVED_ON (its reader then answers ESTALE rather than
    calling the file lost). A version it simply does not hold, or whose
    writer died mid-change, is refused without."""

    async def main() -> None:
        cache = make_cache(tmp_path, "n2")

        async def local_read(file_id, version, off, n, into, writer):
            return await cache.read_held(file_id, version, off, n, into=into, writer=writer)

        alive = {"n1"}
        server = ReadServer(local_read, partial(cache.changing, writer_alive=alive.__contains__))

        async def ask(file_id: str) -> Response:
            meta = {"file_id": file_id, "version": "v1", "offset": 0, "length": 100,
                    "writer": "n1"}  # fmt: skip
            return await server.handle("n3", Request(READ, meta, b""))

        page = os.urandom(1000)
        assert await cache.mirror_page("n1", "m1", "f1", 0, 5, memoryview(page), timeout=1)
        m = Manifest("f1", "v1", 1000, 0o644, 1, "pending", ["n1", "n2"])
        assert cache.mirror_commit("n1", "m1", m, "a.pt", 0, 0, {0: (5, 1000)}, {},
                                   ChunkMap(), 5) == []  # fmt: skip
        served = await ask("f1")
        assert served.error is None and bytes(served.payload) == page[:100]
        assert (await ask("f1")).error is None  # served: not changing
        assert await cache.mirror_page("n1", "m1", "f1", 0, 6, memoryview(page[:10]), timeout=1)
        refused = await ask("f1")
        assert refused.error is not None and refused.meta == {MOVED_ON: True}
        unknown = await ask("f9")
        assert unknown.error is not None and MOVED_ON not in unknown.meta
        # Its writer died mid-change: the version is lost, not being changed.
        alive.clear()
        lost = await ask("f1")
        assert lost.error is not None and MOVED_ON not in lost.meta

    trio.run(main)


def test_a_full_mirror_quota_answers_busy_and_frees_on_drop(tmp_path: Path):
    async def main() -> None:
        cache = make_cache(tmp_path, "n2")
        cache.mirror_quota = 2
        page = memoryview(os.urandom(MiB))
        assert await cache.mirror_page("n1", "m1", "f1", 0, 1, page, timeout=1)
        assert await cache.mirror_page("n1", "m1", "f1", 1, 2, page, timeout=1)
        start = trio.current_time()
        assert not await cache.mirror_page("n1", "m1", "f1", 2, 3, page, timeout=0.3)
        assert trio.current_time() - start >= 0.3
        m = Manifest("f1", "v1", 2 * MiB, 0o644, 1, "pending", ["n1", "n2"])
        ram = {0: (1, MiB), 1: (2, MiB)}
        assert cache.mirror_commit("n1", "m1", m, "a.pt", 0, 0, ram, {}, ChunkMap(), 2) == []
        assert cache.mirror_drop("n1", "m1", "v1")
        assert cache.mirror_slots == 0 and cache.arena.used_slots == 0
        assert await cache.mirror_page("n1", "m2", "f1", 0, 4, page, timeout=1)
        # The writer is done with m1 (durable: its next content has a new id).
        # A page of it still on the way must not make a mirror nothing drops.
        try:
            await cache.mirror_page("n1", "m1", "f1", 2, 3, page, timeout=1)
            raise AssertionError("a late page of a dropped mirror was taken")
        except OSError as exc:
            assert exc.errno == errno.ESTALE
        assert "m1" not in cache.mirrors and cache.mirror_slots == 1

    trio.run(main)


def test_a_batch_of_pages_is_held_up_to_the_quota_and_malformed_batches_change_nothing(
    tmp_path: Path,
):
    async def main() -> None:
        cache = make_cache(tmp_path, "n2")
        cache.mirror_quota = 3
        server = buddy_of_n1(cache)
        pages = [os.urandom(MiB), os.urandom(MiB), os.urandom(MiB // 2)]

        def request(batch: list[list[int]], payload: bytes) -> Request:
            meta = {"mid": "m1", "file_id": "f1", "pages": batch, "wait": False}
            return Request(PAGE, meta, memoryview(payload))

        for batch, payload in (
            ([entry(0, 1, pages[0]), entry(0, 2, pages[1])], pages[0] + pages[1]),  # twice
            ([entry(0, 1, pages[0]), entry(1, 1, pages[1])], pages[0]),  # sizes do not add up
            (
                [[0, 1, 2 * MiB, page_digest(pages[0] + pages[1], 0, 1)]],
                pages[0] + pages[1],
            ),  # too big
            ([[0, 1, MiB]], pages[0]),  # no digest
            ([], b""),
        ):
            response = await server.handle("n1", request(batch, payload))
            assert not response.ok
            assert cache.mirror_slots == 0 and "m1" not in cache.mirrors
        # Four pages against a quota of three: the first three are held, in order.
        batch = [entry(0, 1, pages[0]), entry(1, 2, pages[1]), entry(2, 3, pages[2])]
        batch.append(entry(3, 4, pages[0]))
        response = await server.handle("n1", request(batch, b"".join(pages) + pages[0]))
        assert response.ok and response.meta["held"] == [0, 1, 2] and response.meta["busy"]
        m = Manifest("f1", "v1", 2 * MiB + MiB // 2, 0o644, 1, "pending", ["n1", "n2"])
        ram = {0: (1, MiB), 1: (2, MiB), 2: (3, MiB // 2)}
        assert cache.mirror_commit("n1", "m1", m, "a.pt", 0, 0, ram, {}, ChunkMap(), 3) == []
        held = cache.mirrors["m1"]
        assert bytes(await cache.read(held, 0, held.size)) == b"".join(pages)
        # A batch that may wait for room waits once, not once per page: well
        # inside the writer's request timeout (0.2 s here).
        meta = {"mid": "m2", "file_id": "f2", "wait": True}
        meta["pages"] = [entry(p, 1, pages[0]) for p in range(4)]
        start = trio.current_time()
        response = await server.handle("n1", Request(PAGE, meta, memoryview(pages[0] * 4)))
        assert response.ok and response.meta["held"] == [] and response.meta["busy"]
        assert trio.current_time() - start < 0.15

    trio.run(main)


def test_a_batch_is_received_straight_into_reserved_slots_and_older_generations_never_win(
    tmp_path: Path,
):
    async def main() -> None:
        cache = make_cache(tmp_path, "n2")
        cache.mirror_quota = 4
        server = buddy_of_n1(cache)
        new0, new1, old0 = os.urandom(MiB), os.urandom(MiB // 3), os.urandom(MiB)

        def meta(mid: str, batch: list[list[int]]) -> dict[str, object]:
            return {"mid": mid, "file_id": "f1", "pages": batch, "wait": False}

        async def receive(mid: str, batch: list[list[int]], payload: bytes):
            """What the transport does: place, receive into the views, handle, release."""
            placement = server.place("n1", PAGE, meta(mid, batch), len(payload))
            assert placement is not None
            pos = 0
            for view in placement.views:  # the arena itself: no copy on the buddy
                view[:] = payload[pos : pos + len(view)]
                pos += len(view)
            try:
                request = Request(PAGE, meta(mid, batch), memoryview(b""), 1, placement)
                return await server.handle("n1", request)
            finally:
                placement.release()

        used = cache.arena.used_slots
        response = await receive("m1", [entry(0, 10, new0), entry(1, 11, new1)], new0 + new1)
        assert response.ok and response.meta["held"] == [0, 1]
        assert cache.mirror_slots == 2 and cache.mirror_reserved == 0
        assert cache.arena.used_slots == used + 2
        # A late batch of an older generation changes nothing, whichever way it came.
        response = await receive("m1", [entry(0, 9, old0)], old0)
        assert response.ok and response.meta["held"] == [0]
        assert await cache.mirror_page("n1", "m1", "f1", 0, 8, memoryview(old0), timeout=1)
        assert cache.mirror_slots == 2 and cache.arena.used_slots == used + 2
        m = Manifest("f1", "v1", MiB + MiB // 3, 0o644, 1, "pending", ["n1", "n2"])
        ram = {0: (10, MiB), 1: (11, MiB // 3)}
        assert cache.mirror_commit("n1", "m1", m, "a.pt", 0, 0, ram, {}, ChunkMap(), 11) == []
        held = cache.mirrors["m1"]
        assert bytes(await cache.read(held, 0, held.size)) == new0 + new1
        # No room for the whole batch now, not the writer's buddy, or malformed:
        # nothing is reserved, and the handler answers as before.
        assert (
            server.place("n1", PAGE, meta("m2", [[p, 1, MiB, 0] for p in range(3)]), 3 * MiB)
            is None
        )
        assert server.place("n3", PAGE, meta("m2", [[0, 1, MiB, 0]]), MiB) is None
        assert server.place("n1", PAGE, meta("m2", [[0, 1, MiB, 0]]), MiB - 1) is None
        assert cache.mirror_reserved == 0
        # A payload that never arrived, or a mirror that is not the sender's to
        # change: the reserved slots go back.
        placement = server.place("n1", PAGE, meta("m2", [[0, 1, MiB, 0], [1, 2, 5, 0]]), MiB + 5)
        assert placement is not None and cache.mirror_reserved == 2
        placement.release()
        assert cache.mirror_reserved == 0 and cache.arena.used_slots == used + 2
        # A full tmpfs (no memory for a slot's holes): the buffered path, whose
        # write fails with ENOSPC; nothing stays reserved.
        real_back = cache.arena.back

        def no_memory(slot: int) -> None:
            raise OSError(errno.ENOSPC, "No space left on device")

        cache.arena.back = no_memory  # type: ignore[method-assign]
        assert server.place("n1", PAGE, meta("m2", [[0, 1, MiB, 0]]), MiB) is None
        assert cache.mirror_reserved == 0 and cache.arena.used_slots == used + 2
        cache.arena.back = real_back  # type: ignore[method-assign]
        held.origin = "n9"
        response = await receive("m1", [entry(0, 12, new0)], new0)
        assert not response.ok and "not n1's to change" in str(response.error)
        assert cache.mirror_reserved == 0 and cache.arena.used_slots == used + 2

    trio.run(main)


def test_every_file_content_has_its_own_mirror_id_even_after_a_restart(tmp_path: Path):
    async def main() -> None:
        cache = make_cache(tmp_path, "n2")
        record = {
            "file_id": "f1", "version": "v1", "path": "a.pt", "size": 0, "mode": 0o644,
            "mtime_ns": 1, "dirty": {}, "spilled": {}, "base": [], "base_end": 0,
        }  # fmt: skip
        a = cache.adopt(record)
        b = cache.adopt({**record, "file_id": "f2", "path": "b.pt"})
        c = cache.new_file("f3", "v1", "c.pt", 0o644, 0, 0)
        # Generations start again after a restart: a reused id would let the
        # buddy mix two contents' pages.
        assert len({a.mirror_id, b.mirror_id, c.mirror_id}) == 3 and all(
            f.mirror_id for f in (a, b, c)
        )

    trio.run(main)


def test_the_same_generation_again_leaves_a_committed_mirror_committed(tmp_path: Path):
    """A resync to a buddy that kept its mirrors sends every page again at the
    same generations: the version stays held (a takeover would flush it)."""

    async def main() -> None:
        cache = make_cache(tmp_path, "n2")
        page0, page1 = os.urandom(MiB), os.urandom(4321)
        assert await cache.mirror_page("n1", "m1", "f1", 0, 5, memoryview(page0), timeout=1)
        assert await cache.mirror_page("n1", "m1", "f1", 1, 6, memoryview(page1), timeout=1)
        m = Manifest("f1", "v1", MiB + 4321, 0o644, 1, "pending", ["n1", "n2"])
        ram = {0: (5, MiB), 1: (6, 4321)}
        assert cache.mirror_commit("n1", "m1", m, "a.pt", 0, 0, ram, {}, ChunkMap(), 6) == []
        used = cache.arena.used_slots
        assert await cache.mirror_page("n1", "m1", "f1", 0, 5, memoryview(page0), timeout=1)
        [slot] = cache.reserve_mirror_slots(1) or []
        cache.mirror_page_into("n1", "m1", "f1", 1, 6, slot, 4321)
        f = cache.held_version("f1", "v1")
        assert f is not None and f.state is FileState.PENDING
        assert cache.arena.used_slots == used and cache.mirror_reserved == 0
        assert bytes(await cache.read(f, 0, f.size)) == page0 + page1

    trio.run(main)


def test_a_page_waiting_for_room_frees_its_slot_whatever_happens_meanwhile(tmp_path: Path):
    async def main() -> None:
        cache = make_cache(tmp_path, "n2")
        cache.mirror_quota = 1
        page = memoryview(os.urandom(MiB))
        assert await cache.mirror_page("n1", "m1", "f1", 0, 1, page, timeout=1)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(partial(cache.mirror_page, "n1", "m2", "f2", 0, 2, page, timeout=5))
            await trio.testing.wait_all_tasks_blocked()
            # Another node says m2 is gone for good (it is not its mirror, so
            # m2 stays), and m1's room frees: the waiting page goes in or its
            # slot goes back, never half.
            cache.mirror_drop("n9", "m2", "")
            assert cache.mirror_drop("n1", "m1", "")
        assert cache.mirror_reserved == 0
        assert cache.mirror_slots == sum(f.ram_count for f in cache.mirrors.values())
        assert cache.arena.used_slots == cache.mirror_slots

    trio.run(main)


def test_peak_ram_counts_own_dirty_pages_and_mirrored_pages_apart(tmp_path: Path):
    """`stat`'s cache.peak: the most own not-yet-durable bytes and the most
    bytes mirrored for others at once, each kept after they are gone (the
    RAM a node needs is their sum; bench_buddy prints them)."""

    async def main() -> None:
        cache = make_cache(tmp_path, "n2")  # 8 slots of 1 MiB
        own = cache.new_file("f1", "v1", "own.pt", 0o644, 0, 0)
        await cache.write(own, 0, os.urandom(3 * MiB))
        page = memoryview(os.urandom(MiB))
        for p in range(2):
            assert await cache.mirror_page("n1", "m1", "f9", p, p + 1, page, timeout=1)
        assert cache.stats()["peak"] == {"used": 5 * MiB, "own_dirty": 3 * MiB,
                                         "mirrored": 2 * MiB}  # fmt: skip
        cache.drop(own)
        cache.drop(cache.mirrors["m1"])
        assert cache.stats()["used"] == 0 and cache.stats()["dirty"] == 0
        # One more mirrored page, then one own page: neither peak grows.
        assert await cache.mirror_page("n1", "m2", "f8", 0, 1, page, timeout=1)
        again = cache.new_file("f2", "v1", "again.pt", 0o644, 0, 0)
        await cache.write(again, 0, b"x" * 10)
        assert cache.stats()["peak"] == {"used": 5 * MiB, "own_dirty": 3 * MiB,
                                         "mirrored": 2 * MiB}  # fmt: skip

    trio.run(main)


def test_a_publish_replaces_a_plain_file_only_if_it_is_the_adopted_one(tmp_path: Path):
    """replace_manifest with plain: only that plain file is replaced; an
    unreadable manifest, another plain file at the name (even one given the
    freed inode number) or the same file rewritten in place is never ours."""

    async def main() -> None:
        b = Backing(tmp_path, BackingIO(5))
        m = pending("f1", "v1", ["n2"])
        path = tmp_path / "a.pt"
        path.write_bytes(b"plain bytes")
        adopted = PlainFile.of(path.stat())
        broken = MAGIC + b"{not json"
        (tmp_path / "b.pt").write_bytes(broken)

        async def publish(rel: str, plain: PlainFile | None) -> Published:
            return await b.replace_manifest(rel, m, (0, 0), file_id="f1", plain=plain)

        assert await publish("b.pt", adopted) is Published.NAME_GONE
        assert (tmp_path / "b.pt").read_bytes() == broken
        assert await publish("a.pt", None) is Published.NAME_GONE
        # Another node rewrites it in place, or puts a new file with the same
        # inode number there (what `rm a.pt; cp x a.pt` does on ext4).
        path.write_bytes(b"plain bytes, rewritten")
        assert await publish("a.pt", adopted) is Published.NAME_GONE
        st = path.stat()
        same_ino = PlainFile(adopted.ino, st.st_size, st.st_mtime_ns - 1)
        assert await publish("a.pt", same_ino) is Published.NAME_GONE
        assert path.read_bytes() == b"plain bytes, rewritten"
        assert await publish("a.pt", PlainFile.of(st)) is Published.DONE
        assert read_manifest(path).file_id == "f1"

    trio.run(main)


def test_a_dropped_file_is_not_kept_waiting_for_its_partial_page_to_fill(tmp_path: Path):
    """The writer streams full pages to its buddy as they fill; a partial last
    page waits for more bytes or for the commit. A file dropped (or unlinked)
    before either must not stay in that waiting set, holding it for ever."""

    async def main() -> None:
        cache = make_cache(tmp_path, "n1")
        client = MirrorClient(
            cache,
            None,  # type: ignore[arg-type]  # no request is sent here
            node="n1",
            buddy="n2",
            address=("127.0.0.1", 9),
            timeout=1,
            is_alive=lambda n: True,
        )
        cache.on_page_changed = client.changed
        kept = cache.new_file("f1", "v1", "kept.pt", 0o644, 0, 0)
        gone = cache.new_file("f2", "v1", "gone.pt", 0o644, 0, 0)
        await cache.write(kept, 0, os.urandom(MiB + 10))  # a full page and a partial one
        await cache.write(gone, 0, os.urandom(MiB + 10))
        assert client._take_full_batch() == (kept, [0])
        assert client._take_full_batch() == (gone, [0])
        assert client._take_full_batch() is None  # the partial pages wait
        cache.drop(gone)
        assert client._take_full_batch() is None
        assert list(client._changed) == [kept]
        assert client._changed[kept] == {1}
        cache.unlink(kept)
        assert client._take_full_batch() is None
        assert client._changed == {}

    trio.run(main)


def test_a_page_damaged_on_the_way_is_not_held_and_the_writer_is_told(tmp_path: Path):
    """DESIGN: every peer transfer is verified by its hash. A mirrored page
    whose bytes do not match the digest the writer sent is not held (nor
    any page after it in the batch); the reply names it, so the writer
    sends it again, and a takeover can never flush bytes nobody wrote."""

    async def main() -> None:
        cache = make_cache(tmp_path, "n2")
        cache.mirror_quota = 8
        server = buddy_of_n1(cache)
        good, bad, after = os.urandom(MiB), os.urandom(MiB), os.urandom(MiB // 2)
        damaged = bytearray(bad)
        damaged[12345] ^= 0x40
        batch = [entry(0, 1, good), entry(1, 2, bad), entry(2, 3, after)]
        payload = good + bytes(damaged) + after
        meta = {"mid": "m1", "file_id": "f1", "pages": batch, "wait": False}
        used = cache.arena.used_slots

        # Buffered (no room reserved up front) ...
        response = await server.handle("n1", Request(PAGE, dict(meta), memoryview(payload)))
        assert response.ok and response.meta["held"] == [0] and response.meta["damaged"] == 1
        assert cache.mirror_slots == 1

        # ... and straight into reserved slots.
        meta["mid"] = "m2"
        placement = server.place("n1", PAGE, dict(meta), len(payload))
        assert placement is not None
        pos = 0
        for view in placement.views:
            view[:] = payload[pos : pos + len(view)]
            pos += len(view)
        try:
            request = Request(PAGE, dict(meta), memoryview(b""), 1, placement)
            response = await server.handle("n1", request)
        finally:
            placement.release()
        assert response.ok and response.meta["held"] == [0] and response.meta["damaged"] == 1
        assert cache.mirror_slots == 2 and cache.mirror_reserved == 0
        assert cache.arena.used_slots == used + 2

        # Sent again intact, the rest is held; the mirror is the writer's bytes.
        response = await server.handle(
            "n1", Request(PAGE, {**meta, "pages": batch[1:]}, memoryview(bad + after))
        )
        assert response.ok and response.meta["held"] == [1, 2] and "damaged" not in response.meta
        m = Manifest("f1", "v1", 2 * MiB + MiB // 2, 0o644, 1, "pending", ["n1", "n2"])
        ram = {0: (1, MiB), 1: (2, MiB), 2: (3, MiB // 2)}
        assert cache.mirror_commit("n1", "m2", m, "a.pt", 0, 0, ram, {}, ChunkMap(), 3) == []
        held = cache.mirrors["m2"]
        assert bytes(await cache.read(held, 0, held.size)) == good + bad + after

    trio.run(main)


# ----- late copies: what a commit superseded never undoes it --------------------


def test_a_late_page_at_or_below_the_commits_floor_leaves_the_committed_version_held(
    tmp_path: Path,
):
    """The writer streamed pages 0-2, then rewrote page 0, truncated page 2
    away and spilled page 1, and committed. Copies of the streamed batches
    arriving after that commit (a retry, a replaced connection) are older
    than its floor: whichever page they carry (dropped at the commit, held
    at a newer generation, held spilled) and whichever way they are
    received, the version stays held, so a takeover would publish it. A
    page above the floor is a write after the commit: new content."""

    async def main() -> None:
        cache = make_cache(tmp_path, "n2")
        cache.mirror_quota = 8
        server = buddy_of_n1(cache)
        old0, new0, page1, page2 = (os.urandom(MiB) for _ in range(4))
        used = cache.arena.used_slots

        async def page(p: int, gen: int, data: bytes, *, placed: bool) -> Response:
            meta = {"mid": "m1", "file_id": "f1", "pages": [entry(p, gen, data)], "wait": False}
            if not placed:
                return await server.handle("n1", Request(PAGE, meta, memoryview(data)))
            placement = server.place("n1", PAGE, meta, len(data))
            assert placement is not None
            placement.views[0][:] = data
            try:
                return await server.handle("n1", Request(PAGE, meta, memoryview(b""), 1, placement))
            finally:
                placement.release()

        for p, gen, data in ((0, 3, old0), (1, 4, page1), (2, 5, page2)):
            assert (await page(p, gen, data, placed=False)).meta["held"] == [p]
        assert (await page(0, 6, new0, placed=True)).meta["held"] == [0]
        m = Manifest("f1", "v1", 2 * MiB, 0o644, 1, "pending", ["n1", "n2"])
        spilled = {1: Chunk(MiB, MiB, "h1")}  # page 1 was spilled at its generation 4
        response = await server.handle("n1", commit_request("m1", m, {0: (6, MiB)}, spilled,
                                                            floor=7))  # fmt: skip
        assert response.ok and response.meta["missing"] == []
        f = cache.held_version("f1", "v1")
        assert f is not None and f.state is FileState.PENDING
        assert cache.mirror_slots == 1 and cache.arena.used_slots == used + 1

        late = [
            (2, 5, page2),  # truncated away: dropped at the commit
            (1, 4, page1),  # held spilled (generation 0 here)
            (0, 3, old0),  # held at a newer generation
            (2, 7, page2),  # at the floor itself
        ]
        for p, gen, data in late:
            for placed in (False, True):
                response = await page(p, gen, data, placed=placed)
                assert response.ok and response.meta["held"] == [p]  # nothing to send again
                assert cache.held_version("f1", "v1") is f, (p, gen, placed)
                assert f.state is FileState.PENDING, (p, gen, placed)
                assert cache.mirror_slots == 1 and cache.mirror_reserved == 0
                assert cache.arena.used_slots == used + 1  # the late copy's slot went back
        assert sorted(f.pages) == [0, 1] and f.pages[1].state is PageState.SPILLED
        assert bytes(await cache.read(f, 0, MiB)) == new0

        # Above the floor: written after the commit, so no longer that version.
        assert (await page(2, 8, page2, placed=True)).meta["held"] == [2]
        assert cache.held_version("f1", "v1") is None and f.state is FileState.MODIFIED
        m2 = Manifest("f1", "v2", 3 * MiB, 0o644, 1, "pending", ["n1", "n2"])
        ram = {0: (6, MiB), 2: (8, MiB)}
        response = await server.handle("n1", commit_request("m1", m2, ram, spilled, floor=8))
        assert response.ok and response.meta["missing"] == []
        assert cache.held_version("f1", "v2") is f
        assert bytes(await cache.read(f, 2 * MiB, MiB)) == page2

    trio.run(main)


def test_a_late_commit_never_replaces_a_newer_one_and_a_commit_needs_its_floor(tmp_path: Path):
    """A copy of an earlier commit that arrives after a newer one (on a
    replaced connection) would take the mirror back to the older version
    while the writer was told the newer one is held: refused. A commit
    without a valid floor (a node older than this one) is malformed."""

    async def main() -> None:
        cache = make_cache(tmp_path, "n2")
        server = buddy_of_n1(cache)
        page0, page1 = os.urandom(MiB), os.urandom(1000)
        assert await cache.mirror_page("n1", "m1", "f1", 0, 5, memoryview(page0), timeout=1)
        m1 = Manifest("f1", "v1", MiB, 0o644, 1, "pending", ["n1", "n2"])
        response = await server.handle("n1", commit_request("m1", m1, {0: (5, MiB)}, floor=5))
        assert response.ok and response.meta["missing"] == []
        # The file grows by a page, and is committed again.
        assert await cache.mirror_page("n1", "m1", "f1", 1, 6, memoryview(page1), timeout=1)
        m2 = Manifest("f1", "v2", MiB + 1000, 0o644, 1, "pending", ["n1", "n2"])
        ram = {0: (5, MiB), 1: (6, 1000)}
        response = await server.handle("n1", commit_request("m1", m2, ram, floor=6))
        assert response.ok and response.meta["missing"] == []
        f = cache.held_version("f1", "v2")
        assert f is not None
        # The first commit again, late: it lists only pages still held.
        response = await server.handle("n1", commit_request("m1", m1, {0: (5, MiB)}, floor=5))
        assert not response.ok and "older than the one held" in str(response.error)
        assert cache.held_version("f1", "v2") is f and cache.held_version("f1", "v1") is None
        assert bytes(await cache.read(f, 0, f.size)) == page0 + page1

        assert await cache.mirror_page("n1", "m2", "f2", 0, 5, memoryview(page1), timeout=1)
        m3 = Manifest("f2", "v1", 1000, 0o644, 1, "pending", ["n1", "n2"])
        for floor in (None, "5", 5.0, True, -1, 4):  # 4: below a page's generation
            response = await server.handle("n1", commit_request("m2", m3, {0: (5, 1000)},
                                                                floor=floor))  # fmt: skip
            assert not response.ok and "floor" in str(response.error), floor
            assert "malformed mirror.commit" in str(response.error)
            assert cache.held_version("f2", "v1") is None
        response = await server.handle("n1", commit_request("m2", m3, {0: (5, 1000)}, floor=5))
        assert response.ok and cache.held_version("f2", "v1") is not None

    trio.run(main)


def writer_and_buddy(
    tmp_path: Path, hold: str | None
) -> tuple[Cache, Cache, MirrorClient, GatedLink]:
    writer, buddy = small_cache(tmp_path, "n1"), small_cache(tmp_path, "n2")
    link = GatedLink(buddy_of_n1(buddy), hold)
    client = mirror_client(writer, link)
    return writer, buddy, client, link


def test_a_streamed_batch_handled_after_the_commit_leaves_the_version_held(tmp_path: Path):
    """The writer's streamer sends pages 0 and 1; the buddy handles that
    batch only after the file was truncated to page 0, committed and
    acknowledged. The buddy must still hold the acknowledged version."""

    async def main() -> None:
        writer, buddy, client, link = writer_and_buddy(tmp_path, hold=PAGE)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(client.run)
            f = writer.new_file("f1", "v0", "a.pt", 0o644, 0, 0)
            data = os.urandom(2 * PS)
            await writer.write(f, 0, data)  # two full pages: one streamed batch
            await link.held.wait()
            await writer.truncate(f, PS)
            assert await commit(writer, client, f) == ["n1", "n2"]
            assert f.state is FileState.PENDING and f.mirror is MirrorState.ACKED
            assert buddy.held_version("f1", f.version) is not None
            link.open.set()  # the streamed batch, with page 1, lands now
            await link.handled.wait()
            await trio.testing.wait_all_tasks_blocked()
            held = buddy.held_version("f1", f.version)
            assert held is not None, "acknowledged but not held"
            assert bytes(await buddy.read(held, 0, held.size)) == data[:PS]
            assert buddy.mirror_slots == 1 == held.ram_count

            # A write after the commit is new content, at the buddy too.
            data = os.urandom(PS)
            await writer.write(f, 0, data)
            await trio.testing.wait_all_tasks_blocked()  # streamed
            assert buddy.held_version("f1", f.version) is None
            assert await commit(writer, client, f) == ["n1", "n2"]
            held = buddy.held_version("f1", f.version)
            assert held is not None and bytes(await buddy.read(held, 0, held.size)) == data
            nursery.cancel_scope.cancel()

    trio.run(main)


async def committed(writer: Cache, client: MirrorClient, **contents: bytes) -> list[CachedFile]:
    """New files (``a`` is file ``fa`` at ``a.pt``) written with ``contents``
    and committed, each acknowledged by the buddy."""
    files = []
    for name, data in contents.items():
        f = writer.new_file(f"f{name}", "v0", f"{name}.pt", 0o644, 0, 0)
        await writer.write(f, 0, data)
        assert await commit(writer, client, f) == ["n1", "n2"]
        files.append(f)
    return files


def test_a_resync_takes_the_commit_lock_and_mirrors_only_unchanged_versions(tmp_path: Path):
    """The buddy comes back and the writer mirrors its acknowledged pending
    files again. While the resync's commit of the first file waits, that
    file grows and is committed again, and the second is written: the newer
    commit must not be undone by the resync's older one, and the second
    file's changed bytes must not be mirrored under its published version."""

    async def main() -> None:
        writer, buddy, client, link = writer_and_buddy(tmp_path, hold=None)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(client.run)
            a_bytes, b_bytes = os.urandom(100), os.urandom(100)
            fa, fb = await committed(writer, client, a=a_bytes, b=b_bytes)
            vb = fb.version
            link.hold = COMMIT  # the resync's commit of fa waits at the gate
            async with trio.open_nursery() as race:
                race.start_soon(client.resync)
                await link.held.wait()
                await writer.write(fb, 0, b"x" * 10)  # a partial page: not streamed
                more = os.urandom(50)
                await writer.write(fa, PS, more)
                race.start_soon(commit, writer, client, fa)
                await trio.testing.wait_all_tasks_blocked()
                # That commit waits for the resync's: nothing went out meanwhile.
                assert link.sent[-1] == COMMIT and link.sent.count(COMMIT) == 3
                link.open.set()
            assert fa.state is FileState.PENDING and fa.mirror is MirrorState.ACKED
            held = buddy.held_version("fa", fa.version)
            assert held is not None, "acknowledged but not held"
            assert bytes(await buddy.read(held, 0, held.size)) == a_bytes + bytes(PS - 100) + more
            assert fb.state is FileState.MODIFIED
            held = buddy.held_version("fb", vb)
            assert held is None or bytes(await buddy.read(held, 0, held.size)) == b_bytes
            nursery.cancel_scope.cancel()

    trio.run(main)


def restarted_buddy(tmp_path: Path, link: GatedLink, name: str) -> Cache:
    """The buddy's daemon restarted empty: a new cache behind the same link."""
    fresh = small_cache(tmp_path, name, node="n2")
    link.server = buddy_of_n1(fresh)
    return fresh


def test_a_resync_follows_a_pending_version_that_a_rewrite_moved_aside(tmp_path: Path):
    """The buddy restarts; while the resync's commit of one file waits, the
    trainer saves over another (truncate to 0, as torch.save to the same
    name): its pending version moves to a retired file with the same mirror
    id. The restarted buddy must hold that version all the same: the pending
    manifest still names it as a holder."""

    async def main() -> None:
        writer, _, client, link = writer_and_buddy(tmp_path, hold=None)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(client.run)
            a_bytes = os.urandom(3000)
            fx, fa = await committed(writer, client, x=os.urandom(100), a=a_bytes)
            va = fa.version
            buddy = restarted_buddy(tmp_path, link, "n2b")
            link.hold = COMMIT  # the resync's commit of the first file waits
            async with trio.open_nursery() as race:
                race.start_soon(client.resync)
                await link.held.wait()
                await writer.truncate(fa, 0)
                await writer.write(fa, 0, b"new" * 10)
                link.open.set()
            (old,) = [r for r in writer.retired if r.file_id == "fa" and r.version == va]
            assert old.state is FileState.PENDING and old.mirror is MirrorState.ACKED
            held = buddy.held_version("fa", va)
            assert held is not None, "the pending version moved aside is not mirrored again"
            assert bytes(await buddy.read(held, 0, held.size)) == a_bytes
            assert buddy.held_version("fx", fx.version) is not None
            nursery.cancel_scope.cancel()

    trio.run(main)


def restarted_writer(
    tmp_path: Path, link: GatedLink, crashed: Cache, f: CachedFile, holders: list[str]
) -> tuple[Cache, MirrorClient, CachedFile]:
    """The writer's daemon crashed and came back: a new cache over the same
    arena file adopts ``f``'s pending version from its journal record (as
    written to disk), as recovery does when the pending manifest names
    ``holders``."""
    record = json.loads(json.dumps(record_of(crashed.journal_snapshot(f))))
    writer = small_cache(tmp_path, "n1")
    adopted = writer.adopt(record, holders)
    writer.arena.claim({entry[0] for entry in record["dirty"].values()})
    client = mirror_client(writer, link)
    return writer, client, adopted


def test_a_recovered_version_goes_on_with_the_buddys_copy(tmp_path: Path):
    """After a crash of the writer's daemon, recovery adopts a pending version
    the buddy acknowledged. It keeps its mirror id and page generations, so a
    rename of it reaches the buddy's copy (its takeover looks at the name),
    and the resync finds the buddy's copy complete: one commit, no page sent
    again, one copy held. A buddy that lost it is sent the pages the commit
    says it lacks."""

    async def main() -> None:
        crashed, buddy, old_client, link = writer_and_buddy(tmp_path, hold=None)
        data = os.urandom(2 * PS + 123)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(old_client.run)
            (f,) = await committed(crashed, old_client, a=data)
            nursery.cancel_scope.cancel()
        kept = buddy.mirrors[f.mirror_id]
        assert kept.state is FileState.PENDING

        writer, client, g = restarted_writer(tmp_path, link, crashed, f, ["n1", "n2"])
        assert g.mirror is MirrorState.ACKED and g.mirror_id == f.mirror_id
        assert g.holders == ["n1", "n2"]
        async with trio.open_nursery() as nursery:
            nursery.start_soon(client.run)
            await client.renaming([(g, "final.pt")])
            g.path = "final.pt"
            assert kept.path == "final.pt"

            link.sent.clear()
            assert await client.resync() == 1
            assert link.sent == [COMMIT], link.sent  # nothing sent again
            assert buddy.mirrors == {g.mirror_id: kept} and kept.state is FileState.PENDING
            assert kept.version == g.version and kept.path == "final.pt"
            assert bytes(await buddy.read(kept, 0, kept.size)) == data
            assert buddy.mirror_slots == 3 == kept.ram_count

            fresh = restarted_buddy(tmp_path, link, "n2b")
            assert await client.resync() == 1
            held = fresh.held_version("fa", g.version)
            assert held is not None and held.path == "final.pt"
            assert bytes(await fresh.read(held, 0, held.size)) == data
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_a_write_to_a_recovered_version_streams_above_the_crashed_generations(tmp_path: Path):
    """New content in a recovered file (the job writes the same name again)
    goes on under its mirror id with generations above the crashed
    process's, so the buddy takes it as new content rather than as late
    copies. A version whose manifest names only this node has no mirror, and
    a journal record of an older daemon (no generations) gets a new id."""

    async def main() -> None:
        crashed, buddy, old_client, link = writer_and_buddy(tmp_path, hold=None)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(old_client.run)
            (fb,) = await committed(crashed, old_client, b=os.urandom(PS))
            fa = crashed.new_file("fa", "v0", "a.pt", 0o644, 0, 0)
            await crashed.write(fa, 0, os.urandom(2 * PS))
            await crashed.truncate(fa, PS)  # the floor is then above every page's generation
            assert await commit(crashed, old_client, fa) == ["n1", "n2"]
            nursery.cancel_scope.cancel()
        floor = buddy.mirrors[fa.mirror_id].mirror_floor
        assert floor > max(page.gen for page in fa.pages.values())
        writer, client, g = restarted_writer(tmp_path, link, crashed, fa, ["n1", "n2"])
        assert g.content_gen > floor
        _, _, alone = restarted_writer(tmp_path, link, crashed, fb, ["n1"])
        assert alone.mirror is MirrorState.NONE and alone.mirror_id != fb.mirror_id
        assert alone.holders == ["n1"]
        old_record = record_of(crashed.journal_snapshot(fb))
        old_record["dirty"] = {p: entry[:2] for p, entry in old_record["dirty"].items()}
        older = small_cache(tmp_path, "n1").adopt(old_record, ["n1", "n2"])
        assert older.mirror is MirrorState.NONE and older.mirror_id != fb.mirror_id
        async with trio.open_nursery() as nursery:
            nursery.start_soon(client.run)
            data = os.urandom(PS)
            await writer.write(g, 0, data)
            assert g.state is FileState.MODIFIED and g.mirror_id == fa.mirror_id
            assert g.pages[0].gen > floor
            assert await commit(writer, client, g) == ["n1", "n2"]
            held = buddy.held_version("fa", g.version)
            assert held is not None and bytes(await buddy.read(held, 0, held.size)) == data
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_a_rename_that_crosses_a_resyncs_commit_is_still_found_by_the_takeover(tmp_path: Path):
    """The buddy restarts and the resync's commit of a file, built with its
    temporary name, is on its way when the job renames the file (os.replace
    after torch.save): the rename's message reaches the buddy first, then
    the commit with the old name. The buddy's takeover must still find the
    file at its new name."""

    async def main() -> None:
        writer, _, client, link = writer_and_buddy(tmp_path, hold=None)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(client.run)
            data = os.urandom(PS + 7)
            (f,) = await committed(writer, client, a=data)
            buddy = restarted_buddy(tmp_path, link, "n2b")
            link.hold = COMMIT
            async with trio.open_nursery() as race:
                race.start_soon(client.resync)
                await link.held.wait()  # its body names a.pt
                await client.renaming([(f, "final.pt")])
                f.path = "final.pt"
                link.open.set()
            held = buddy.held_version("fa", f.version)
            assert held is not None and f.mirror is MirrorState.ACKED

            async def manifest_at(path: str) -> Manifest | None:
                if path != "final.pt":
                    raise FileNotFoundError(path)
                return pending("fa", f.version, ["n1", "n2"])

            server = MirrorServer(buddy, mirrored_for=("n1",), timeout=0.2,
                                  manifest_at=manifest_at, is_alive=lambda name: False)  # fmt: skip
            assert await server.take_over("n1") == 1
            assert held.role is FileRole.TAKEOVER and held.path == "final.pt"
            assert bytes(await buddy.read(held, 0, held.size)) == data
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_a_resync_waits_for_a_commit_being_published_and_mirrors_it_again(tmp_path: Path):
    """The buddy acknowledged a commit and restarted while the writer was
    still writing the pending manifest (a slow store). The resync must wait
    for that publish and mirror the version again: close() said mirrored."""

    async def main() -> None:
        writer, _, client, link = writer_and_buddy(tmp_path, hold=None)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(client.run)
            f = writer.new_file("f1", "v0", "a.pt", 0o644, 0, 0)
            data = os.urandom(PS + 500)
            await writer.write(f, 0, data)
            resynced: list[int] = []

            async def resync() -> None:
                resynced.append(await client.resync())

            async with f.commit_lock:
                snap = writer.begin_publish(f, "v1")
                manifest = Manifest(f.file_id, "v1", snap.size, f.mode, f.mtime_ns)
                snap.holders = await client.commit(snap, manifest)
                assert snap.holders == ["n1", "n2"]
                # ...the pending manifest is being written; the buddy restarts,
                # and the membership sees its new incarnation.
                buddy = restarted_buddy(tmp_path, link, "n2b")
                nursery.start_soon(resync)
                await trio.testing.wait_all_tasks_blocked()
                assert not resynced  # it waits for this publish
                writer.published(snap)
            with trio.fail_after(10):
                while not resynced:
                    await trio.sleep(0.01)
            assert resynced == [1]
            assert f.state is FileState.PENDING and f.mirror is MirrorState.ACKED
            held = buddy.held_version("f1", "v1")
            assert held is not None, "close() said mirrored, the restarted buddy holds nothing"
            assert bytes(await buddy.read(held, 0, held.size)) == data
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_a_spilled_page_truncated_inside_reads_as_zeros_at_the_buddy(tmp_path: Path):
    """Page 0 spilled under memory pressure, then the file was truncated
    inside it and extended again: past the truncation the page reads as
    zeros at the writer, and must at the buddy (which would otherwise serve,
    and on a takeover publish, the old bytes)."""

    async def main() -> None:
        writer, buddy, client, link = writer_and_buddy(tmp_path, hold=None)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(client.run)
            f = writer.new_file("f1", "v0", "a.pt", 0o644, 0, 0)
            await writer.write(f, 0, os.urandom(PS))
            await trio.testing.wait_all_tasks_blocked()
            await writer._spill_page(f, 0)
            assert f.pages[0].state is PageState.SPILLED
            await writer.truncate(f, 100)
            await writer.truncate(f, 2 * PS)
            assert await commit(writer, client, f) == ["n1", "n2"]
            mine = bytes(await writer.read(f, 0, 2 * PS))
            assert mine[100:] == bytes(2 * PS - 100)
            held = buddy.held_version("f1", f.version)
            assert held is not None
            assert bytes(await buddy.read(held, 0, 2 * PS)) == mine
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_a_file_that_falls_back_is_not_recorded_as_mirrored(tmp_path: Path):
    """The checkpoint history's mirrored_s is when the buddy acknowledged the
    content; a file that then fell back to local durability (a failed resync,
    a retried publish) must not keep it."""
    cache = small_cache(tmp_path, "n1")
    f = cache.new_file("f1", "v0", "a.pt", 0o644, 0, 0)
    cache.set_mirror(f, MirrorState.ACKED)
    assert f.mirrored_at is not None
    cache.set_mirror(f, MirrorState.FALLBACK)
    assert f.mirrored_at is None


def test_a_mirror_dropped_while_a_handle_here_reads_its_version_is_kept_for_it(tmp_path: Path):
    """The buddy has a version of n1's file open here (REMOTE, read from its
    own mirror) when n1 lets go of the mirror: replaced or removed there
    (drop of any version), or durable (drop of that version). The mirror is
    kept (KEPT) for the handle: read here and served to peers, never taken
    over, its RAM still counted, dropped when the last handle goes. A drop
    with no handle here drops it; an open of such a version is sent back."""

    async def main() -> None:
        cache = make_cache(tmp_path, "n2")
        cache.peer_fetch = _unreachable_peers  # peers exist: pending elsewhere is REMOTE
        for n, version in enumerate(["", "v1"]):
            mid, data = f"m{n}", os.urandom(MiB + 77)
            assert await cache.mirror_page("n1", mid, "f1", 0, 1, memoryview(data[:MiB]), timeout=1)
            assert await cache.mirror_page("n1", mid, "f1", 1, 2, memoryview(data[MiB:]), timeout=1)
            m = Manifest("f1", "v1", len(data), 0o644, 1, "pending", ["n1", "n2"])
            ram = {0: (1, MiB), 1: (2, 77)}
            assert cache.mirror_commit("n1", mid, m, "a.pt", 0, 0, ram, {}, ChunkMap(), 2) == []
            f = cache.load(m, "a.pt", 0, 0)
            assert f.role is FileRole.REMOTE and not cache.dropped_here(f)
            f.handles += 1  # a reader's handle (filesystem.open)
            assert cache.mirror_drop("n1", mid, version)
            assert mid not in cache.mirrors and cache.mirror_slots == 2
            kept = cache.held_version("f1", "v1")
            assert kept is not None and kept.role is FileRole.KEPT
            assert await cache.read(f, 0, len(data)) == data  # through the kept mirror
            assert await cache.read_held("f1", "v1", MiB, 77) == data[MiB:]  # for a peer
            assert not cache.mirrors_of("n1")  # nothing for a takeover
            assert not cache.dropped_here(f)  # held here: an open of it may go on
            f.handles -= 1
            cache.let_go(f)
            assert cache.held_version("f1", "v1") is None
            assert cache.mirror_slots == 0 and cache.arena.used_slots == 0
            assert not cache.kept_mirrors and cache.mirrors_kept == n + 1
            assert cache.dropped_here(f)  # nothing holds it here any more
            cache.unlink(f)

        # No handle here when the drop comes: dropped at once.
        data = os.urandom(1000)
        assert await cache.mirror_page("n1", "m9", "f2", 0, 1, memoryview(data), timeout=1)
        m = Manifest("f2", "v1", len(data), 0o644, 1, "pending", ["n1", "n2"])
        assert cache.mirror_commit("n1", "m9", m, "b.pt", 0, 0, {0: (1, 1000)}, {},
                                   ChunkMap(), 1) == []  # fmt: skip
        g = cache.load(m, "b.pt", 0, 0)
        assert cache.mirror_drop("n1", "m9", "")
        assert cache.held_version("f2", "v1") is None and cache.mirror_slots == 0
        assert cache.dropped_here(g)

    trio.run(main)


def test_a_drop_from_a_writer_dead_to_us_cannot_empty_a_mirror_a_takeover_flushes(
    tmp_path: Path,
):
    """The takeover reads the file's manifest before it takes the mirror
    over; meanwhile a DROP comes from the writer, "dead" to this node but
    still running (an asymmetric partition, slow heartbeats). The drop must
    not free the pages of the mirror the takeover then flushes: taken over,
    it reads back whole; it is never a file of holes published as durable."""

    async def main() -> None:
        cache = make_cache(tmp_path, "n2")
        queued: list[CachedFile] = []
        cache.on_pending = queued.append
        data = os.urandom(MiB + 1000)
        assert await cache.mirror_page("n1", "m1", "f1", 0, 1, memoryview(data[:MiB]), timeout=1)
        assert await cache.mirror_page("n1", "m1", "f1", 1, 2, memoryview(data[MiB:]), timeout=1)
        m = pending("f1", "v1", ["n1", "n2"])
        m.size = len(data)
        ram = {0: (1, MiB), 1: (2, 1000)}
        assert cache.mirror_commit("n1", "m1", m, "a.pt", 0, 0, ram, {}, ChunkMap(), 2) == []
        reading, answer = trio.Event(), trio.Event()

        async def manifest_at(path: str) -> Manifest | None:
            reading.set()
            await answer.wait()
            return m

        server = MirrorServer(cache, mirrored_for=("n1",), timeout=0.2,
                              manifest_at=manifest_at, is_alive=lambda name: False)  # fmt: skip
        taken: list[int] = []
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lambda: _append(taken, server.take_over("n1")))
            await reading.wait()
            reply = await server.handle("n1", Request(DROP, {"drops": [["m1", "v1"]]}, b""))
            answer.set()
        assert not reply.ok  # a dead writer's mirrors are the takeover's
        assert taken == [1] and len(queued) == 1
        (f,) = queued
        assert f.role is FileRole.TAKEOVER
        assert bytes(await cache.read(f, 0, len(data))) == data

    trio.run(main)


async def _append(out: list[Any], awaitable: Any) -> None:
    out.append(await awaitable)


def test_a_mirror_dropped_during_a_takeovers_look_is_not_taken_over(tmp_path: Path):
    """However a mirror is dropped while a takeover looks at its manifest
    (its writer's sweep, a restart), the takeover queues no file whose pages
    are gone."""

    async def main() -> None:
        cache = make_cache(tmp_path, "n2")
        queued: list[CachedFile] = []
        cache.on_pending = queued.append
        data = os.urandom(1000)
        assert await cache.mirror_page("n1", "m1", "f1", 0, 1, memoryview(data), timeout=1)
        m = pending("f1", "v1", ["n1", "n2"])
        m.size = len(data)
        assert cache.mirror_commit("n1", "m1", m, "a.pt", 0, 0, {0: (1, 1000)}, {}, ChunkMap(),
                                   1) == []  # fmt: skip

        async def manifest_at(path: str) -> Manifest | None:
            assert cache.mirror_drop("n1", "m1", "v1")  # while the look is on its way
            return m

        server = MirrorServer(cache, mirrored_for=("n1",), timeout=0.2,
                              manifest_at=manifest_at, is_alive=lambda name: False)  # fmt: skip
        assert await server.take_over("n1") == 0 and queued == []

    trio.run(main)


def test_a_restarted_writers_takeover_takes_only_what_its_old_process_committed(
    tmp_path: Path,
):
    """n1 came back as process "new" before it was missed. Its old process's
    committed mirror is taken over; what the new one committed, and what
    it is sending now (uncommitted), stay mirrors of the live writer."""

    async def main() -> None:
        cache = make_cache(tmp_path, "n2")
        queued: list[CachedFile] = []
        cache.on_pending = queued.append
        data = {f"f{i}": os.urandom(1000 + i) for i in (1, 2, 3)}
        for i, (fid, body) in enumerate(data.items(), 1):
            mid = f"m{i}"
            assert await cache.mirror_page("n1", mid, fid, 0, 1, memoryview(body), timeout=1)
            if i == 3:
                continue  # still being sent
            m = pending(fid, "v1", ["n1", "n2"])
            m.size = len(body)
            ram = {0: (1, len(body))}
            incarnation = "old" if i == 1 else "new"
            assert cache.mirror_commit("n1", mid, m, f"{fid}.pt", 0, 0, ram, {}, ChunkMap(), 1,
                                       incarnation) == []  # fmt: skip

        async def manifest_at(path: str) -> Manifest | None:
            fid = path.removesuffix(".pt")
            m = pending(fid, "v1", ["n1", "n2"])
            m.size = len(data[fid])
            return m

        server = MirrorServer(cache, mirrored_for=("n1",), timeout=0.2,
                              manifest_at=manifest_at, is_alive=lambda name: True)  # fmt: skip
        assert await server.take_over("n1", restarted_as="new") == 1
        (f,) = queued
        assert f.file_id == "f1" and f.role is FileRole.TAKEOVER
        assert bytes(await cache.read(f, 0, len(data["f1"]))) == data["f1"]
        for mid in ("m2", "m3"):
            assert cache.mirrors[mid].role is FileRole.MIRROR
        assert cache.mirrors["m2"].state is FileState.PENDING

    trio.run(main)


def test_a_takeover_never_publishes_over_the_version_made_durable(tmp_path: Path):
    """The writer made the version durable (it only seemed dead): the fenced
    publish of the takeover, matched by file id and version, must leave
    the durable manifest, with its chunk list, as it is."""
    (tmp_path / "d").mkdir()
    made = Manifest("f1", "v1", 10, 0o644, 1, "durable", ["n1"], [Chunk(0, 10, "0" * 32)])
    write_store_manifest(tmp_path / "d" / "a.pt", made, backing=tmp_path)

    async def main() -> None:
        b = Backing(tmp_path, BackingIO(5))
        r = await b.takeover_manifest("d/a.pt", durable("f1", "v1"), file_id="f1",
                                      expect_version="v1")  # fmt: skip
        assert r is Published.STALE
        assert read_manifest(tmp_path / "d" / "a.pt") == made

    trio.run(main)


def test_a_manifest_a_takeover_left_aside_is_put_back_before_anyone_calls_the_name_gone(
    tmp_path: Path,
):
    """A takeover that died (or could not put the manifest back) between
    moving the name's manifest aside and linking one in leaves the name
    empty: the next takeover, the writer's own publish and recovery each
    put it back first, unless a live takeover holds the file's fence."""
    (tmp_path / "d").mkdir()
    aside = tmp_path / "d" / ".a.pt.ckptfs-tmp.aside-f1"

    def left_aside() -> None:
        write_store_manifest(tmp_path / "d" / "a.pt", pending("f1", "v1", ["n1", "n2"]),
                             backing=tmp_path)  # fmt: skip
        os.rename(tmp_path / "d" / "a.pt", aside)

    async def main() -> None:
        b = Backing(tmp_path, BackingIO(5))
        try:
            left_aside()
            r = await b.takeover_manifest("d/a.pt", durable("f1", "v1"), file_id="f1",
                                          expect_version="v1")  # fmt: skip
            assert r is Published.DONE
            assert read_manifest(tmp_path / "d" / "a.pt").state == "durable"
            assert os.listdir(tmp_path / "d") == ["a.pt"]
            # A live takeover's fence: its manifest aside is not left over.
            os.unlink(tmp_path / "d" / "a.pt")
            left_aside()
            fence = tmp_path / ".ckptfs" / "fence" / "f1"
            fence.write_text(json.dumps({"node": "n2", "path": "d/a.pt"}))
            with pytest.raises(OSError) as held:  # neither here nor gone
                await b.restore_aside("d/a.pt", "f1")
            assert held.value.errno == errno.EBUSY
            assert aside.exists() and not (tmp_path / "d" / "a.pt").exists()
            # The node that held the fence comes back: its takeover is over.
            assert await b.restore_own_fences("n3") == []
            assert fence.exists()
            assert await b.restore_own_fences("n2") == ["d/a.pt"]
            assert not fence.exists() and not aside.exists()
            os.rename(tmp_path / "d" / "a.pt", aside)
            assert await b.restore_aside("d/a.pt", "f1")
            m = read_manifest(tmp_path / "d" / "a.pt")
            assert (m.version, m.state) == ("v1", "pending")
            assert os.listdir(tmp_path / "d") == ["a.pt"]
            # The writer, alive after all, publishes its version durable.
            os.rename(tmp_path / "d" / "a.pt", aside)
            r = await b.replace_manifest("d/a.pt", durable("f1", "v1"), (0, 0), file_id="f1",
                                         expect_version="v1")  # fmt: skip
            assert r is Published.DONE
            assert read_manifest(tmp_path / "d" / "a.pt").state == "durable"
            assert os.listdir(tmp_path / "d") == ["a.pt"]
        finally:
            b.close()

    trio.run(main)


def test_what_a_user_or_a_forged_fence_puts_aside_is_never_put_back_or_followed(
    tmp_path: Path,
):
    """A symlink or directory a user puts at a file's aside name is no
    manifest moved aside: not linked to the name; a fence naming a path out
    of the backing directory is left alone."""
    (tmp_path / "d").mkdir()
    outside = tmp_path.parent / f"{tmp_path.name}-outside"
    outside.mkdir()
    (outside / "secret").write_bytes(b"not the store's")
    aside = tmp_path / "d" / ".a.pt.ckptfs-tmp.aside-f1"

    async def main() -> None:
        b = Backing(tmp_path, BackingIO(5))
        try:
            os.symlink(outside / "secret", aside)
            assert not await b.restore_aside("d/a.pt", "f1")
            assert not (tmp_path / "d" / "a.pt").exists() and aside.is_symlink()
            aside.unlink()
            aside.mkdir()
            assert not await b.restore_aside("d/a.pt", "f1")
            assert not (tmp_path / "d" / "a.pt").exists()
            fence = tmp_path / ".ckptfs" / "fence" / "f2"
            fence.write_text(json.dumps({"node": "n2", "path": "../" + outside.name + "/secret"}))
            assert await b.restore_own_fences("n2") == []
            assert sorted(os.listdir(outside)) == ["secret"]
        finally:
            b.close()

    trio.run(main)
