"""A model test of buddy mirroring, without FUSE or sockets.

Hypothesis drives a writer's cache and its buddy's cache, joined by an
in-process link that stands in for the peer connection (and yields to the
other tasks a drawn number of times before and after each request), through
random sequences of writes of random bytes, truncations (to 0 of a pending
file: a fork), commits (close), commits racing a write, unlinks, the buddy
going down and coming back, with the writer's background streamer running
all along. After every step:

- every pending file whose buddy acknowledged it (mirror ACKED) is held by
  the buddy at exactly its version, with exactly the writer's bytes: a holder
  named in a manifest always has the bytes;
- no mirror outlives the writer's content it mirrors (drops arrive);
- the buddy's mirror slot count matches its mirrors' pages.
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import trio
import trio.testing
from caches import make_cache, read_all
from ckptfs.fs.content.cachedfile import CachedFile
from ckptfs.fs.content.state import FileState, MirrorState
from ckptfs.fs.store.manifest import Manifest, new_id
from ckptfs.peer.mirror.client import MirrorClient
from ckptfs.peer.mirror.server import MirrorServer
from ckptfs.peer.transport.transport import Request, Response
from ckptfs.peer.transport.wire import PeerError
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

PS = 4096
NAMES = st.sampled_from(["a", "b", "c"])
OFFSETS = st.sampled_from([0, 1, PS - 3, PS, 2 * PS + 100, 5 * PS - 1, 9 * PS])
SIZES = st.sampled_from([1, 100, PS - 1, PS, PS + 1, 3 * PS + 5, 7 * PS])
YIELDS = st.lists(st.integers(0, 5), max_size=8)
OPS = st.one_of(
    st.tuples(st.just("write"), NAMES, OFFSETS, SIZES, st.integers(0, 1 << 30)),
    st.tuples(st.just("truncate"), NAMES, st.sampled_from([0, 0, 1, PS + 7, 6 * PS])),
    st.tuples(st.just("commit"), NAMES),
    st.tuples(st.just("commit+write"), NAMES, OFFSETS, SIZES, st.integers(0, 1 << 30)),
    st.tuples(st.just("unlink"), NAMES),
    st.tuples(st.just("buddy"), st.booleans()),
)


class Link:
    """The writer's PeerClient and PeerConnection in one, calling the buddy's
    handler in-process; ``up`` False makes every request fail as a dead peer's."""

    def __init__(self, server: MirrorServer, yields: list[int]) -> None:
        self.server = server
        self.yields = yields
        self.i = 0
        self.up = True
        self.close_reason: str | None = None
        self.requests = 0

    @property
    def closed(self) -> bool:
        return self.close_reason is not None

    async def _yield(self) -> None:
        n = self.yields[self.i % len(self.yields)] if self.yields else 0
        self.i += 1
        for _ in range(n):
            await trio.sleep(0)

    async def connect(self, host: str, port: int, *, expect_node: str, timeout: float) -> Link:
        if not self.up:
            raise PeerError("connection refused")
        return self

    async def request(
        self,
        rtype: str,
        meta: dict[str, Any],
        payload: bytes = b"",
        *,
        payload_file: list[tuple[int, int, int]] | None = None,
        timeout: float | None = None,
    ) -> Response:
        if payload_file is not None:
            # The slots are pinned: the same bytes as the sendfiles.
            payload = b"".join(os.pread(fd, n, off) for fd, off, n in payload_file)
        await self._yield()
        if not self.up:
            raise PeerError("the buddy stopped answering")
        self.requests += 1
        # As the transport does: the buddy may place the payload straight
        # into its arena before it arrives (every other request here), and
        # the handler runs later.
        placement = None
        if self.requests % 2 and payload:
            placement = self.server.place("n1", rtype, meta, len(payload))
        try:
            if placement is not None:
                pos = 0
                for view in placement.views:
                    view[:] = payload[pos : pos + len(view)]
                    pos += len(view)
                await self._yield()
                request = Request(rtype, meta, memoryview(b""), self.requests, placement)
            else:
                request = Request(rtype, meta, memoryview(payload))
            response = await self.server.handle("n1", request)
        finally:
            if placement is not None:
                placement.release()
        await self._yield()
        return response

    async def aclose(self) -> None:
        pass


