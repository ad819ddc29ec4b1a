"""A mount's machinery without FUSE: cache, journal, flusher, filesystem logic.

The daemon (daemon.py) puts a FUSE session and the control socket in front of
a Core; tests drive a Core directly, with the backing-store runner and the
journal's thread runner replaced so that every await can be stepped.
"""

from __future__ import annotations

import fnmatch
import logging
import time
from collections.abc import Callable
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio
from ckptfs.fs.cache.cache import Cache
from ckptfs.fs.cache.journal import Journal, ThreadRunner
from ckptfs.fs.cache.recovery import confirm_later, recover
from ckptfs.fs.config import Config
from ckptfs.fs.content.arena import SLOT_SIZE, Arena
from ckptfs.fs.content.cachedfile import CachedFile
from ckptfs.fs.content.state import FileRole, FileState
from ckptfs.fs.flush.flusher import Flusher
from ckptfs.fs.namespace.commits import FOLLOWS
from ckptfs.fs.namespace.filesystem import FileSystem
from ckptfs.fs.namespace.posix import in_subtree
from ckptfs.fs.store.backing import Backing
from ckptfs.fs.store.beneath import make_private_path
from ckptfs.fs.store.blocking import BackingIO
from ckptfs.fs.store.chunkstore import ChunkStore
from ckptfs.fs.store.history import History, Query, read_all, utc_time
from ckptfs.fs.store.manifest import Manifest
from ckptfs.fs.store.publish import Published
from ckptfs.fs.store.retention import fd_audit, file_audit, retain_beneath
from ckptfs.fs.store.storedirs import StoreDirs

if TYPE_CHECKING:  # prometheus-client is imported only with metrics on
    from ckptfs.fs.daemon.metrics import Timings

log = logging.getLogger("ckptfs.core")


class Prefault(Enum):
    """Where the background pass that touches the whole cache is."""

    OFF = "off"  # cache.prefault: false (or a daemon started without it)
    RUNNING = "running"
    DONE = "done"
    STOPPED = "stopped"  # an error ended it; the rest is touched by first writes


