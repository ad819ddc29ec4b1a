"""A writer's and its buddy's mirroring, in one process: manifests, small
caches, the link between them and the requests a writer sends."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import trio
from caches import make_cache
from ckptfs.fs.cache.cache import Cache
from ckptfs.fs.content.cachedfile import CachedFile
from ckptfs.fs.store.manifest import Chunk, Manifest, new_id
from ckptfs.peer.mirror.client import MirrorClient
from ckptfs.peer.mirror.server import MirrorServer
from ckptfs.peer.mirror.wire import COMMIT
from ckptfs.peer.transport.transport import Request, Response


def pending(file_id: str, version: str, holders: list[str]) -> Manifest:
    """A pending manifest of 10 bytes held by ``holders``."""
    return Manifest(file_id, version, 10, 0o644, 1, "pending", holders)


def durable(file_id: str, version: str) -> Manifest:
    """An empty durable manifest (flushed by n2)."""
    return Manifest(file_id, version, 0, 0o644, 1, "durable", ["n2"])


PS = 4096  # small pages: a few writes fill several, and the arena fills soon


def small_cache(tmp_path: Path, name: str, node: str | None = None) -> Cache:
    """Node ``node``'s cache (default ``name``) of 64 small pages, in files
    named after ``name``."""
    return make_cache(tmp_path, name, node=node, capacity=64 * PS, slot_size=PS)


class GatedLink:
    """The writer's PeerClient and connection in one, calling the buddy's
    handler in-process. The first request of type ``hold`` waits at a gate
    until ``open`` is set: a request the buddy handles late (the writer's
    retry after "not alive", or the bytes of a connection the writer has
    already replaced), with everything else going on meanwhile."""

    def __init__(self, server: MirrorServer, hold: str | None) -> None:
        self.server = server
        self.hold = hold
        self.held = trio.Event()  # the held request reached the gate
        self.open = trio.Event()  # the test lets it through
        self.handled = trio.Event()  # the buddy has handled it
        self.closed = False
        self.sent: list[str] = []  # the types of the requests made, in order

    async def connect(self, host: str, port: int, *, expect_node: str, timeout: float) -> Any:
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
        if payload_file is not None:  # read now: the bytes that went on the wire
            payload = b"".join(os.pread(fd, n, off) for fd, off, n in payload_file)
        self.sent.append(rtype)
        gated = rtype == self.hold and not self.held.is_set()
        if gated:
            self.held.set()
            await self.open.wait()
        response = await self.server.handle("n1", Request(rtype, meta, memoryview(payload)))
        if gated:
            self.handled.set()
        return response

    async def aclose(self) -> None:
        pass


def mirror_client(writer: Cache, link: GatedLink) -> MirrorClient:
    """n1's mirror client over ``link``, wired to ``writer`` as the daemon does."""
    client = MirrorClient(
        writer,
        link,  # type: ignore[arg-type]
        node="n1",
        buddy="n2",
        address=("127.0.0.1", 9),
        timeout=5,
        is_alive=lambda name: True,
    )
    writer.on_page_changed = client.changed
    writer.on_mirror_done = client.done
    return client


async def commit(cache: Cache, client: MirrorClient, f: CachedFile) -> list[str]:
    """What FileSystem.commit does with the mirror (the manifest is not written)."""
    async with f.commit_lock:
        snap = cache.begin_publish(f, new_id())
        manifest = Manifest(f.file_id, snap.version, snap.size, f.mode, f.mtime_ns)
        snap.holders = await client.commit(snap, manifest)
        cache.published(snap)
        return snap.holders


def commit_request(
    mid: str,
    manifest: Manifest,
    ram: dict[int, tuple[int, int]],
    spilled: dict[int, Chunk] | None = None,
    *,
    floor: object,
) -> Request:
    """A writer's COMMIT of ``manifest`` (no "floor" field if ``floor`` is None)."""
    body: dict[str, Any] = {
        "manifest": manifest.to_bytes().decode(),
        "path": "a.pt",
        "uid": 0,
        "gid": 0,
        "ram": [[p, gen, fill] for p, (gen, fill) in ram.items()],
        "spilled": [[p, c.offset, c.length, c.hash, c.length] for p, c in (spilled or {}).items()],
        "base": [],
        "base_end": 0,
    }
    if floor is not None:
        body["floor"] = floor
    return Request(COMMIT, {"mid": mid}, memoryview(json.dumps(body).encode()))
