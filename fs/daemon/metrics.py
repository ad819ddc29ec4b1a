"""Prometheus metrics of one mount (``metrics.listen``; off by default).

What an operator alerts on: bytes by state and bytes not yet in the store,
throughput counters (``rate()`` of stored, mirrored and peer-read bytes),
backpressure, lost files, the store's health, its error and its call
latency, each peer's health, and how long files take from close to
mirrored and to durable.

Two sources, both through prometheus-client:
- Timings: histograms observed where the event happens (a store call's end,
  a file made durable); prometheus-client's histograms are thread-safe, and
  the store's calls end in worker threads.
- Everything else is read at scrape time from the same snapshot as
  ``ckptfs stat`` (the daemon's stat reply for root), taken on the event loop
  (the scrape runs in the HTTP server's thread, which must not read the
  loop's state itself), within SNAPSHOT_TIMEOUT.

Labels stay bounded: states, peer names from the configuration, and the
daemon's version and node; never a path.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import trio
from ckptfs import __version__
from ckptfs.peer.config import Address
from prometheus_client import CollectorRegistry, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily
from prometheus_client.registry import Collector

log = logging.getLogger("ckptfs.metrics")

SNAPSHOT_TIMEOUT = 10.0
SNAPSHOT_REUSE = 1.0  # seconds a snapshot answers further scrapes
STORE_HEALTH = ("normal", "slow", "down", "full", "failing")
DAEMON_HEALTH = ("ok", "unmounting", "flush failing")  # statview.daemon_health
CACHE_STATES = ("dirty", "mirrored", "flushing", "durable")
# A store call is a metadata operation (ms) or a chunk's read or write (up to
# seconds on a loaded NFS server); a file's close to durable is seconds to
# minutes for a checkpoint shard.
CALL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
FILE_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)

Snapshot = Callable[[], Awaitable[dict[str, Any]]]


class Timings:
    """Histograms of events, observed where they happen."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.store_call = Histogram(
            "ckptfs_store_call_seconds",
            "Time of a call to the backing store that answered (timeouts are counted apart)",
            buckets=CALL_BUCKETS,
            registry=registry,
        )
        self.close_to_mirrored = Histogram(
            "ckptfs_close_to_mirrored_seconds",
            "From a file's close to its buddy's acknowledgement (files a buddy mirrored)",
            buckets=FILE_BUCKETS,
            registry=registry,
        )
        self.close_to_durable = Histogram(
            "ckptfs_close_to_durable_seconds",
            "From a file's close to its manifest durable in the backing store",
            buckets=FILE_BUCKETS,
            registry=registry,
        )

    def file_durable(self, closed_s: float, mirrored_s: float | None) -> None:
        self.close_to_durable.observe(max(0.0, closed_s))
        if mirrored_s is not None:
            self.close_to_mirrored.observe(max(0.0, mirrored_s))


class _StatCollector(Collector):
    """One snapshot at a time, and one per SNAPSHOT_REUSE seconds whatever
    the number of scrapers: each costs the event loop a walk over every
    file, and anyone who reaches the port may scrape (each request is a
    thread of the HTTP server)."""

    def __init__(self, snapshot: Snapshot, token: trio.lowlevel.TrioToken) -> None:
        self._snapshot = snapshot
        self._token = token
        self._lock = threading.Lock()
        self._last: tuple[float, dict[str, Any]] | None = None

    def _take(self) -> dict[str, Any]:
        async def bounded() -> dict[str, Any]:
            with trio.fail_after(SNAPSHOT_TIMEOUT):
                return await self._snapshot()

        with self._lock:
            if self._last is not None and time.monotonic() - self._last[0] < SNAPSHOT_REUSE:
                return self._last[1]
            s = trio.from_thread.run(bounded, trio_token=self._token)
            self._last = (time.monotonic(), s)
            return s

    def collect(self) -> Iterator[Any]:
        try:
            s = self._take()
        except (trio.RunFinishedError, trio.Cancelled):
            return  # the daemon is stopping: only the histograms are left
        except trio.TooSlowError:
            log.warning("metrics: no snapshot of the daemon within %gs", SNAPSHOT_TIMEOUT)
            raise
        yield from stat_metrics(s)


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)


def _one_of(name: str, doc: str, current: str, states: tuple[str, ...]) -> GaugeMetricFamily:
    """1 for the current state, 0 for the others (an alert matches == 1)."""
    family = GaugeMetricFamily(name, doc, labels=["state"])
    for state in dict.fromkeys((*states, current)):
        family.add_metric([state], 1.0 if state == current else 0.0)
    return family