class Core:
    def __init__(
        self,
        config: Config,
        cache_root: Path,
        *,
        io: BackingIO | None = None,
        journal_runner: ThreadRunner | None = None,
        slot_size: int = SLOT_SIZE,
        timings: Timings | None = None,
    ) -> None:
        assert config.backing is not None
        self.config = config
        self.backing_root = config.backing
        self.cache_root = cache_root
        self.timings = timings
        self.io = io or BackingIO(
            config.backing_timeout,
            max_threads=max(8, 2 * config.flush_workers),
            on_call=timings.store_call.observe if timings else None,
        )
        # The backing root and .ckptfs, held open and checked (storedirs.py).
        self.dirs = StoreDirs(self.backing_root)
        self.history = (
            History(config.history_file, self.io)
            if config.history_file
            else History(Path(f"{config.node}.csv"), self.io, self.dirs)
        )
        # The journal that recovery reads and the arena's bytes: only ours.
        make_private_path(self.cache_root)
        self.arena = Arena(self.cache_root / "arena", config.cache_size, slot_size)
        self.journal = Journal(self.cache_root / "journal", journal_runner)
        self.cache = Cache(
            self.arena,
            ChunkStore(self.backing_root, self.dirs),
            self.io,
            self.journal,
            node=config.node,
        )
        self.flusher = Flusher(
            self.cache,
            self.io,
            node=config.node,
            workers=config.flush_workers,
            bandwidth=config.flush_bandwidth,
            chunk_size=config.chunk_size,
            # A close at durability backing waits for its flush: no settling.
            settle=0.0 if config.durability == "backing" else config.flush_settle,
            publish=self._publish_flushed,
            on_durable=self._on_durable,
        )
        self.cache.on_pending = self.flusher.enqueue
        self.backing = Backing(self.backing_root, self.io, self.dirs)
        self.fs = FileSystem(config, self.backing, self.cache, self.flusher)
        self.prefaulted = 0
        self.prefault = Prefault.OFF
        self._history_reader = trio.CapacityLimiter(1)
        self.recovered = 0

    async def start(self, nursery: trio.Nursery, *, prefault: bool = True) -> None:
        """Adopt what a crashed daemon left, then start the background tasks."""
        for path in await self.backing.restore_own_fences(self.cache.node):
            log.warning("%s: its manifest, moved aside by this node's takeover before it "
                        "died, is back", path)  # fmt: skip
        self.recovered = await recover(self.cache, self.backing)
        nursery.start_soon(confirm_later, self.cache, self.backing)
        await nursery.start(self.flusher.run)
        nursery.start_soon(self.cache.run_spiller)
        nursery.start_soon(self.journal.run)
        nursery.start_soon(self.history.run)
        nursery.start_soon(self.fs.retry_commits)
        if prefault and self.config.cache_prefault:
            self.prefault = Prefault.RUNNING
            nursery.start_soon(self._prefault)

    async def _publish_flushed(
        self, f: CachedFile, make: Callable[[], Manifest | None], version: str
    ) -> Published:
        """The flusher's durable manifest: fenced for a taken-over file; at
        the path another node's rename moved it to, if its name is gone."""
        result, tried = await self._publish_at_path(f, make, version)
        for _ in range(FOLLOWS):
            if result is not Published.NAME_GONE or not await self.fs.follow_rename(f, tried):
                break
            result, tried = await self._publish_at_path(f, make, version)
        return result

    async def _publish_at_path(
        self, f: CachedFile, make: Callable[[], Manifest | None], version: str
    ) -> tuple[Published, str]:
        if f.role is FileRole.TAKEOVER:
            return await self.fs.publish_takeover(f, make, version)
        return await self.fs.publish(f, make, expect_version=version)

    async def serve_peer_read(
        self,
        file_id: str,
        version: str,
        offset: int,
        length: int,
        into: bytearray | None,
        writer: str,
    ) -> bytes | memoryview | None:
        """A range of exactly that version, for a peer (copied into ``into`` if
        given); None if not held here, or held only as a mirror that ``writer``
        did not send."""
        return await self.cache.read_held(
            file_id, version, offset, length, into=into, writer=writer
        )

    def close(self) -> None:
        self.fs.close_all()
        self.arena.close()
        self.backing.close()

    def all_durable(self) -> bool:
        # Lost files are not ours to flush: their holders went away. A dead
        # buddy's files taken over are: their only copy is in this cache,
        # which a clean unmount deletes.
        return (
            not any(f.modified or f.owes_flush for f in self.cache.all_files() if not f.unlinked)
            and not self.taken_over("")
            and not self.cache.takeover_running
            and not self.cache.unconfirmed
        )

    def not_durable(self) -> list[tuple[str, int]]:
        """(path, owner uid) of every file this node still owes the store:
        written here and not durable, or taken over from a dead buddy."""
        owed = [
            f for f in self.cache.all_files() if not f.unlinked and (f.modified or f.owes_flush)
        ]
        return [(f.path, f.uid) for f in [*owed, *self.taken_over("")]] + list(
            self.cache.unconfirmed.paths()
        )

    def taken_over(self, prefix: str) -> list[CachedFile]:
        """Dead buddies' files under ``prefix`` that this node took over and
        still owes the backing store."""
        return [f for f in self.cache.taken_over() if f.owes_flush and in_subtree(f.path, prefix)]

    async def drain(self, prefix: str, timeout: float | None) -> dict[str, Any]:
        """Commit what changed under ``prefix`` and wait until all of it is durable."""
        pending: list[CachedFile] = []
        failed: list[str] = []
        with trio.move_on_after(timeout if timeout is not None else float("inf")):
            for f in self.fs.files_under(prefix):
                if f.role is not FileRole.LOCAL:
                    continue
                if f.modified:
                    try:
                        await self.fs.commit(f)
                    except OSError as exc:
                        failed.append(f"{f.path} ({exc.strerror or exc})")
                        continue
                if f.owes_flush:
                    self.flusher.enqueue(f)
                    pending.append(f)
            # Files kept from before a crash: adopted (and flushed with the
            # rest) or found stale once the store answers for them.
            if await self.cache.unconfirmed.settled(lambda path: in_subtree(path, prefix)):
                for f in self.fs.files_under(prefix):
                    if f.role is FileRole.LOCAL and f.owes_flush and f not in pending:
                        self.flusher.enqueue(f)
                        pending.append(f)
            while True:
                # A buddy's death during the wait starts a takeover whose
                # files only this cache holds: wait for those too.
                await self.cache.takeovers_settled()
                more = [f for f in self.taken_over(prefix) if f not in pending]
                for f in more:  # queued at the takeover; waited for here
                    self.flusher.enqueue(f)
                pending += more
                with self.flusher.awaited(pending):
                    for f in pending:
                        while f.owes_flush:
                            await f.durable_event.wait()
                owed = self.taken_over(prefix)
                if not self.cache.takeover_running and all(f in pending for f in owed):
                    break
        failed += [f.path for f in pending if f.owes_flush]
        # Cut short by the timeout while a takeover was under way or after it
        # turned files over: those are not durable either.
        failed += [f.path for f in self.taken_over(prefix) if f not in pending]
        if self.cache.takeover_running:
            failed.append("(a takeover from a dead buddy under way)")
        failed += [
            f"{path} (kept from before a crash; the store has not answered for it)"
            for path, _ in self.cache.unconfirmed.paths()
            if in_subtree(path, prefix)
        ]
        return {
            "ok": not failed,
            "files": len(pending),
            "not_durable": failed,
            **({"error": f"{len(failed)} file(s) not durable yet"} if failed else {}),
        }

    async def flush(self, prefix: str) -> tuple[int, list[str]]:
        """Queue persistence of what changed under ``prefix``: (files queued,
        the files whose commit failed, each with its cause). A failed commit
        (the store refusing one manifest) does not keep the rest from going."""
        count, failed = 0, []
        try:
            for f in self.fs.files_under(prefix):
                if f.state is FileState.MODIFIED and not f.writers:
                    try:
                        await self.fs.commit(f, only_closed=True)
                    except OSError as exc:
                        failed.append(f"{f.path} ({exc.strerror or exc})")
                        continue
                if f.owes_flush:
                    self.flusher.enqueue(f)
                    count += 1
        finally:  # what was queued before a cancellation is wanted too
            self.flusher.hurry()
        return count, failed

    def evict(self, prefix: str) -> tuple[int, list[str]]:
        """Drop durable cached bytes under ``prefix``: (bytes freed, paths kept)."""
        freed, kept = 0, []
        for f in self.fs.files_under(prefix):
            if f.state is FileState.DURABLE and not f.writers:
                freed += self.cache.evict(f)
            elif f.ram_count:
                kept.append(f.path)
        return freed + self.cache.evict_frames(), kept

    async def _prefault(self) -> None:
        """Touch the whole arena once, in the background (see arena.py)."""
        start = time.monotonic()
        for _ in range(-(-self.arena.nslots // 16)):
            batch = self.arena.take_prefault_batch(16)
            if not batch:
                break
            try:
                self.prefaulted += await trio.to_thread.run_sync(self.arena.prefault, batch)
            except OSError as exc:
                log.error("pre-faulting the cache in %s stopped: %s", self.cache_root, exc)
                self.prefault = Prefault.STOPPED
                return
            finally:
                self.arena.return_prefault_batch(batch)
        self.prefault = Prefault.DONE
        log.info(
            "pre-faulted %d MiB of cache in %.1fs", self.prefaulted >> 20, time.monotonic() - start
        )

    async def history_lines(self, query: Query) -> list[dict[str, Any]]:
        """Every node's history lines that ``query`` wants, oldest first
        (fs/store/history.py), with ISO times. One reading at a time, in a
        thread of its own rather than through the store's calls: any user
        may ask, and a large history must neither hold a slot a flush needs
        nor count as the store being slow."""
        # This node's own, if the `history` key keeps it outside the store.
        extra = (self.config.history_file, self.config.node) if self.config.history_file else None
        with trio.fail_after(self.config.backing_timeout):
            lines = await trio.to_thread.run_sync(
                read_all, self.dirs, query, extra, limiter=self._history_reader,
                abandon_on_cancel=True,
            )  # fmt: skip
        return [{**line, "time": line["time"].isoformat()} for line in lines]

    async def _on_durable(self, f: CachedFile, manifest: Manifest) -> None:
        now = time.time()
        closed = f.closed_at or now
        record = {
            "time": utc_time(now),
            "path": f.path,
            "size": f.size,
            "close_s": round(closed - f.opened_at, 3),
            # From the open, as close_s; empty if no buddy acknowledged it.
            "mirrored_s": round(f.mirrored_at - f.opened_at, 3) if f.mirrored_at else "",
            "durable_s": round(now - closed, 3),
            "throughput_MBps": round(f.size / max(now - f.opened_at, 1e-6) / 1e6, 1),
            "uid": f.uid,
        }
        self.history.add(record, f.uid)
        log.info("durable: %s (%d bytes, %.2fs after close)", f.path, f.size, now - closed)
        if self.timings is not None:
            self.timings.file_durable(
                now - closed, f.mirrored_at - closed if f.mirrored_at and f.closed_at else None
            )
        if f.role is not FileRole.TAKEOVER:  # retention is the writer's to apply
            await self._retention(f.path)

    async def _retention(self, path: str) -> None:
        """After a file in a checkpoint directory is durable, prune older ones."""
        keep = self.config.retention_keep_last
        parts = path.split("/")
        hits = [
            i
            for i, part in enumerate(parts[:-1])
            if fnmatch.fnmatchcase(part, self.config.retention_pattern)
        ]
        if not keep or not hits:
            return
        checkpoint_dir = "/".join(parts[: hits[-1] + 1])
        if any(f.state is not FileState.DURABLE for f in self.fs.files_under(checkpoint_dir)):
            return  # apply_retention waits for the whole directory: walk once, at its end
        rel = "/".join(parts[: hits[-1]])
        audit = (
            file_audit(self.config.retention_audit_log)
            if self.config.retention_audit_log
            else fd_audit(self.dirs.private(), "retention.log")
        )
        root = self.backing_root / rel if rel else self.backing_root
        try:
            await self.io.run(
                retain_beneath,
                self.dirs.root_fd,
                rel,
                self.config.retention_pattern,
                keep,
                audit,
                self.backing.key,
                what=f"retention under {root}",
            )
        except OSError as exc:
            log.error("retention under %s failed: %s", root, exc)
