"""The buddy's side of mirroring (:class:`MirrorServer`): holding mirrors,
taking them over.

It keeps mirrors in its own arena under a quota (``Cache.mirror_quota``);
a batch of pages is received straight into arena slots reserved for it when
there is room. When the quota is full it answers ``busy`` and the writer
waits and retries. It drops a mirror when the writer says so, and its sweep
drops mirrors no longer pending at their path that nobody told it to drop.

When the membership declares a writer dead, its buddy takes over every
mirror of it that was committed: it flushes them and publishes the durable
manifest fenced, only over exactly the version it mirrored
(``Backing.takeover_manifest``).

Whose mirrors: a buddy takes mirror requests only from the nodes it is the
configured buddy of (``PeersConfig.mirrored_for``), each node being who the
transport's identity check says it is. A writer speaks only for its own
files: a commit must name the writer and this buddy as the version's
holders (``[writer, buddy]``, as its pending manifest will), and a path that
stays inside the mount. What the commit claims beyond that (file id,
version, attributes) the buddy cannot check when it arrives, as the manifest
is published after it, so it is checked where it matters: a mirror is
served (here and to peers) only to readers of a version whose manifest
names its sender as the writer (``Cache.held_version``), and is taken over
only if the pending manifest at its path names its sender as the writer.
"""

from __future__ import annotations

import errno
import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import trio
from ckptfs.fs.cache.cache import Cache
from ckptfs.fs.cache.writing import MAX_FILE_SIZE
from ckptfs.fs.content.cachedfile import CachedFile, ChunkMap
from ckptfs.fs.content.state import FileRole, FileState
from ckptfs.fs.store.manifest import Chunk, Manifest, ManifestError
from ckptfs.peer.mirror.wire import (
    COMMIT,
    DROP,
    MAX_BATCH_PAGES,
    NOT_ALIVE,
    PAGE,
    RENAME,
    checked_path,
    page_digest,
)
from ckptfs.peer.transport.auth import one_line
from ckptfs.peer.transport.messages import Placement
from ckptfs.peer.transport.transport import Request, Response

log = logging.getLogger("ckptfs.peer.mirror")

# A takeover looks at a mirror's manifest again when a rename of it was
# announced during its look; at most this many times (then it takes the
# mirror over without a look: the fenced publish decides).
PATH_LOOKS = 4
# The buddy's sweep for mirrors nobody told it to drop; a mirror younger than
# SWEEP_AGE may belong to a commit whose manifest is being written.
SWEEP_INTERVAL = 10.0
SWEEP_AGE = 600.0  # well past a slow manifest write (backing_timeout, 120 s by default)


class _ReceivedPages:
    """A batch received straight into arena slots reserved for it: its
    (page, generation, fill, digest), one slot per page in order, and the
    views of those slots the transport receives into. ``hold`` makes them
    the mirror's pages; ``release`` gives back the slots not taken."""

    def __init__(
        self, cache: Cache, pages: list[tuple[int, int, int, int]], slots: list[int]
    ) -> None:
        self.cache = cache
        self.pages = pages
        self.slots = slots
        self.views = [
            cache.arena.slot_view(slot, 0, fill)
            for slot, (_p, _gen, fill, _digest) in zip(slots, pages, strict=True)
        ]
        self.taken = 0

    def first_damaged(self) -> int | None:
        """The index of the first page whose bytes do not match their digest."""
        for i, (view, (p, gen, _fill, digest)) in enumerate(
            zip(self.views, self.pages, strict=True)
        ):
            if page_digest(view, p, gen) != digest:
                return i
        return None

    def hold(self, origin: str, mid: str, file_id: str, count: int) -> list[int]:
        """Hold the first ``count`` pages (the rest: see ``release``)."""
        for (p, gen, fill, _digest), slot in zip(self.pages[:count], self.slots, strict=False):
            self.cache.mirror_page_into(origin, mid, file_id, p, gen, slot, fill)
            self.taken += 1
        return [p for p, *_ in self.pages[:count]]

    def release(self) -> None:
        for slot in self.slots[self.taken :]:
            self.cache.unreserve_mirror_slot(slot)
        self.taken = len(self.slots)


