"""One ckptfs daemon: FUSE session, flusher, spiller, pre-fault and control
endpoint on one trio event loop.

Shutdown (``ckptfs umount``, SIGTERM, SIGINT): commit files still open for
writing, wait until everything is durable, then end the FUSE session and
unmount. A second signal skips the wait; dirty data then stays in the tmpfs
arena and its journal, and the next daemon on this mountpoint adopts it.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio
from ckptfs.fs.config import Config
from ckptfs.fs.daemon import control, sdnotify
from ckptfs.fs.daemon.core import Core
from ckptfs.fs.daemon.preflight import mount_id, run_files
from ckptfs.fs.daemon.statview import StatView, Viewer, daemon_health, progress
from ckptfs.fs.fuse.kernelpages import KernelPages
from ckptfs.fs.fuse.mount import MountFailed, mount, unmount
from ckptfs.fs.fuse.operations import Operations
from ckptfs.fs.fuse.session import Session, notify_store
from ckptfs.fs.fuse.session import describe as describe_session
from ckptfs.fs.store.history import Query
from ckptfs.peer.node import PeerNode
from ckptfs.peer.reads.represent import Representation

if TYPE_CHECKING:
    from ckptfs.fs.daemon.metrics import Metrics

GIL_SWITCH_INTERVAL = 0.0001
# How long the mount may take to answer its first stat before the daemon says so.
READY_TIMEOUT = 60.0

log = logging.getLogger("ckptfs.daemon")


class Daemon:
    def __init__(self, config: Config, mountpoint: Path) -> None:
        self.config = config
        self.mountpoint = mountpoint
        # The mount's owner (who owns the mountpoint, e.g. the job's user under a
        # root daemon) may flush, evict and unmount it, as root may.
        self.owners = {os.stat(mountpoint).st_uid, os.geteuid()}
        self.sock_path, self.pid_path, _ = run_files(config.run_dir, mountpoint)
        self.metrics: Metrics | None = None
        if config.metrics_listen is not None:
            from ckptfs.fs.daemon.metrics import Metrics  # prometheus-client, only when asked

            self.metrics = Metrics(config.metrics_listen)
        self.core = Core(
            config,
            config.cache_dir / mount_id(mountpoint),
            timings=self.metrics.timings if self.metrics else None,
        )
        self.peer = (
            PeerNode(
                config.peers_config,
                self.core.serve_peer_read,
                cache=self.core.cache,
                manifest_at=self.core.backing.manifest,
                mirror_writes=config.durability == "buddy",
            )
            if config.peers_config
            else None
        )
        if self.peer is not None:
            self.core.cache.peer_fetch = self.peer.fetch
        # Durable chunks several nodes want: read from the store by one node.
        self.represent: Representation | None = (
            self.peer.represent(self.core.cache.frames, self.core.cache.try_alloc)
            if self.peer is not None
            else None
        )
        self.started = time.time()
        self._terminating = False
        self.session: Session | None = None

    # ----- lifecycle ----------------------------------------------------------
    async def run(self) -> None:
        core = self.core
        clean = False
        started = mounted = False
        try:
            async with trio.open_nursery() as nursery:
                self.nursery = nursery
                await core.start(nursery)
                started = True
                if self.peer is not None:
                    await nursery.start(self.peer.run)
                    mirror = self.peer.mirror_client
                    if mirror is not None:
                        core.fs.mirror = mirror
                        core.cache.on_page_changed = mirror.changed
                        core.cache.on_mirror_done = mirror.done
                ops = Operations(core.fs, self.config.writeback_cache, self.config.direct_writes)
                if self.metrics is not None:
                    await self._start_metrics(self.metrics)
                fd = self._mount()
                mounted = True
                try:
                    self.session = Session(fd, ops.handlers(), workers=self.config.fuse_workers)
                    session = self.session
                    core.fs.kernel_pages = KernelPages(
                        fd, notify_store, allowed=lambda: session.direct_writes_drop_pages
                    )
                    await nursery.start(control.serve, self.sock_path, self._routes(), self.owners)
                    nursery.start_soon(self._signals)
                    nursery.start_soon(set_read_ahead, self.mountpoint, self.config.read_ahead_kb)
                    self.pid_path.write_text(f"{os.getpid()}\n")
                    log.info(
                        "mounted %s (backing %s, node %s, cache %d MiB at %s, durability %s%s)",
                        self.mountpoint,
                        core.backing_root,
                        self.config.node,
                        core.arena.capacity >> 20,
                        core.cache_root,
                        self.config.durability,
                        f", {core.recovered} file(s) recovered" if core.recovered else "",
                    )
                    if core.cache.unconfirmed:
                        log.warning(
                            "%d file(s) from before a crash kept in the cache unconfirmed: "
                            "the store did not answer for them; asking again",
                            len(core.cache.unconfirmed),
                        )
                    nursery.start_soon(self._tell_systemd_when_mounted)
                    await self.session.run()
                    clean = core.all_durable()
                finally:
                    self._no_more_pushes()
                    sdnotify.notify("STOPPING=1")
                    try:
                        unmount(str(self.mountpoint))
                    finally:
                        if self.session is not None:
                            self.session.close()
                        else:
                            os.close(fd)
                nursery.cancel_scope.cancel()
        finally:
            if self.metrics is not None:
                self.metrics.close()
            core.close()
            self.pid_path.unlink(missing_ok=True)
            if clean:
                shutil.rmtree(core.cache_root, ignore_errors=True)
                log.info("unmounted %s; everything was durable", self.mountpoint)
            elif mounted:
                log.warning(
                    "unmounted %s with data not yet durable; it stays in %s for the next mount",
                    self.mountpoint,
                    core.cache_root,
                )
                self._log_takeovers_dropped()
            elif started and core.all_durable():
                # The mount failed (its error is logged) with nothing to keep:
                # the cache's RAM goes back now, not at the next mount.
                shutil.rmtree(core.cache_root, ignore_errors=True)
            else:
                log.warning(
                    "%s was not mounted; the cache at %s, with data not yet durable, "
                    "stays for the next mount",
                    self.mountpoint,
                    core.cache_root,
                )

    def _log_takeovers_dropped(self) -> None:
        # Mirrors have no journal record: the next mount cannot flush them.
        owed = self.core.taken_over("")
        if owed or self.core.cache.takeover_running:
            log.error(
                "unmounted with files taken over from a dead buddy not yet durable: %s "
                "stay pending, their bytes only in the dead writer's cache, if it comes back",
                ", ".join(f.path for f in owed) or "the files being taken over",
            )

    def _mount(self) -> int:
        """The FUSE mount; its /dev/fuse descriptor."""
        options = {"default_permissions"}
        if self.config.allow_other:
            options.add("allow_other")
        try:
            return mount(str(self.mountpoint), "ckptfs", options)
        except MountFailed as exc:
            if "allow_other" in options and "user_allow_other" in str(exc.strerror):
                # fusermount3 lets an unprivileged daemon open the mount to
                # other users only where the administrator allowed it.
                raise MountFailed(
                    exc.errno,
                    f"{exc.strerror} (fuse.allow_other is on by default so that jobs of any"
                    " user can use the mount; a daemon run by an ordinary user needs"
                    " 'user_allow_other' in /etc/fuse.conf for that, or `fuse: {allow_other:"
                    " false}` in its config, which leaves the mount to that user alone)",
                ) from None
            raise

    def _end_session(self) -> None:
        self._no_more_pushes()
        if self.session is not None:
            self.session.terminate()

    def _no_more_pushes(self) -> None:
        # Nobody reads the READs a push may wait for once the session ends.
        if self.core.fs.kernel_pages is not None:
            self.core.fs.kernel_pages.close()

    async def _signals(self) -> None:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for signum in signals:
                if self._terminating:
                    # Requests still waiting (a close at durability backing
                    # waits for the store) are cancelled: what they wrote
                    # stays in the cache for the next mount.
                    log.warning("second signal: unmounting without waiting for the flush")
                    self._no_more_pushes()
                    if self.session is not None:
                        self.session.abort()
                    return
                log.info("signal %s: flushing, then unmounting", signal.Signals(signum).name)
                self.nursery.start_soon(self._drain_and_terminate)

    async def _drain_and_terminate(self, timeout: float | None = None) -> None:
        self._terminating = True
        try:
            await self.core.drain("", timeout)
        finally:
            self._end_session()

    # ----- control ------------------------------------------------------------------
    def _routes(self) -> dict[str, control.Route]:
        return {
            "ping": control.Route(self._ping, privileged=False),
            "history": control.Route(self._history, privileged=False),
            "stat": control.Route(self._stat, privileged=False),
            # Whether this node holds a version (`ckptfs check`): the mount's
            # owner needs it for a check of its own mount.
            "holds": control.Route(self._holds, privileged=True),
            "flush": control.Route(self._flush, privileged=True),
            "evict": control.Route(self._evict, privileged=True),
            "unmount": control.Route(self._unmount, privileged=True),
        }

    async def _start_metrics(self, metrics: Metrics) -> None:
        async def snapshot() -> dict[str, Any]:
            # What `ckptfs stat --json` shows root: every file counted.
            return await self._stat({}, control.Peer(pid=os.getpid(), uid=0, gid=0))

        try:
            await metrics.start(snapshot)
        except OSError as exc:
            raise MountFailed(
                exc.errno, f"metrics.listen {metrics.listen}: {exc.strerror or exc}"
            ) from None

    async def _tell_systemd_when_mounted(self) -> None:
        """READY=1 for a ``Type=notify`` unit once the mount answers: a stat
        of the mountpoint goes through the kernel to this daemon's session,
        so units ordered after this one find the filesystem, not the empty
        directory under it."""

        def stat_then_notify() -> None:
            # Answered by this daemon (a stat of the mount's root), and on
            # another device than the directory it is mounted in.
            if os.stat(self.mountpoint).st_dev == os.stat(self.mountpoint.parent).st_dev:
                raise OSError(f"{self.mountpoint} does not show the mount")
            sdnotify.notify("READY=1", f"STATUS=mounted {self.mountpoint} over "
                            f"{self.core.backing_root}", f"MAINPID={os.getpid()}")  # fmt: skip

        last: Exception | None = None
        with trio.move_on_after(READY_TIMEOUT):
            while True:
                try:
                    await trio.to_thread.run_sync(stat_then_notify, abandon_on_cancel=True)
                    return
                except OSError as exc:
                    # A store marked down (a hung call at recovery) fails the
                    # root's stat for a few seconds: ask again.
                    last = exc
                await trio.sleep(1)
        # systemd times the start out (TimeoutStartSec) and says so.
        log.error("the mount did not answer a stat of %s: %s", self.mountpoint, last or
                  f"no answer within {READY_TIMEOUT:g}s")  # fmt: skip

    async def _history(self, req: dict[str, Any], peer: control.Peer) -> dict[str, Any]:
        """``ckptfs history``: lines of every node (fs/store/history.py), a
        user's own files' only, unless root asks."""
        since, until, limit = req.get("since"), req.get("until"), req.get("limit", 1000)
        for name, value in (("since", since), ("until", until)):
            if value is not None and not isinstance(value, int | float):
                raise ValueError(f"{name} must be seconds since the epoch")
        if not isinstance(limit, int) or limit < 1:
            raise ValueError("limit must be a positive integer")
        query = Query(
            uid=None if peer.uid == 0 else peer.uid,
            prefix=str(req.get("path", "")),
            since=since,
            until=until,
            limit=min(limit, 100_000),
        )
        return {"ok": True, "lines": await self.core.history_lines(query)}

    async def _ping(self, req: dict[str, Any], peer: control.Peer) -> dict[str, Any]:
        return {
            "ok": True,
            "pid": os.getpid(),
            "mountpoint": str(self.mountpoint),
            "backing": str(self.core.backing_root),
            "node": self.config.node,
        }

    async def _holds(self, req: dict[str, Any], peer: control.Peer) -> dict[str, Any]:
        """Which of the (file id, version) pairs this node holds (Cache.holds)."""
        files = req.get("files")
        if not isinstance(files, list) or not all(
            isinstance(x, list) and len(x) == 2 and all(isinstance(y, str) for y in x)
            for x in files
        ):
            raise ValueError("'files' must be a list of [file id, version] pairs")
        return {"ok": True, "held": [self.core.cache.holds(i, v) for i, v in files]}

    async def _stat(self, req: dict[str, Any], peer: control.Peer) -> dict[str, Any]:
        """The mount's state; files named only to their owner and root
        (fs/daemon/statview.py), the others counted in ``not_shown``."""
        core = self.core
        view = StatView(Viewer(peer.uid))
        files = view.files(core.fs.files_under(""), core.taken_over(""), str(req.get("path", "")))
        own_paths = {f.path for f in core.cache.all_files() if f.uid == peer.uid}
        mirroring = self.peer.mirror_stats() if self.peer else {}
        flush = view.flush(core.flusher.stats(), core.flusher.active)
        return {
            "ok": True,
            "mountpoint": str(self.mountpoint),
            "backing": str(core.backing_root),
            "node": self.config.node,
            "pid": os.getpid(),
            "durability": self.config.durability,
            "uptime": round(time.time() - self.started, 1),
            "memory": await trio.to_thread.run_sync(memory_usage),
            "cache": {
                **core.cache.stats(),
                "dir": str(core.cache_root),
                "prefaulted": core.prefaulted,
                "prefault": core.prefault.value,
            },
            "flush": flush,
            "fuse": {
                **core.fs.describe(),
                **describe_session(self.session),
            },
            "daemon_health": daemon_health(self._terminating, flush["failing"]),
            "backing_health": core.io.health,
            # The error behind a health of full or failing (errno, what, when).
            "backing_error": view.backing_error(core.io.describe_trouble()),
            "backing_calls": {
                "total": core.io.calls,
                "slow": core.io.slow_calls,
                "timed_out": core.io.timeouts,
            },
            # "taken_over": dead buddies' files this node took over and is
            # making durable.
            **files,
            # Bytes by state, and the time until they are durable (whole mount).
            "progress": progress(
                [*core.fs.files_under(""), *core.taken_over("")], flush["progress_throughput"]
            ),
            "peers": self.peer.stats() if self.peer else [],
            # This daemon process as its peers know it: each peer's entry
            # above names the one it last heard from.
            "incarnation": self.peer.membership.incarnation if self.peer else None,
            "peer_reads": self.peer.counters() if self.peer else {},
            "mirroring": view.mirroring(mirroring, core.cache.mirrors.values(), own_paths),
            "representative": self.represent.counters() if self.represent else {},
            "history": view.history(core.history.recent),
            "not_shown": view.not_shown,
        }

    async def _flush(self, req: dict[str, Any], peer: control.Peer) -> dict[str, Any]:
        prefix = str(req.get("path", ""))
        if req.get("wait"):
            timeout = req.get("timeout")
            return await self.core.drain(prefix, float(timeout) if timeout else None)
        queued, failed = await self.core.flush(prefix)
        return {
            "ok": not failed,
            "files": queued,
            "not_durable": failed,
            **({"error": f"{len(failed)} file(s) could not be committed"} if failed else {}),
        }

    async def _evict(self, req: dict[str, Any], peer: control.Peer) -> dict[str, Any]:
        freed, kept = self.core.evict(str(req.get("path", "")))
        return {"ok": True, "freed": freed, "not_durable": kept}

    async def _unmount(self, req: dict[str, Any], peer: control.Peer) -> dict[str, Any]:
        if req.get("force"):
            return self._force_unmount(peer)
        timeout = req.get("timeout")
        result = await self.core.drain("", float(timeout) if timeout else None)
        if result["ok"]:
            self.nursery.start_soon(self._terminate_soon)
        return result

    def _force_unmount(self, peer: control.Peer) -> dict[str, Any]:
        """Detach at once, flushing nothing (a full or hung store would make
        the flush wait for ever): what is not durable stays in the cache,
        with its journal, for the next mount of this mountpoint, as after a
        second SIGTERM. Requests still waiting are answered with an error."""
        left = self.core.not_durable()
        log.warning(
            "forced unmount of %s: %d file(s) not durable stay in %s for the next mount",
            self.mountpoint,
            len(left),
            self.core.cache_root,
        )
        self._terminating = True
        self.nursery.start_soon(self._abort_soon)
        shown = left if peer.uid == 0 else [f for f in left if f[1] == peer.uid]
        return {
            "ok": True,
            "forced": True,
            "not_durable_count": len(left),
            "not_durable": [path for path, _ in shown],
            "cache": str(self.core.cache_root),
        }

    async def _abort_soon(self) -> None:
        await trio.sleep(0.05)  # let the reply reach the client first
        self._no_more_pushes()
        if self.session is not None:
            self.session.abort()

    async def _terminate_soon(self) -> None:
        self._terminating = True
        await trio.sleep(0.05)  # let the reply reach the client first
        self._end_session()


def memory_usage() -> dict[str, int]:
    """The daemon's resident memory, split as /proc reports it: anonymous memory
    is what the daemon holds outside the arena; shared memory is arena pages
    this process has mapped."""
    fields = {"VmRSS": "rss", "RssAnon": "anon", "RssFile": "file", "RssShmem": "shmem"}
    out = {}
    with open("/proc/self/status") as status:
        for line in status:
            key, _, value = line.partition(":")
            if key in fields:
                out[fields[key]] = int(value.split()[0]) * 1024
    return out


async def set_read_ahead(mountpoint: Path, kb: int) -> None:
    """Larger kernel read-ahead for the mount: sequential torch.load reads then
    arrive as several 1 MiB requests in flight instead of 128 KiB ones
    (measured here: 2.0 -> 2.8-3.3 GiB/s from the RAM cache). Found through
    mountinfo, since stat() of the mountpoint would wait for our own loop; set
    again until it sticks, because the kernel resets it when FUSE INIT is answered."""
    try:
        with open("/proc/self/mountinfo") as mountinfo:
            device = next(
                line.split()[2] for line in mountinfo if line.split()[4] == str(mountpoint)
            )
        knob = Path(f"/sys/class/bdi/{device}/read_ahead_kb")
        for _ in range(50):
            knob.write_text(f"{kb}\n")
            await trio.sleep(0.1)
            if int(knob.read_text()) == kb:
                return
        log.warning("read-ahead of %s did not stay at %d KiB", mountpoint, kb)
    except PermissionError as exc:
        # A daemon run by an ordinary user: nothing it can change. Loads then
        # read in the kernel's default read-ahead (128 KiB requests).
        log.info("read-ahead of %s left at the kernel's default: %s", mountpoint, exc)
    except (OSError, StopIteration, ValueError) as exc:
        log.warning("could not set read-ahead of %s to %d KiB: %s", mountpoint, kb, exc)


def run_daemon(config: Config, mountpoint: Path) -> None:
    try:
        _run_daemon(config, mountpoint)
    except* MountFailed as failed:
        # One line for the log and for `ckptfs mount`, which shows the
        # daemon's last error line, rather than a traceback of the nursery.
        for exc in failed.exceptions:
            log.error("%s", exc.strerror)
        sys.exit(1)


def _run_daemon(config: Config, mountpoint: Path) -> None:
    faulthandler.register(signal.SIGUSR1)
    # 0755: every user may reach the control socket (it checks who asks).
    config.run_dir.mkdir(parents=True, exist_ok=True, mode=0o755)
    # Every backing-store call is a thread that needs the GIL for a moment
    # while the event loop holds it. At the default 5 ms switch interval each
    # such call waited up to 5 ms behind the loop: a stat took 9 ms under load.
    sys.setswitchinterval(GIL_SWITCH_INTERVAL)
    trio.run(Daemon(config, mountpoint).run)
