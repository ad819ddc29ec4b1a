"""Mirroring across an await: a decision made before it, about a mirror or a
file that a peer's message (or another task on the loop) changes meanwhile,
must not be acted on after it. Each test pauses one task at an await, lets
the message in, and lets the task go on."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import trio
import trio.testing
from caches import make_cache
from ckptfs.fs.content.cachedfile import ChunkMap
from ckptfs.fs.content.state import FileRole, FileState, MirrorState
from ckptfs.fs.store.backing import Backing
from ckptfs.fs.store.blocking import BackingIO
from ckptfs.fs.store.manifest import Manifest
from ckptfs.fs.store.publish import Published
from ckptfs.peer.mirror import server as mirror_mod
from ckptfs.peer.mirror.server import MirrorServer
from ckptfs.peer.mirror.wire import COMMIT, PAGE, RENAME, page_digest
from ckptfs.peer.transport.transport import Request, Response
from manifests import write_store_manifest
from mirrors import PS, GatedLink, commit, durable, mirror_client, pending, small_cache


def _server(cache: Any, alive: dict[str, bool], manifest_at: Any) -> MirrorServer:
    return MirrorServer(cache, mirrored_for=("n1",), timeout=0.2, manifest_at=manifest_at,
                        is_alive=lambda name: alive[name])  # fmt: skip


async def _mirrored(cache: Any, mid: str, data: bytes, path: str) -> Any:
    """n1's version v1 of file f1 (one page of ``data``), committed at ``path``."""
    assert await cache.mirror_page("n1", mid, "f1", 0, 1, memoryview(data), timeout=1)
    m = pending("f1", "v1", ["n1", "n2"])
    m.size = len(data)
    ram = {0: (1, len(data))}
    assert cache.mirror_commit("n1", mid, m, path, 0, 0, ram, {}, ChunkMap(), 1) == []
    return cache.mirrors[mid]


def test_a_rename_announced_while_a_takeover_looks_is_where_it_publishes(tmp_path: Path):
    """The takeover reads the manifest at the mirror's temporary name; meanwhile
    the writer (dead to this node, still running: an asymmetric partition)
    announces its rename (os.replace after torch.save) and renames the file
    in the store, after the read found the manifest. Then the writer dies.
    The takeover must publish at the new name: at the old one its fenced
    publish finds nothing, and the only copy of a closed file is dropped."""
    store = tmp_path / "store"
    store.mkdir()

    async def main() -> None:
        cache = make_cache(tmp_path, "n2")
        data = os.urandom(1000)
        f = await _mirrored(cache, "m1", data, "tmp.pt")
        write_store_manifest(store / "tmp.pt", pending("f1", "v1", ["n1", "n2"]), backing=store)
        b = Backing(store, BackingIO(5))

        async def manifest_at(path: str) -> Manifest | None:
            m = await b.manifest(path)
            if path == "tmp.pt":  # found; the writer's rename goes on meanwhile
                assert cache.mirror_rename("n1", "m1", "final.pt")
                os.rename(store / "tmp.pt", store / "final.pt")
            return m

        server = _server(cache, {"n1": False}, manifest_at)
        assert await server.take_over("n1") == 1
        assert f.role is FileRole.TAKEOVER
        assert f.path == "final.pt", "the takeover went back to a name the writer left"
        result = await b.takeover_manifest(
            f.path, durable("f1", "v1"), file_id="f1", expect_version="v1"
        )
        assert result is Published.DONE

    trio.run(main)


def test_a_page_that_waited_for_room_while_its_writer_died_is_not_held(tmp_path: Path):
    """n1 rewrites a closed file in place; a page of it waits at the buddy
    for room in the mirror space, and meanwhile n1 is declared dead. The
    page must then be refused, as it would have been had it come a moment
    later: held, it makes the closed version's mirror new, uncommitted
    content, which the takeover drops (the closed file is lost) or, if the
    takeover looked at it already, leaves held for ever."""

    async def main() -> None:
        cache = make_cache(tmp_path, "n2")
        data = os.urandom(1000)
        f = await _mirrored(cache, "m1", data, "a.pt")
        alive = {"n1": True}
        m = pending("f1", "v1", ["n1", "n2"])

        async def manifest_at(path: str) -> Manifest | None:
            return m

        server = _server(cache, alive, manifest_at)
        cache.mirror_quota = cache.mirror_slots  # full: the page waits for room
        new = os.urandom(500)
        meta = {"mid": "m1", "file_id": "f1", "pages": [[1, 5, len(new), page_digest(new, 1, 5)]],
                "wait": True}  # fmt: skip
        replies: list[Response] = []

        async def send() -> None:
            replies.append(await server.handle("n1", Request(PAGE, meta, memoryview(new))))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(send)
            await trio.testing.wait_all_tasks_blocked()
            assert not replies  # waiting for room
            alive["n1"] = False  # the membership declares n1 dead...
            cache.mirror_quota += 1  # ...and room frees up
            cache._signal_space()
        (reply,) = replies
        assert not (reply.ok and reply.meta.get("held")), "a dead writer's page was held"
        assert f.state is FileState.PENDING
        assert await server.take_over("n1") == 1
        assert f.role is FileRole.TAKEOVER
        assert bytes(await cache.read(f, 0, f.size)) == data

    trio.run(main)


