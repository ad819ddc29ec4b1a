"""The writer's side of buddy mirroring (:class:`MirrorClient`).

It streams every full page of a file to its buddy while the file is
written, in batches of pages, straight from the arena with sendfile; a
page's slot is pinned while it is sent, so a write meanwhile copies the page
first and the bytes sent always match the generation sent with them. At
close (``commit``) it sends what is left (the last, partial page), then the
page table of the snapshot being published: the buddy checks that it holds
every page at exactly that generation, answers with the pages it lacks
(sent again), and otherwise takes the content as that version. Only then
does the pending manifest name both nodes as holders, so a holder named in
a manifest always has the bytes. The page table carries the snapshot's
generation floor: a streamed batch that reaches the buddy after the commit
(a retry, a replaced connection) and is at or below it is a late copy and
leaves the committed version as it is.

A full buddy answers ``busy`` and the writer waits and retries: a full buddy
slows the writer, never fails it. A buddy that is down or does not answer
within ``peers.timeout`` makes that file fall back to ``local`` durability:
logged, counted, shown in ``stat``. The writer tells the buddy to drop a
mirror once its version is durable or gone, and mirrors again what the
buddy held when it comes back (``resync``). Before a rename it tells the
buddy the new paths.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable, Mapping
from typing import Any

import trio
from ckptfs.fs.cache.cache import Cache
from ckptfs.fs.content.cachedfile import CachedFile, Snapshot
from ckptfs.fs.content.state import FileRole, FileState, MirrorState, PageState
from ckptfs.fs.store.manifest import Manifest
from ckptfs.peer.mirror.wire import COMMIT, DROP, NOT_ALIVE, PAGE, RENAME, page_digest
from ckptfs.peer.transport.dialer import Dialer
from ckptfs.peer.transport.errors import RemoteError
from ckptfs.peer.transport.transport import PeerClient, Response
from ckptfs.peer.transport.wire import PeerError

log = logging.getLogger("ckptfs.peer.mirror")

# Pages go in batches of up to BATCH_PAGES per request (one request per page
# cost the writer's loop about 0.3 s per GiB in Python alone), at most
# IN_FLIGHT batches at once (the writer's credits): enough to keep a loopback
# or 25 Gb/s link busy, few enough to bound pinned slots. While the credits
# are taken, full pages accumulate, so a busy link gets full batches and an
# idle one gets each page at once.
BATCH_PAGES = 8
IN_FLIGHT = 2
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
        incarnation: str = "",
    ) -> None:
        self.cache = cache
        self.client = client
        self.node = node
        # This daemon process (Membership.incarnation), named in every
        # commit: the buddy takes over what an earlier process committed.
        self.incarnation = incarnation
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
                    "incarnation": self.incarnation,
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
            "%s is not mirrored (%s), %.2fs after its open: it is safe against a crash of "
            "this daemon, not of this node, until it is durable",
            f.path,
            reason,
            time.time() - f.opened_at,
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
