"""Buddy mirroring: a closed file is in two nodes' RAM before close() returns.

The writer's side (:class:`MirrorClient`) streams every full page of a file
to its buddy while the file is written, in batches of pages, straight from
the arena with sendfile; a page's slot is pinned while it is sent, so a
write meanwhile copies the page first and the bytes sent always match the
generation sent with them. At close (``commit``) it sends what is left (the
last, partial page), then the page table of the snapshot being published: the buddy checks
that it holds every page at exactly that generation, answers with the pages
it lacks (sent again), and otherwise takes the content as that version. Only
then does the pending manifest name both nodes as holders, so a holder named
in a manifest always has the bytes. The page table carries the snapshot's
generation floor: a streamed batch that reaches the buddy after the commit
(a retry, a replaced connection) and is at or below it is a late copy and
leaves the committed version as it is.

The buddy's side (:class:`MirrorServer`) keeps mirrors in its own arena
under a quota (``Cache.mirror_quota``). When the quota is full it answers
``busy`` and the writer waits and retries: a full buddy slows the writer,
never fails it. A buddy that is down or does not answer within
``peers.timeout`` makes that file fall back to ``local`` durability: logged,
counted, shown in ``stat``. The writer tells the buddy to drop a mirror once
its version is durable or gone.

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
import math
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import trio
import xxhash
from ckptfs.fs.cache.cache import Cache
from ckptfs.fs.cache.writing import MAX_FILE_SIZE
from ckptfs.fs.content.cachedfile import CachedFile, ChunkMap, Snapshot
from ckptfs.fs.content.state import FileRole, FileState, MirrorState, PageState
from ckptfs.fs.store.manifest import Chunk, Manifest, ManifestError
from ckptfs.peer.transport.auth import one_line
from ckptfs.peer.transport.dialer import Dialer
from ckptfs.peer.transport.errors import RemoteError
from ckptfs.peer.transport.messages import Placement
from ckptfs.peer.transport.transport import PeerClient, Request, Response
from ckptfs.peer.transport.wire import PeerError

log = logging.getLogger("ckptfs.peer.mirror")

PAGE = "mirror.page"
COMMIT = "mirror.commit"
RENAME = "mirror.rename"
DROP = "mirror.drop"
ROUTES = (PAGE, COMMIT, RENAME, DROP)
# The buddy's refusal while its membership does not hold the writer alive
# (yet: it is told of a restart one heartbeat later than the writer is).
NOT_ALIVE = "is not alive to this node"

# Pages go in batches of up to BATCH_PAGES per request (one request per page
# cost the writer's loop about 0.3 s per GiB in Python alone), at most
# IN_FLIGHT batches at once (the writer's credits): enough to keep a loopback
# or 25 Gb/s link busy, few enough to bound pinned slots. While the credits
# are taken, full pages accumulate, so a busy link gets full batches and an
# idle one gets each page at once.
BATCH_PAGES = 8
IN_FLIGHT = 2
MAX_BATCH_PAGES = 64  # what a buddy accepts in one request
# How long a commit keeps retrying a buddy that answers "busy" (its mirror
# space is full of other files not durable yet) before the file falls back
# to local durability. A file larger than that space falls back at once.
BUSY_WAIT = 30.0
BUSY_RETRY = 0.05
# Passes of a resync over the versions at risk: a rewrite during a pass can
# move one to another file, which the next pass finds.
RESYNC_ROUNDS = 4
BUSY_PAUSE = 1.0  # streaming pauses this long after the buddy said "busy"
# A commit sends a page that arrived damaged (hash mismatch) again at once,
# this many times, before the file falls back to local durability.
DAMAGED_RESENDS = 3
MAX_DROPS = 512  # per request
MAX_PENDING_DROPS = 100_000  # kept while the buddy is unreachable
COMMIT_ROUNDS = 3  # commit, resend what the buddy lacks, commit again
# A takeover looks at a mirror's manifest again when a rename of it was
# announced during its look; at most this many times (then it takes the
# mirror over without a look: the fenced publish decides).
PATH_LOOKS = 4
# The buddy's sweep for mirrors nobody told it to drop; a mirror younger than
# SWEEP_AGE may belong to a commit whose manifest is being written.
SWEEP_INTERVAL = 10.0
SWEEP_AGE = 600.0  # well past a slow manifest write (backing_timeout, 120 s by default)


class MirrorFailed(Exception):
    """The buddy did not take the content: the file falls back to local."""


class MirrorClient:
    """The writer's side, for ``FileSystem.mirror`` and the cache's hooks."""

    def __init__(
        self,
        cache: Cache,
        client: PeerClient,
        *,
        node: str,
        buddy: str,
        address: tuple[str, int],
        timeout: float,
        is_alive: Callable[[str], bool],
    ) -> None:
        self.cache = cache
        self.client = client
        self.node = node
        self.buddy = buddy
        self.timeout = timeout
        self.is_alive = is_alive
        self.dialer = Dialer({buddy: address}, timeout=timeout)
        self._credits = trio.Semaphore(IN_FLIGHT)
        self._changed: dict[CachedFile, set[int]] = {}
        self._acked: dict[str, dict[int, int]] = {}  # mirror id -> page -> generation
        self._drops: list[tuple[str, str]] = []
        self._wake = trio.Event()
        # After a failed request the buddy is taken as down for one timeout:
        # the other pages and files in flight fail at once instead of each
        # waiting out its own timeout (a stopped buddy must not stall close()).
        self._down_until = 0.0
        self._down_reason = ""
        self.buddy_quota: int | None = None  # its mirror space, as it last said
        self._busy_until = 0.0  # it said "busy" to a streamed page: stream again later
        # Counters for `stat`.
        self.pages_sent = 0
        self.bytes_sent = 0
        self.pages_damaged = 0  # pages the buddy found damaged (one per batch at most)
        self.commits = 0
        self.fallbacks = 0
        self.fallback_paths: list[str] = []

    # ----- hooks (synchronous, from the cache) ------------------------------------
    def changed(self, f: CachedFile, p: int) -> None:
        """Page ``p`` of a LOCAL file changed: stream it once it is full."""
        if f.mirror is MirrorState.FALLBACK:
            return
        if f.mirror is MirrorState.NONE:
            self.cache.set_mirror(f, MirrorState.STREAMING)
        self._changed.setdefault(f, set()).add(p)
        self._wake.set()

    def done(self, mid: str, version: str) -> None:
        """The buddy may drop mirror ``mid`` (at ``version``; "" = any)."""
        self._acked.pop(mid, None)
        self._drops.append((mid, version))
        self._wake.set()

    # ----- commit and rename (the filesystem waits for these) --------------------
    async def commit(self, snap: Snapshot, manifest: Manifest) -> list[str]:
        """Have the buddy hold exactly ``snap``; the holders for its manifest."""
        f = snap.file
        self._changed.pop(f, None)
        if f.mirror is MirrorState.FALLBACK:
            return [self.node]
        if not self.is_alive(self.buddy):
            self._fall_back(f, f"buddy {self.buddy} is down")
            return [self.node]
        manifest.holders = [self.node, self.buddy]
        try:
            await self._commit(snap, manifest)
        except MirrorFailed as exc:
            if f.content_gen != snap.content_gen:
                return [self.node]  # changed meanwhile: the next commit mirrors it
            self._fall_back(f, str(exc))
            return [self.node]
        if f.mirror is MirrorState.FALLBACK:
            # It fell back while the buddy took it (a rename's message failed
            # meanwhile): a drop of its mirror is on its way to the buddy, so
            # no manifest may name the buddy, and it is not mirrored.
            return [self.node]
        self.commits += 1
        if f.content_gen == snap.content_gen and f.state is FileState.PUBLISHING:
            self.cache.set_mirror(f, MirrorState.ACKED)
        return [self.node, self.buddy]

    async def _commit(self, snap: Snapshot, manifest: Manifest) -> None:
        f = snap.file
        ram = {
            p: (pg.gen, pg.fill)
            for p, pg in snap.pages.items()
            if pg.in_ram and pg.state is PageState.DIRTY
        }
        spilled = [
            [p, pg.chunk.offset, pg.chunk.length, pg.chunk.hash, pg.fill]
            for p, pg in snap.pages.items()
            if pg.state is PageState.SPILLED and pg.chunk is not None
        ]
        # Streamed batches of this content pinned before the snapshot may
        # reach the buddy after the commit (a retry, a replaced connection):
        # the floor tells it they are superseded.
        floor = snap.newest_gen()

        def body() -> bytes:
            # Built at each send: a rename meanwhile must not be undone here.
            return json.dumps(
                {
                    "manifest": manifest.to_bytes().decode(),
                    "path": f.path,
                    "uid": f.uid,
                    "gid": f.gid,
                    "ram": [[p, gen, fill] for p, (gen, fill) in ram.items()],
                    "spilled": spilled,
                    "base": [[c.offset, c.length, c.hash] for c in snap.base.chunks],
                    "base_end": snap.base.end,
                    "floor": floor,
                },
                separators=(",", ":"),
            ).encode()

        need = len(ram) * self.cache.page_size
        if self.buddy_quota is not None and need > self.buddy_quota:
            raise MirrorFailed(
                f"{need >> 20} MiB in RAM is more than buddy {self.buddy} may hold "
                f"({self.buddy_quota >> 20} MiB)"
            )
        mid = f.mirror_id
        acked = self._acked.setdefault(mid, {})
        todo = [p for p, (gen, _fill) in ram.items() if acked.get(p) != gen]
        deadline = trio.current_time() + BUSY_WAIT
        for _round in range(COMMIT_ROUNDS):
            await self._send_pages(f, {p: ram[p][0] for p in todo}, deadline)
            if f.mirror_id != mid:
                raise MirrorFailed(f"{f.path} became other content while it was mirrored")
            response = await self._request(COMMIT, {"mid": mid}, body())
            missing = response.meta.get("missing") or []
            if not missing:
                return
            todo = [int(p) for p in missing if int(p) in ram]
            for p in todo:
                acked.pop(p, None)
        raise MirrorFailed(f"buddy {self.buddy} still lacks pages after {COMMIT_ROUNDS} rounds")

    async def _send_pages(self, f: CachedFile, want: dict[int, int], deadline: float) -> None:
        """Send pages at exactly the generations in ``want``; MirrorFailed if
        a page has changed since (the content being committed is gone)."""
        failures: list[str] = []

        async def one(batch: dict[int, int], cancel: trio.CancelScope) -> None:
            try:
                async with self._credits:
                    changed = await self._send_batch(f, batch, deadline=deadline)
                if changed is not None:
                    failures.append(f"page {changed} of {f.path} changed while it was mirrored")
            except MirrorFailed as exc:
                failures.append(str(exc))
            if failures:
                cancel.cancel()  # the commit fails whatever the other pages do

        pages = sorted(want.items())
        async with trio.open_nursery() as nursery:
            for i in range(0, len(pages), BATCH_PAGES):
                batch = dict(pages[i : i + BATCH_PAGES])
                nursery.start_soon(one, batch, nursery.cancel_scope)
        if failures:
            raise MirrorFailed(failures[0])

    async def _send_batch(
        self, f: CachedFile, want: Mapping[int, int | None], deadline: float | None = None
    ) -> int | None:
        """Send pages as they are now, in one request; the caller holds a
        credit. ``want`` maps each page to the generation it must be at (None:
        any). Returns a page that is not at its generation (nothing is sent
        then), else None. A busy buddy is retried until ``deadline`` (a
        commit); streamed pages (no deadline) are left for the commit to send."""
        mid = f.mirror_id  # the pinned bytes belong to this content
        acked = self._acked.setdefault(mid, {})
        send: list[tuple[int, int, int, int]] = []  # page, generation, fill, slot
        for p, expect in want.items():
            page = f.pages.get(p)
            if page is None or not page.in_ram or page.state is not PageState.DIRTY:
                if expect is not None:
                    return p
                continue
            if expect is not None and page.gen != expect:
                return p
            if acked.get(p) != page.gen:
                send.append((p, page.gen, page.fill, page.slot))
        ps = self.cache.page_size
        arena = self.cache.arena
        pinned = [slot for *_, slot in send]
        for slot in pinned:
            arena.pin(slot)  # a write meanwhile copies the page: these bytes stay `gen`
        try:
            # Checked at the buddy (DESIGN: every peer transfer is verified).
            # On the loop (about 0.8 ms for a batch of 8 MiB). An await here
            # once let batches land after the commit and undo it at the buddy;
            # the commit's generation floor now makes a late batch harmless
            # (the mirror model passes with a worker-thread hop here), so a
            # move is a question of measured cost only.
            digest = {
                p: page_digest(arena.slot_view(slot, 0, fill), p, gen)
                for p, gen, fill, slot in send
            }
            resends = DAMAGED_RESENDS
            while send:
                # A streamed page is not worth waiting for room: the commit sends it.
                meta = {
                    "mid": mid,
                    "file_id": f.file_id,
                    "pages": [[p, gen, fill, digest[p]] for p, gen, fill, _slot in send],
                    "wait": deadline is not None,
                }
                files = [(arena.fd, slot * ps, fill) for _p, _gen, fill, slot in send]
                response = await self._request(PAGE, meta, payload_file=files)
                if "quota" in response.meta:
                    self.buddy_quota = int(response.meta["quota"])
                held = {int(p) for p in response.meta.get("held", ())}
                damaged = response.meta.get("damaged")
                if damaged is not None:
                    self.pages_damaged += 1
                    log.warning(
                        "page %s of %s arrived damaged at buddy %s (hash mismatch)%s",
                        damaged, f.path, self.buddy, "" if resends else "; giving up",
                    )  # fmt: skip
                for p, gen, fill, _slot in send:
                    if p in held:
                        if acked.get(p, -1) < gen:
                            acked[p] = gen
                        self.pages_sent += 1
                        self.bytes_sent += fill
                send = [item for item in send if item[0] not in held]
                if not send:
                    break
                if damaged is not None:
                    # Not a full buddy: send again at once, a few times.
                    if deadline is None:
                        return None  # streaming: the commit sends it again
                    if not resends:
                        raise MirrorFailed(
                            f"pages of {f.path} arrived damaged at buddy {self.buddy} "
                            f"{DAMAGED_RESENDS + 1} times"
                        )
                    resends -= 1
                    continue
                if deadline is None:
                    self._busy_until = trio.current_time() + BUSY_PAUSE
                    return None  # streaming: the commit sends the rest again
                if trio.current_time() > deadline:
                    raise MirrorFailed(f"buddy {self.buddy} had no room for {BUSY_WAIT:g}s")
                await trio.sleep(BUSY_RETRY)
        finally:
            for slot in pinned:
                arena.unpin(slot)
        return None

    async def renaming(self, moves: list[tuple[CachedFile, str]]) -> None:
        """Tell the buddy the new paths of mirrored files, before the rename."""
        for f, path in moves:
            if f.mirror in (MirrorState.NONE, MirrorState.FALLBACK) or f.role is not FileRole.LOCAL:
                continue
            try:
                await self._request(RENAME, {"mid": f.mirror_id, "path": path})
            except MirrorFailed as exc:
                self._fall_back(f, str(exc))

    # ----- background: stream full pages, send drops ------------------------------
    async def run(self) -> None:
        async with trio.open_nursery() as nursery:
            while True:
                # Undelivered drops are retried now and then, besides on wake.
                with trio.move_on_after(max(self.timeout, 1.0) if self._drops else math.inf):
                    await self._wake.wait()
                self._wake = trio.Event()
                if self._drops:
                    nursery.start_soon(self._send_drops)
                if not self.is_alive(self.buddy):
                    continue  # the commit falls back; nothing to stream to
                # A credit first: pages that fill while both are in use join
                # the batch taken when one is given back (it wakes this loop).
                # Never waited for here: drops must go out meanwhile (they
                # free the buddy's room that busy commits wait for).
                while True:
                    try:
                        self._credits.acquire_nowait()
                    except trio.WouldBlock:
                        break
                    taken = self._take_full_batch()
                    if taken is None:
                        self._credits.release()
                        break
                    nursery.start_soon(self._stream, *taken)

    def _take_full_batch(self) -> tuple[CachedFile, list[int]] | None:
        """Up to BATCH_PAGES full pages of one file, taken off the changed set."""
        for f, pages in list(self._changed.items()):
            # A page the file no longer has (dropped, unlinked, truncated) is
            # not streamed: the commit sends what the file holds then. Left
            # here, it would keep a dropped file for ever (a partial last
            # page never fills).
            pages.intersection_update(() if f.unlinked else f.pages)
            full = sorted(p for p in pages if f.pages[p].fill == self.cache.page_size)
            full = full[:BATCH_PAGES]
            pages.difference_update(full)
            if not pages:
                self._changed.pop(f, None)
            if full:
                return f, full
        return None

    async def _stream(self, f: CachedFile, pages: list[int]) -> None:
        """Send streamed pages, holding the credit the run loop took for them."""
        try:
            if (
                f.mirror is MirrorState.FALLBACK
                or f.state is FileState.UNLINKED
                or trio.current_time() < self._busy_until
            ):
                return  # the commit sends what was not streamed
            await self._send_batch(f, dict.fromkeys(pages))
        except MirrorFailed as exc:
            # The commit sends them again, or falls back if the buddy is gone.
            log.debug("streaming pages %s of %s failed: %s", pages, f.path, exc)
        finally:
            self._credits.release()
            self._wake.set()  # pages that filled meanwhile

    async def _send_drops(self) -> None:
        drops, self._drops = self._drops[:MAX_DROPS], self._drops[MAX_DROPS:]
        try:
            await self._request(DROP, {"drops": [list(d) for d in drops]})
        except MirrorFailed as exc:
            # Sent again when the buddy is back (resync). Past the bound, the
            # buddy's own sweep drops mirrors that are no longer pending: a
            # lost drop costs it memory for a while, never bytes.
            self._drops = [*drops, *self._drops][-MAX_PENDING_DROPS:]
            log.info("buddy %s not told yet to drop %d mirror(s): %s", self.buddy, len(drops), exc)
            return
        if self._drops:
            self._wake.set()

    # ----- the connection --------------------------------------------------------
    async def _request(
        self,
        rtype: str,
        meta: dict[str, Any],
        payload: bytes = b"",
        *,
        payload_file: tuple[int, int, int] | None = None,
    ) -> Response:
        if trio.current_time() < self._down_until:
            raise MirrorFailed(self._down_reason)
        deadline = trio.current_time() + self.timeout
        try:
            while True:
                conn = await self.dialer.connection(
                    self.client, self.buddy, before_dial=self._refuse_if_down
                )
                response = await conn.request(
                    rtype, meta, payload, payload_file=payload_file, timeout=self.timeout
                )
                if response.ok or NOT_ALIVE not in (response.error or ""):
                    return response.check()
                if trio.current_time() > deadline:
                    return response.check()
                await trio.sleep(BUSY_RETRY)  # its membership catches up within a heartbeat
        except RemoteError as exc:
            raise MirrorFailed(f"buddy {self.buddy} refused: {exc}") from None
        except (PeerError, OSError, trio.TooSlowError) as exc:
            self._down_until = trio.current_time() + self.timeout
            self._down_reason = f"buddy {self.buddy}: {exc}"
            await self.dialer.forget(self.buddy)
            raise MirrorFailed(self._down_reason) from None

    def _refuse_if_down(self) -> None:
        if trio.current_time() < self._down_until:
            raise MirrorFailed(self._down_reason)  # it failed while we waited to dial

    def _fall_back(self, f: CachedFile, reason: str) -> None:
        self._changed.pop(f, None)
        if f.mirror is MirrorState.FALLBACK:
            return
        self.cache.set_mirror(f, MirrorState.FALLBACK)
        # What it holds of this content is no use, and pages of it still in
        # flight must not bring it back: dropped for good (the content gets
        # a new mirror id once it is durable).
        self.done(f.mirror_id, "")
        self.fallbacks += 1
        self.fallback_paths = [*self.fallback_paths[-99:], f.path]
        log.warning(
            "%s is not mirrored (%s): it is safe against a crash of this daemon, "
            "not of this node, until it is durable",
            f.path,
            reason,
        )

    async def resync(self) -> int:
        """The buddy came back (it may have restarted empty): mirror again
        every pending version it was holding. Returns how many it holds now.

        Versions are followed by mirror id, not by file: a rewrite of the
        name meanwhile (truncate to 0) moves a pending version to a retired
        file that keeps its mirror id. A commit being published now was
        acknowledged by the buddy's previous life too: its lock is held
        until the publish ends, and the version is then mirrored again."""
        at_risk = {f.mirror_id for f in self.cache.all_files() if _acknowledged_or_publishing(f)}
        sent: set[str] = set()
        held = 0
        self._down_until = 0.0  # the membership heard from it
        self._wake.set()  # drops it missed while it was away
        for _ in range(RESYNC_ROUNDS):
            todo = [
                f
                for f in self.cache.all_files()
                if f.mirror_id in at_risk
                and f.mirror_id not in sent
                and _acknowledged_or_publishing(f)
            ]
            if not todo:
                break
            for f in todo:
                held += await self._mirror_again(f, sent)
        if at_risk:
            log.info("buddy %s is back: %d of %d pending file(s) mirrored again",
                     self.buddy, held, len(sent))  # fmt: skip
        return held

    async def _mirror_again(self, f: CachedFile, sent: set[str]) -> bool:
        """Commit ``f``'s acknowledged version to the buddy again (once per
        mirror id, recorded in ``sent``); whether the buddy holds it now."""
        # The commit path's lock: a commit of this file meanwhile would race
        # this one to the buddy, which takes whichever lands last. Checked
        # again once held: the commits of earlier files (and the wait for the
        # lock) let writes and commits run, and a file no longer PENDING
        # would send changed pages under its old version.
        async with f.commit_lock:
            if f.mirror_id in sent or not _acknowledged(f):
                return False  # changed since: its next commit mirrors it
            sent.add(f.mirror_id)
            snap = self.cache.journal_snapshot(f)
            if self._acked.pop(f.mirror_id, None) is None:
                # Acknowledged before this process began: recovered after a
                # crash of this daemon, its manifest naming the buddy. The
                # buddy likely kept it, so the commit goes first, and only
                # the pages it then says it lacks are sent.
                self._acked[f.mirror_id] = {
                    p: pg.gen for p, pg in snap.pages.items() if pg.state is PageState.DIRTY
                }
            manifest = Manifest(
                f.file_id, f.version, f.size, f.mode, f.mtime_ns, "pending", list(f.holders),
                chunking=f.chunking, atime_ns=f.atime_ns, seq=f.seq,
            )  # fmt: skip
            try:
                await self._commit(snap, manifest)
            except MirrorFailed as exc:
                if _still(f, snap):
                    self._fall_back(f, str(exc))
                return False
            # Not counted if written meanwhile: its next commit mirrors it.
            return _still(f, snap)

    def stats(self) -> dict[str, Any]:
        return {
            "buddy": self.buddy,
            "pages_sent": self.pages_sent,
            "bytes_sent": self.bytes_sent,
            "pages_damaged": self.pages_damaged,
            "commits": self.commits,
            "fallbacks": self.fallbacks,
            "fallback_paths": list(self.fallback_paths[-10:]),
        }


def _acknowledged(f: CachedFile) -> bool:
    """A pending version of ours that the buddy acknowledged holding."""
    return (
        f.role is FileRole.LOCAL and f.state is FileState.PENDING and f.mirror is MirrorState.ACKED
    )


def _acknowledged_or_publishing(f: CachedFile) -> bool:
    """Acknowledged, or being published (its commit may have been acknowledged
    by the buddy before it restarted)."""
    return _acknowledged(f) or (f.role is FileRole.LOCAL and f.state is FileState.PUBLISHING)


def _still(f: CachedFile, snap: Snapshot) -> bool:
    """Whether ``f`` is still PENDING at exactly ``snap``'s version and content."""
    return (
        f.state is FileState.PENDING
        and f.version == snap.version
        and f.content_gen == snap.content_gen
    )