class MirrorServer:
    """The buddy's side: holds the mirrors of the nodes whose buddy it is."""

    def __init__(
        self,
        cache: Cache,
        *,
        mirrored_for: tuple[str, ...],
        timeout: float,
        manifest_at: Callable[[str], Awaitable[Manifest | None]],
        is_alive: Callable[[str], bool],
    ) -> None:
        self.cache = cache
        self.mirrored_for = mirrored_for
        self.timeout = timeout
        self.manifest_at = manifest_at
        self.is_alive = is_alive
        self.takeovers = 0
        self.dropped_uncommitted = 0

    def _refuse(self, peer: str) -> Response | None:
        if peer not in self.mirrored_for:
            return Response.fail(f"this node is not {peer}'s buddy")
        return None

    async def handle(self, peer: str, request: Request) -> Response:
        refused = self._refuse(peer)
        if refused is not None:
            return refused
        if request.type in (PAGE, COMMIT, DROP) and not self.is_alive(peer):
            # Its files were (or will be) taken over here: new content from it
            # now would be held by nobody who takes it over when it dies, and
            # a drop would free the pages of a mirror a takeover is about to
            # flush (it reads the manifest first, and decides from that).
            return Response.fail(f"{peer} {NOT_ALIVE}; not mirroring")
        try:
            if request.type == PAGE:
                return await self._page(peer, request)
            if request.type == COMMIT:
                return self._commit(peer, request)
            if request.type == RENAME:
                path = checked_path(request.meta["path"])
                ok = self.cache.mirror_rename(peer, str(request.meta["mid"]), path)
                return Response(meta={"known": ok})
            if request.type == DROP:
                dropped = 0
                for mid, version in request.meta["drops"]:
                    dropped += self.cache.mirror_drop(peer, str(mid), str(version))
                return Response(meta={"dropped": dropped})
        except (KeyError, TypeError, ValueError, ManifestError) as exc:
            return Response.fail(f"malformed {request.type} request: {exc}")
        except OSError as exc:
            return Response.fail(str(exc))
        return Response.fail(f"unknown mirror request {request.type!r}")

    def place(self, peer: str, rtype: str, meta: dict[str, Any], size: int) -> Placement | None:
        """Where a batch of pages is received: straight into arena slots
        reserved for it when the quota has room now; else (None) into a
        buffer, and ``_page`` copies what fits once room frees up."""
        if rtype != PAGE or self._refuse(peer) is not None or not self.is_alive(peer):
            return None
        try:
            pages = self._batch(meta, size)
        except (KeyError, TypeError, ValueError):
            return None  # the handler answers why
        slots = self.cache.reserve_mirror_slots(len(pages))
        if slots is None:
            return None
        try:
            # The transport copies bytes it already buffered into these views
            # from user space: a hole of a full tmpfs there would be a SIGBUS.
            for slot in slots:
                self.cache.arena.back(slot)
        except OSError as exc:
            for slot in slots:
                self.cache.unreserve_mirror_slot(slot)
            log.warning("receiving a batch from %s into the buffer instead: %s", peer, exc)
            return None  # the buffered path writes with pwrite: ENOSPC, an error reply
        received = _ReceivedPages(self.cache, pages, slots)
        return Placement(received.views, received.release, received)

    def _batch(self, meta: dict[str, Any], size: int) -> list[tuple[int, int, int, int]]:
        """The (page, generation, fill, digest) of a batch; ValueError if malformed."""
        pages = [
            (int(p), int(gen), int(fill), int(digest)) for p, gen, fill, digest in meta["pages"]
        ]
        if not 0 < len(pages) <= MAX_BATCH_PAGES:
            raise ValueError(f"a batch of {len(pages)} pages (at most {MAX_BATCH_PAGES})")
        if len({p for p, *_ in pages}) != len(pages):
            raise ValueError("a page is twice in one batch")
        for p, _gen, fill, _digest in pages:
            if not 0 <= p < MAX_FILE_SIZE // self.cache.page_size:
                raise ValueError(f"page {p} is out of bounds")
            if not 0 <= fill <= self.cache.page_size:
                raise ValueError(f"page of {fill} bytes is not within the page size")
        if sum(fill for _p, _gen, fill, _digest in pages) != size:
            raise ValueError("the pages' sizes do not add up to the payload")
        return pages

    async def _page(self, peer: str, request: Request) -> Response:
        """Hold a batch of pages (payload: their bytes one after another);
        answers which were held. The first page without room ends the batch:
        the writer sends the rest again later."""
        meta = request.meta
        mid, file_id = str(meta["mid"]), str(meta["file_id"])
        received = request.placement.owner if request.placement is not None else None
        damaged: int | None = None  # the first page whose bytes do not match its digest
        if isinstance(received, _ReceivedPages):  # validated by place()
            pages = received.pages
            # On the loop (about 0.8 ms for a batch of 8 MiB): between
            # receiving and holding no other request may run (see _commit).
            bad = received.first_damaged()
            if bad is not None:
                damaged = pages[bad][0]
            held = received.hold(peer, mid, file_id, len(pages) if bad is None else bad)
        else:
            try:
                pages = self._batch(meta, len(request.payload))
            except ValueError as exc:
                return Response.fail(str(exc))
            held = []
            # One wait for the whole batch, well inside the writer's request timeout.
            until = trio.current_time() + (self.timeout / 2 if meta.get("wait", True) else 0.0)
            off = 0
            for p, gen, fill, digest in pages:
                data = request.payload[off : off + fill]
                off += fill
                if page_digest(data, p, gen) != digest:
                    damaged = p
                    break
                wait = max(0.0, until - trio.current_time())
                if not await self.cache.mirror_page(
                    peer, mid, file_id, p, gen, data, timeout=wait,
                    admit=lambda: self.is_alive(peer),
                ):  # fmt: skip
                    break
                held.append(p)
            if len(held) < len(pages) and not self.is_alive(peer):
                # Declared dead while a page waited for room: refused, as at
                # the start of the request (the takeover's now).
                return Response.fail(f"{peer} {NOT_ALIVE}; not mirroring")
        quota = self.cache.mirror_quota * self.cache.page_size
        reply: dict[str, Any] = {"held": held, "busy": len(held) < len(pages), "quota": quota}
        if damaged is not None:
            # Not held: the writer sends it again (a commit until it gives up
            # and falls back to local durability).
            log.warning(
                "page %d of %s (file %s) from %s arrived damaged (hash mismatch); not held",
                damaged, mid, file_id, peer,
            )  # fmt: skip
            reply["damaged"] = damaged
        return Response(meta=reply)

    def _commit(self, peer: str, request: Request) -> Response:
        body = json.loads(bytes(request.payload))
        manifest = Manifest.from_bytes(str(body["manifest"]).encode(), "mirrored manifest")
        path = checked_path(body["path"])
        holders = [peer, self.cache.node]
        # A writer mirrors only its own pending versions, held by it and us.
        if manifest.holders != holders or manifest.state != "pending":
            raise ValueError(
                f"commit of {path!r} from {peer} is of a {one_line(manifest.state, 20)} "
                f"version held by {one_line(manifest.holders, 200)}, not {holders}"
            )
        ram = {int(p): (int(gen), int(fill)) for p, gen, fill in body["ram"]}
        floor = body.get("floor")
        # Strict: a commit without it is from a node older than this one,
        # whose late pages this node could not tell from new ones.
        if type(floor) is not int or floor < 0:
            raise ValueError(
                f"commit of {body.get('path')!r} has no valid generation floor ({floor!r})"
            )
        if any(gen > floor for gen, _fill in ram.values()):
            raise ValueError(
                f"commit of {body.get('path')!r} lists a page newer than its floor {floor}"
            )
        # A spilled page's fill may be shorter than its chunk: the file was
        # truncated inside the page after it spilled (bytes past the fill read
        # as zeros, here as at the writer).
        spilled = {
            int(p): (Chunk(int(off), int(length), str(digest)), int(fill))
            for p, off, length, digest, fill in body["spilled"]
        }
        if any(not 0 <= fill <= chunk.length for chunk, fill in spilled.values()):
            raise ValueError(f"commit of {body.get('path')!r} has a spilled page past its chunk")
        base = ChunkMap.of(
            [Chunk(int(o), int(n), str(h)) for o, n, h in body["base"]], int(body["base_end"])
        )
        missing = self.cache.mirror_commit(
            peer,
            str(request.meta["mid"]),
            manifest,
            path,
            int(body["uid"]),
            int(body["gid"]),
            ram,
            spilled,
            base,
            floor,
            # Which process of the writer committed it: a mirror of one
            # that restarted since is taken over (peer/node.py).
            one_line(body.get("incarnation", ""), 64),
        )
        return Response(meta={"missing": missing})

    def take_over_soon(
        self, origin: str, nursery: trio.Nursery, *, restarted_as: str | None = None
    ) -> None:
        """take_over in ``nursery``, counted as under way from this moment."""
        self.cache.begin_takeover()

        async def run() -> None:
            try:
                await self.take_over(origin, begun=True, restarted_as=restarted_as)
            finally:
                self.cache.end_takeover()

        try:
            nursery.start_soon(run)
        except BaseException:  # a closed nursery: no takeover will run
            self.cache.end_takeover()
            raise

    async def take_over(
        self, origin: str, *, begun: bool = False, restarted_as: str | None = None
    ) -> int:
        """``origin`` died: flush every version of it mirrored here that is
        still pending at its path. (A version already durable or replaced
        there needs nothing; the fenced publish is what guarantees it, this
        look only saves hashing a checkpoint for nothing.) ``begun``: the
        caller counts it as under way (take_over_soon).

        ``restarted_as``: ``origin`` did not die for us but came back as a
        new process (that incarnation) before its death was noticed. What
        its old process committed it may have lost with its cache, and no
        one else flushes it: those versions are taken over (if it kept its
        cache, it flushes them too, and the fenced publish lets one win).
        What the new process mirrors is its own, left alone."""
        start = time.monotonic()
        if begun:
            taken = await self._take_over(origin, restarted_as)
        else:
            with self.cache.taking_over():
                taken = await self._take_over(origin, restarted_as)
        self.takeovers += taken
        why = "dead" if restarted_as is None else "restarted"
        log.info("peer %s %s: took over %d mirrored file(s) in %.2fs", origin, why, taken,
                 time.monotonic() - start)  # fmt: skip
        return taken

    async def _take_over(self, origin: str, restarted_as: str | None = None) -> int:
        taken = 0
        for f in self.cache.mirrors_of(origin):
            if f.role is not FileRole.MIRROR:
                continue
            if restarted_as is not None and (
                f.state is not FileState.PENDING or f.origin_incarnation == restarted_as
            ):
                continue  # the live process's: being sent, or committed by it
            if f.state is FileState.PENDING:
                version, committed_by = f.version, f.origin_incarnation
                try:
                    m = await self._manifest_of(f)
                except (OSError, ManifestError) as exc:
                    # Cannot tell (the store is slow or failing, or a rename
                    # is on its way): take it over; the fenced publish decides.
                    log.info("taking over %s without a look at its manifest: %s", f.path, exc)
                    m = None
                else:
                    if m is None:  # a directory or a plain file there now
                        m = Manifest(f.file_id, "", 0, 0, 0, "durable")
                if (
                    f.role is not FileRole.MIRROR
                    or f.version != version
                    or f.state is not FileState.PENDING
                    or f.origin_incarnation != committed_by
                ):
                    continue  # changed hands, committed again or dropped while we looked
                if m is not None and (m.version != f.version or m.state != "pending"):
                    log.info("not taking over %s from %s: no longer pending there",
                             f.path, origin)  # fmt: skip
                    self.cache.mirror_drop(origin, f.mirror_id, f.version)
                    continue
                if m is not None and m.holders[:1] != [origin]:
                    # Its commit claimed another writer's file and version:
                    # flushing it would publish its bytes as that file.
                    log.warning(
                        "not taking over %s (version %s) from %s: its manifest names %s as "
                        "its writer; dropped the mirror", f.path, f.version, origin,
                        one_line(m.holders[0] if m.holders else "nobody", 80),
                    )  # fmt: skip
                    self.cache.mirror_drop(origin, f.mirror_id, f.version)
                    continue
            if self.cache.take_over(f):
                taken += 1
                log.warning(
                    "taking over %s (version %s) from %s: flushing it from this buddy",
                    f.path,
                    f.version,
                    origin,
                )
            else:
                self.dropped_uncommitted += 1
        return taken

    async def _manifest_of(self, f: CachedFile) -> Manifest | None:
        """The manifest at the mirror's path, or at a path it had before (a
        rename the writer announced may have failed); adopts the path found.

        Looked at again if a rename of it was announced while it looked: a
        manifest read at the old path just before the writer's rename landed
        there must not send the mirror back to that path (its fenced publish
        would find nothing there, and the closed file would be dropped)."""
        for _ in range(PATH_LOOKS):
            at = f.path
            try:
                path, m = await self._first_manifest(f)
            except FileNotFoundError:
                if f.path != at:
                    continue
                raise
            if f.path != at:
                continue  # renamed while we looked
            if path is not None:
                self.cache.move_path(f, path)
            return m
        raise OSError(
            errno.EAGAIN, f"{f.path} was renamed {PATH_LOOKS} times while its takeover looked"
        )

    async def _first_manifest(self, f: CachedFile) -> tuple[str | None, Manifest | None]:
        """The first of the mirror's paths (its current, then its earlier
        ones) with a manifest of its file, and that manifest; else (None,
        whatever is at its current path), FileNotFoundError if nothing."""
        for path in [f.path, *reversed(f.prior_paths)]:
            try:
                m = await self.manifest_at(path)
            except FileNotFoundError:
                continue
            if m is not None and m.file_id == f.file_id:
                return path, m
        return None, await self.manifest_at(f.path)

    async def sweep(self) -> None:
        """Background: drop mirrors whose version is no longer pending at its
        path (durable, replaced, removed) though no drop came (a lost drop,
        a writer that restarted). A dead writer's mirrors are the takeover's."""
        while True:
            await trio.sleep(SWEEP_INTERVAL)
            await self.sweep_once()

    async def sweep_once(self) -> None:
        """One pass of the sweep over the mirrors held now."""
        now = time.time()
        for f in list(self.cache.mirrors.values()):
            if (
                f.role is not FileRole.MIRROR
                or f.state is not FileState.PENDING
                or not self.is_alive(f.origin)
                or now - (f.closed_at or now) < SWEEP_AGE
            ):
                continue
            version, path = f.version, f.path
            try:
                m = await self.manifest_at(path)
            except (OSError, ManifestError):
                continue  # missing (a rename on its way?) or unreadable: keep it
            if f.path != path:
                # Renamed while we looked (the writer announces a rename
                # before it makes it): what we read at the old path may be
                # another file put there since. The next pass looks again.
                continue
            if m is not None and m.version == version and m.state == "pending":
                continue
            if self.cache.mirror_drop(f.origin, f.mirror_id, version):
                log.info("dropped the mirror of %s from %s: no longer pending there",
                         f.path, f.origin)  # fmt: skip

    def restarted(self, origin: str) -> int:
        """``origin`` came back as a new process: what it was still sending
        (mirrors never committed) will never be committed; drop it."""
        dropped = 0
        for f in self.cache.mirrors_of(origin):
            if f.role is FileRole.MIRROR and f.state is not FileState.PENDING:
                dropped += self.cache.mirror_drop(origin, f.mirror_id, "")
        return dropped

    def stats(self) -> dict[str, Any]:
        mirrors = list(self.cache.mirrors.values())
        return {
            "mirrored_bytes": self.cache.mirrored_bytes(),
            "mirrors": len(mirrors),
            "kept_for_readers": len(self.cache.kept_mirrors),
            "kept_for_readers_total": self.cache.mirrors_kept,
            "mirrored_files": sorted(
                f"{f.origin}:{f.path or f.file_id}" for f in mirrors if f.state is FileState.PENDING
            )[:50],
            "takeovers": self.takeovers,
            "dropped_uncommitted": self.dropped_uncommitted,
            "at": time.time(),
        }
