"""The Prometheus endpoint of a mount (fs/daemon/metrics.py): scraped over
HTTP as a Prometheus server would, its numbers checked against what was
written and against ``ckptfs stat``."""

from __future__ import annotations

import os
import socket
import threading
import time

from ckptfs import __version__
from conftest import Mount, free_port, wait_for
from scrape import scrape, value


def metrics_mount(mounts) -> tuple[Mount, str]:  # type: ignore[no-untyped-def]
    m = mounts()
    address = f"127.0.0.1:{free_port()}"
    m.mount(env={"CKPTFS_METRICS_LISTEN": address})
    return m, address


def test_a_scrape_counts_what_was_written_and_made_durable(mounts) -> None:  # type: ignore[no-untyped-def]
    m, address = metrics_mount(mounts)
    data = os.urandom(3_000_000)
    with open(m.mnt / "shard-0.pt", "wb") as f:
        f.write(data)
        f.flush()
        open_now = scrape(address)  # written, not closed: dirty
    assert value(open_now, "ckptfs_cache_bytes", state="dirty") == len(data)
    assert value(open_now, "ckptfs_cache_files", state="dirty") == 1
    assert value(open_now, "ckptfs_to_store_bytes") == len(data)
    m.wait_durable()
    # A snapshot answers the scrapes of the next second (SNAPSHOT_REUSE).
    wait_for(lambda: value(scrape(address), "ckptfs_files_durable_total") == 1, 10, "durable")
    s = scrape(address)
    assert value(s, "ckptfs_info", version=__version__, node=m.stat()["node"],
                 durability="local") == 1  # fmt: skip
    assert value(s, "ckptfs_cache_bytes", state="durable") == len(data)
    assert value(s, "ckptfs_cache_bytes", state="dirty") == 0
    assert value(s, "ckptfs_to_store_bytes") == 0
    assert value(s, "ckptfs_files_durable_total") == 1
    assert value(s, "ckptfs_flush_stored_bytes_total") == len(data)
    assert value(s, "ckptfs_close_to_durable_seconds_count") == 1
    assert 0 < value(s, "ckptfs_close_to_durable_seconds_sum") < 60
    assert value(s, "ckptfs_close_to_mirrored_seconds_count") == 0  # no buddy here
    calls = value(s, "ckptfs_store_call_seconds_count")
    assert calls > 0 and calls <= value(s, "ckptfs_store_calls_total")
    assert value(s, "ckptfs_store_health", state="normal") == 1
    assert value(s, "ckptfs_store_health", state="full") == 0
    assert value(s, "ckptfs_daemon_health", state="ok") == 1
    assert value(s, "ckptfs_lost_files") == 0
    assert value(s, "ckptfs_cache_capacity_bytes") == m.stat()["cache"]["capacity"]
    assert value(s, "ckptfs_backpressure_seconds_total") == 0
    # Bounded labels: no path, ever.
    assert not [k for k in s if any("shard" in v for _, v in k[1])], s
    # A second file adds to the counters, and to the histogram.
    (m.mnt / "shard-1.pt").write_bytes(os.urandom(1000))
    m.wait_durable()
    wait_for(lambda: value(scrape(address), "ckptfs_files_durable_total") == 2, 10, "durable")
    s = scrape(address)
    assert value(s, "ckptfs_close_to_durable_seconds_count") == 2
    assert value(s, "ckptfs_cache_files", state="durable") == 2


def test_metrics_are_off_unless_asked_and_an_address_in_use_stops_the_mount(mounts) -> None:  # type: ignore[no-untyped-def]
    plain = mounts("plain")
    plain.mount()
    assert "metrics at" not in plain.log()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        m = mounts("taken")
        args = ["mount", str(m.mnt), "--backing", str(m.backing), "--cache-size", "64MiB"]
        done = m.cli(*args, check=False, env={"CKPTFS_METRICS_LISTEN": f"127.0.0.1:{port}"})
    assert done.returncode != 0
    said = done.stderr + done.stdout
    assert f"metrics.listen 127.0.0.1:{port}" in said and "in use" in said, said
    assert not os.path.ismount(m.mnt)
    m.allowed_log = ["metrics.listen"]


def test_a_crowd_of_scrapers_is_answered_and_the_mount_with_them(mounts) -> None:  # type: ignore[no-untyped-def]
    m, address = metrics_mount(mounts)
    (m.mnt / "a.pt").write_bytes(os.urandom(100_000))
    results: list[float] = []
    errors: list[BaseException] = []

    def scraper() -> None:
        try:
            for _ in range(5):
                results.append(value(scrape(address), "ckptfs_cache_capacity_bytes"))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=scraper) for _ in range(20)]
    start = time.monotonic()
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        # The mount answers meanwhile: the snapshots queue, not its requests.
        t0 = time.monotonic()
        os.stat(m.mnt / "a.pt")
        assert time.monotonic() - t0 < 2
        time.sleep(0.05)
    for t in threads:
        t.join(30)
    assert not errors, errors[:3]
    assert len(results) == 100 and set(results) == {m.stat()["cache"]["capacity"]}
    assert time.monotonic() - start < 60