def checked_path(value: object) -> str:
    """A mirrored file's path: relative, inside the mount, no empty, ``.`` or
    ``..`` component (ValueError otherwise)."""
    if (
        not isinstance(value, str)
        or not value
        or value.startswith("/")
        or "\0" in value
        or any(part in ("", ".", "..") for part in value.split("/"))
    ):
        raise ValueError(f"bad path {one_line(repr(value), 100)}")
    return value


def page_digest(data: memoryview | bytes, page: int, gen: int) -> int:
    """What a mirrored page is checked against at the buddy: xxh3-64 of its
    bytes, seeded with its page number and generation so that damaged
    metadata does not pass either."""
    return xxhash.xxh3_64_intdigest(data, seed=((page << 32) ^ gen) & 0xFFFF_FFFF_FFFF_FFFF)


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
        )
        return Response(meta={"missing": missing})

    def take_over_soon(self, origin: str, nursery: trio.Nursery) -> None:
        """take_over in ``nursery``, counted as under way from this moment."""
        self.cache.begin_takeover()

        async def run() -> None:
            try:
                await self.take_over(origin, begun=True)
            finally:
                self.cache.end_takeover()

        try:
            nursery.start_soon(run)
        except BaseException:  # a closed nursery: no takeover will run
            self.cache.end_takeover()
            raise

    async def take_over(self, origin: str, *, begun: bool = False) -> int:
        """``origin`` died: flush every version of it mirrored here that is
        still pending at its path. (A version already durable or replaced
        there needs nothing; the fenced publish is what guarantees it, this
        look only saves hashing a checkpoint for nothing.) ``begun``: the
        caller counts it as under way (take_over_soon)."""
        if begun:
            taken = await self._take_over(origin)
        else:
            with self.cache.taking_over():
                taken = await self._take_over(origin)
        self.takeovers += taken
        log.info("peer %s dead: took over %d mirrored file(s)", origin, taken)
        return taken

    async def _take_over(self, origin: str) -> int:
        taken = 0
        for f in self.cache.mirrors_of(origin):
            if f.role is not FileRole.MIRROR:
                continue
            if f.state is FileState.PENDING:
                version = f.version
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
