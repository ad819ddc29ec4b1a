"""A backing store that is full: said by stat, and a forced unmount that
leaves what is not durable for the next mount."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator

import pytest
from mounts import Mount, free_port, is_mounted
from scrape import scrape, value
from waits import wait_for

MiB = 1 << 20


@pytest.fixture
def small_store(mounts) -> Iterator[Mount]:  # type: ignore[no-untyped-def]
    """A mount whose backing directory is a 4 MiB tmpfs."""
    m = mounts()
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4m,mode=0755", "tmpfs", str(m.backing)],
        check=True,
        timeout=30,
    )
    try:
        yield m
    finally:
        m.cleanup()
        subprocess.run(["umount", "-l", str(m.backing)], capture_output=True, timeout=30)


def test_a_full_store_is_said_and_a_forced_umount_keeps_its_bytes_for_the_next_mount(
    small_store: Mount,
) -> None:
    m = small_store
    metrics = f"127.0.0.1:{free_port()}"
    m.mount(env={"CKPTFS_METRICS_LISTEN": metrics})
    m.allowed_log = [
        "No space left on device",
        "health",
        "forced unmount",
        "with data not yet durable",
    ]
    data = os.urandom(16 * MiB)
    (m.mnt / "big.pt").write_bytes(data)  # closes at durability local: its chunks do not fit
    wait_for(lambda: m.stat()["backing_health"] == "full", 60, "the store said full")
    error = m.stat()["backing_error"]
    assert error["errno"] == "ENOSPC" and "big.pt" in error["error"], error
    assert "store full (ENOSPC: " in m.cli("stat", str(m.mnt)).stdout
    said = scrape(metrics)  # what an alert rule sees
    assert value(said, "ckptfs_store_health", state="full") == 1
    assert value(said, "ckptfs_store_health", state="normal") == 0
    assert value(said, "ckptfs_store_error", errno="ENOSPC") == 1
    assert value(said, "ckptfs_flush_failures_total") >= 1
    start = time.monotonic()
    out = m.cli("umount", str(m.mnt), "--force", timeout=60).stdout
    assert time.monotonic() - start < 15, out
    assert not is_mounted(m.mnt)
    assert "without flushing: 1 file(s) not durable" in out and "big.pt" in out, out
    # Room again: the next mount finds the file in the cache and flushes it.
    subprocess.run(["mount", "-o", "remount,size=64m", str(m.backing)], check=True, timeout=30)
    m.mount()
    m.wait_durable()
    assert (m.mnt / "big.pt").read_bytes() == data
    assert m.stat()["backing_health"] == "normal"
    m.umount()


def test_a_forced_umount_of_a_healthy_mount_detaches_at_once(mounts) -> None:  # type: ignore[no-untyped-def]
    """--force does not wait for the flush: what is not durable stays."""
    m = mounts()
    m.mount(env={"CKPTFS_FLUSH_BANDWIDTH": "1MiB"})
    m.allowed_log = ["forced unmount", "with data not yet durable"]
    data = os.urandom(24 * MiB)
    (m.mnt / "slow.pt").write_bytes(data)
    start = time.monotonic()
    out = m.cli("umount", str(m.mnt), "--force", timeout=60).stdout
    assert time.monotonic() - start < 10, out
    assert "slow.pt" in out
    m.mount()
    m.wait_durable(timeout=120)
    assert (m.mnt / "slow.pt").read_bytes() == data
    m.umount()