class World:
    def __init__(self, root: Path, yields: list[int]) -> None:
        self.a = make_cache(root, "n1", capacity=256 * PS, slot_size=PS)
        self.b = make_cache(root, "n2", capacity=256 * PS, slot_size=PS)
        self.server = MirrorServer(
            self.b,
            mirrored_for=("n1",),
            timeout=5,
            manifest_at=self._no_manifest,
            is_alive=lambda name: True,
        )
        self.link = Link(self.server, yields)
        self.client = MirrorClient(
            self.a,
            self.link,  # type: ignore[arg-type]
            node="n1",
            buddy="n2",
            address=("127.0.0.1", 0),
            # Short: after a failure the client takes the buddy as down for
            # one timeout, and the buddy comes back within the next step here.
            timeout=0.001,
            is_alive=lambda name: self.link.up,
        )
        self.a.on_page_changed = self.client.changed
        self.a.on_mirror_done = self.client.done
        self.files: dict[str, CachedFile] = {}
        self.ref: dict[str, bytearray] = {}
        self.acked_commits = 0

    @staticmethod
    async def _no_manifest(path: str) -> Manifest | None:
        return None

    def file(self, name: str) -> CachedFile:
        f = self.files.get(name)
        if f is None or f.state is FileState.UNLINKED:
            f = self.a.new_file(new_id(), new_id(), name, 0o644, 0, 0)
            self.files[name] = f
            self.ref[name] = bytearray()
        return f

    async def write(self, name: str, off: int, size: int, seed: int) -> None:
        f = self.file(name)
        data = random.Random(seed).randbytes(size)
        await self.a.write(f, off, data)
        ref = self.ref[name]
        if len(ref) < off:
            ref.extend(bytes(off - len(ref)))
        ref[off : off + size] = data

    async def truncate(self, name: str, size: int) -> None:
        f = self.file(name)
        await self.a.truncate(f, size)
        ref = self.ref[name]
        del ref[size:]
        ref.extend(bytes(size - len(ref)))

    async def commit(self, name: str) -> None:
        f = self.files.get(name)
        if f is None or f.state is not FileState.MODIFIED:
            return
        async with f.commit_lock:
            if f.state is not FileState.MODIFIED:
                return
            snap = self.a.begin_publish(f, new_id())
            manifest = Manifest(f.file_id, snap.version, snap.size, f.mode, f.mtime_ns)
            snap.holders = await self.client.commit(snap, manifest)
            if snap.holders == ["n1", "n2"]:
                self.acked_commits += 1
            self.a.published(snap)  # the pending manifest is written here (no backing)

    def unlink(self, name: str) -> None:
        f = self.files.pop(name, None)
        if f is not None and f.state is not FileState.UNLINKED:
            self.a.unlink(f)

    async def check(self) -> None:
        for name, f in self.files.items():
            assert await read_all(self.a, f) == bytes(self.ref[name]), name
        for f in list(self.a.all_files()):
            if f.state is FileState.PENDING and f.mirror is MirrorState.ACKED:
                held = self.b.held_version(f.file_id, f.version)
                assert held is not None, f"{f.path}@{f.version} acknowledged but not held"
                assert held.size == f.size
                assert await read_all(self.b, held) == await read_all(self.a, f), f.path
        if self.link.up:  # drops that failed while it was down are sent on its return
            live = {f.mirror_id for f in self.a.all_files() if f.state is not FileState.UNLINKED}
            for mid, m in self.b.mirrors.items():
                assert mid in live, f"the mirror of {m.path or m.file_id} outlived its content"
        assert self.b.mirror_slots == sum(m.ram_count for m in self.b.mirrors.values())
        assert self.b.mirror_reserved == 0


@settings(
    max_examples=int(os.environ.get("CKPTFS_MIRROR_EXAMPLES", "300")),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(ops=st.lists(OPS, min_size=1, max_size=25), yields=YIELDS)
def test_every_acknowledged_pending_file_is_held_by_the_buddy(tmp_path_factory, ops, yields):
    root = tmp_path_factory.mktemp("mirror")

    async def main() -> None:
        w = World(root, yields)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(w.client.run)
            for op in ops:
                kind = op[0]
                if kind == "write":
                    await w.write(*op[1:])
                elif kind == "truncate":
                    await w.truncate(*op[1:])
                elif kind == "commit":
                    await w.commit(op[1])
                elif kind == "commit+write":
                    async with trio.open_nursery() as race:
                        race.start_soon(w.commit, op[1])
                        race.start_soon(w.write, *op[1:])
                elif kind == "unlink":
                    w.unlink(op[1])
                elif kind == "buddy":
                    was_up, w.link.up = w.link.up, op[1]
                    if op[1] and not was_up:
                        await w.client.resync()
                await trio.testing.wait_all_tasks_blocked()
                await w.check()
            for name in list(w.files):
                await w.commit(name)
            await trio.testing.wait_all_tasks_blocked()
            await w.check()
            nursery.cancel_scope.cancel()

    trio.run(main)