class _ReplyGate(GatedLink):
    """A GatedLink that holds the reply, not the request: the buddy has
    handled the first request of type ``hold`` when the gate closes."""

    async def request(self, rtype: str, meta: dict[str, Any], payload: bytes = b"",
                      **kwargs: Any) -> Response:  # fmt: skip
        if rtype == RENAME:
            self.sent.append(rtype)
            return Response.fail("refused in this test")  # the rename's message fails
        gated = rtype == self.hold and not self.held.is_set()
        if not gated:
            return await super().request(rtype, meta, payload, **kwargs)
        self.hold = None
        response = await super().request(rtype, meta, payload, **kwargs)
        self.held.set()
        await self.open.wait()
        return response


def test_a_file_that_falls_back_during_its_commit_does_not_name_the_buddy(tmp_path: Path):
    """The buddy took the commit; before its answer reaches the commit, a
    rename of the file fails to tell the buddy, and the file falls back to
    local durability: its mirror is dropped at the buddy. The commit must
    then not name the buddy as a holder in the manifest, nor call the file
    mirrored: no copy of it is there."""

    async def main() -> None:
        writer, buddy = small_cache(tmp_path, "n1"), small_cache(tmp_path, "n2")
        link = _ReplyGate(_server(buddy, {"n1": True}, None), hold=COMMIT)
        client = mirror_client(writer, link)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(client.run)
            f = writer.new_file("f1", "v0", "a.pt", 0o644, 0, 0)
            await writer.write(f, 0, os.urandom(PS + 10))
            holders: list[list[str]] = []

            async def close() -> None:
                holders.append(await commit(writer, client, f))

            nursery.start_soon(close)
            await link.held.wait()
            await client.renaming([(f, "b.pt")])
            assert f.mirror is MirrorState.FALLBACK
            await trio.testing.wait_all_tasks_blocked()  # its drop reached the buddy
            link.open.set()
            await trio.testing.wait_all_tasks_blocked()
            (named,) = holders
            if "n2" in named:
                assert buddy.held_version("f1", f.version) is not None, (
                    "the manifest names a buddy that dropped the file"
                )
            assert named == ["n1"] and f.mirror is MirrorState.FALLBACK
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_the_sweep_keeps_a_mirror_renamed_while_it_looked(tmp_path: Path, monkeypatch):
    """The sweep reads the manifest at an old mirror's name; meanwhile the
    writer renames the file (its message comes first, then the store's
    rename) and writes another file at the old name. The sweep must keep
    the mirror: the version is still pending at its new name."""

    async def main() -> None:
        cache = make_cache(tmp_path, "n2")
        f = await _mirrored(cache, "m1", os.urandom(1000), "a.pt")
        f.closed_at = time.time() - 2 * mirror_mod.SWEEP_AGE

        async def manifest_at(path: str) -> Manifest | None:
            assert path == "a.pt"
            assert cache.mirror_rename("n1", "m1", "b.pt")
            return pending("f9", "v9", ["n1", "n2"])  # the other file now at a.pt

        server = _server(cache, {"n1": True}, manifest_at)
        await server.sweep_once()
        assert cache.held_version("f1", "v1") is f and f.path == "b.pt"

    trio.run(main)


def test_a_rename_announced_before_the_buddy_knew_the_file_is_kept_for_its_takeover(
    tmp_path: Path,
):
    """A small file (no page streamed yet) is closed while another thread
    renames it. The rename tells the buddy first, before the commit's first
    page has made the mirror there; the commit, built while the rename is
    in the store, names the old path. Then the writer dies: the takeover
    must find the closed file at its new name (at the old one its fenced
    publish finds nothing, and the closed file is dropped)."""

    async def main() -> None:
        writer, buddy = small_cache(tmp_path, "n1"), small_cache(tmp_path, "n2")
        link = GatedLink(_server(buddy, {"n1": True}, None), hold=PAGE)
        client = mirror_client(writer, link)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(client.run)
            f = writer.new_file("f1", "v0", "tmp.pt", 0o644, 0, 0)
            data = os.urandom(100)
            await writer.write(f, 0, data)
            nursery.start_soon(commit, writer, client, f)
            await link.held.wait()  # the commit's first page is on its way
            await client.renaming([(f, "final.pt")])
            link.open.set()
            await trio.testing.wait_all_tasks_blocked()  # committed, as tmp.pt
            f.path = "final.pt"  # the rename's store call is done
            nursery.cancel_scope.cancel()
        assert f.state is FileState.PENDING and f.mirror is MirrorState.ACKED

        async def manifest_at(path: str) -> Manifest | None:
            if path != "final.pt":
                raise FileNotFoundError(path)
            return pending("f1", f.version, ["n1", "n2"])

        server = _server(buddy, {"n1": False}, manifest_at)
        assert await server.take_over("n1") == 1
        (held,) = buddy.taken_over()
        assert held.path == "final.pt", "the takeover publishes where the file no longer is"
        assert bytes(await buddy.read(held, 0, held.size)) == data

    trio.run(main)