def stat_metrics(s: dict[str, Any]) -> Iterator[Any]:
    """The metrics of one stat snapshot (the daemon's stat reply for root)."""
    info = InfoMetricFamily("ckptfs", "The daemon of this mount")
    info.add_metric([], {"version": s.get("version", __version__), "node": s["node"],
                         "durability": s["durability"]})  # fmt: skip
    yield info
    progress = s["progress"]
    by_bytes = GaugeMetricFamily(
        "ckptfs_cache_bytes",
        "Bytes of files by state",
        labels=["state"],
    )
    by_files = GaugeMetricFamily("ckptfs_cache_files", "Files by state", labels=["state"])
    for state in CACHE_STATES:
        by_bytes.add_metric([state], progress[state]["bytes"])
        by_files.add_metric([state], progress[state]["files"])
    yield by_bytes
    yield by_files
    yield _gauge(
        "ckptfs_to_store_bytes", "Bytes not yet in the backing store", progress["to_store"]
    )
    cache = s["cache"]
    yield _gauge("ckptfs_cache_capacity_bytes", "The RAM cache's budget", cache["capacity"])
    yield _gauge("ckptfs_cache_used_bytes", "RAM cache in use", cache["used"])
    yield _gauge("ckptfs_writers_waiting", "Writers held back now for want of RAM",
                 cache["waiting_writers"])  # fmt: skip
    yield _gauge("ckptfs_unconfirmed_files", "Files kept from before a crash that the store "
                 "has not answered for yet", cache.get("unconfirmed", 0))  # fmt: skip
    yield _counter("ckptfs_backpressure_seconds", "Time writers were held back for want of RAM",
                   cache["backpressure_seconds"])  # fmt: skip
    yield _counter("ckptfs_backpressure_events", "Writes held back for want of RAM",
                   cache["backpressure_events"])  # fmt: skip
    flush = s["flush"]
    yield _counter("ckptfs_flush_stored_bytes", "Bytes written to the backing store",
                   flush["bytes_stored"])  # fmt: skip
    yield _counter("ckptfs_flush_deduped_bytes", "Bytes found already in the store (not written)",
                   flush["bytes_deduped"])  # fmt: skip
    yield _counter("ckptfs_files_durable", "Files made durable", flush["files_durable"])
    yield _counter("ckptfs_flush_failures", "Flushes that failed (each is retried)",
                   flush["failures"])  # fmt: skip
    yield _gauge("ckptfs_flush_failing_files", "Files whose last flush failed", flush["failing"])
    lost = len(s["lost"]) + s["not_shown"]["lost"]
    yield _gauge("ckptfs_lost_files", "Files whose bytes are gone (see ckptfs check)", lost)
    yield _one_of("ckptfs_store_health", "The backing store's health", s["backing_health"],
                  STORE_HEALTH)  # fmt: skip
    # The errno of the store's last full or failing error, by name (ENOSPC,
    # EIO...): a bounded set. No sample while there is none.
    error = GaugeMetricFamily("ckptfs_store_error", "The store's last full or failing error",
                              labels=["errno"])  # fmt: skip
    if s.get("backing_error"):
        error.add_metric([str(s["backing_error"]["errno"])], 1.0)
    yield error
    yield _one_of("ckptfs_daemon_health", "The daemon's health", s["daemon_health"], DAEMON_HEALTH)
    calls = s["backing_calls"]
    yield _counter("ckptfs_store_calls", "Calls to the backing store", calls["total"])
    yield _counter(
        "ckptfs_store_calls_slow", "Store calls slower than the slow mark", calls["slow"]
    )
    yield _counter("ckptfs_store_calls_timed_out", "Store calls given up on", calls["timed_out"])
    yield from _peer_metrics(s)


def _peer_metrics(s: dict[str, Any]) -> Iterator[Any]:
    mirroring = s.get("mirroring") or {}
    writer = mirroring.get("writer") or {}
    yield _counter("ckptfs_mirror_sent_bytes", "Bytes mirrored to this node's buddy",
                   writer.get("bytes_sent", 0))  # fmt: skip
    yield _counter("ckptfs_mirror_fallbacks", "Files the buddy could not mirror (written "
                   "through to the store instead)", writer.get("fallbacks", 0))  # fmt: skip
    yield _gauge("ckptfs_mirror_held_bytes", "Bytes held here for nodes whose buddy this is",
                 mirroring.get("mirrored_bytes", 0))  # fmt: skip
    yield _counter("ckptfs_takeovers", "Mirrored files taken over from dead writers",
                   mirroring.get("takeovers", 0))  # fmt: skip
    reads = s.get("peer_reads") or {}
    read_bytes = CounterMetricFamily(
        "ckptfs_peer_read_bytes", "Bytes read from peers' RAM (fetched) and for them (served)",
        labels=["direction"],
    )  # fmt: skip
    read_bytes.add_metric(["fetched"], reads.get("bytes_fetched", 0))
    read_bytes.add_metric(["served"], reads.get("bytes_served", 0))
    yield read_bytes
    up = GaugeMetricFamily("ckptfs_peer_up", "1 while a peer answers heartbeats", labels=["peer"])
    rtt = GaugeMetricFamily("ckptfs_peer_rtt_seconds", "A peer's heartbeat round trip",
                            labels=["peer"])  # fmt: skip
    for peer in s.get("peers") or []:
        up.add_metric([peer["name"]], 1.0 if peer["alive"] else 0.0)
        if peer.get("rtt_ms") is not None:
            rtt.add_metric([peer["name"]], peer["rtt_ms"] / 1000)
    yield up
    yield rtt


class Metrics:
    """The registry, the timings and the HTTP endpoint of one daemon."""

    def __init__(self, listen: Address) -> None:
        self.listen = listen
        self.registry = CollectorRegistry(auto_describe=False)
        self.timings = Timings(self.registry)
        self._server: Any = None
        self._thread: threading.Thread | None = None

    async def start(self, snapshot: Snapshot) -> None:
        """Serve /metrics from the HTTP server's own thread. Scrapes take
        their snapshot on this loop. Binding fails here (an address in use,
        no such address), before the mount."""
        self.registry.register(_StatCollector(snapshot, trio.lowlevel.current_trio_token()))
        self._server, self._thread = await trio.to_thread.run_sync(
            start_http_server, self.listen.port, self.listen.host, self.registry
        )
        log.info("metrics at http://%s/metrics", self.listen)

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
