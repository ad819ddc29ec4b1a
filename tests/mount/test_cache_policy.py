"""Eviction, `ckptfs evict` safety, flush bandwidth cap and `stat` contents."""

from __future__ import annotations

import os
import time

from ckptfs.fs.store.manifest import read_manifest
from waits import wait_for


def files_by_path(stat: dict) -> dict[str, dict]:
    return {f["path"]: f for f in stat["files"]}


def test_durable_files_are_evicted_lru_when_space_is_needed(mounts):
    m = mounts()
    m.mount(cache_size="64MiB")
    a, b, c = (os.urandom(24 << 20) for _ in range(3))
    (m.mnt / "a").write_bytes(a)
    (m.mnt / "b").write_bytes(b)
    m.wait_durable()
    assert (m.mnt / "b").read_bytes() == b  # b is now more recently used than a
    (m.mnt / "c").write_bytes(c)
    s = m.stat()
    files = files_by_path(s)
    assert s["cache"]["evicted_bytes"] > 0
    assert files["a"]["ram_bytes"] == 0  # least recently used went first
    assert files["c"]["ram_bytes"] >= len(c)
    assert s["cache"]["used"] <= s["cache"]["capacity"]
    assert (m.mnt / "a").read_bytes() == a
    assert (m.mnt / "b").read_bytes() == b
    assert (m.mnt / "c").read_bytes() == c


def test_evict_never_drops_bytes_that_are_not_durable(mounts):
    m = mounts()
    m.mount(env={"CKPTFS_FLUSH_BANDWIDTH": "2MiB"})
    blob = os.urandom(16 << 20)
    (m.mnt / "slow").write_bytes(blob)
    out = m.cli("evict", str(m.mnt)).stdout
    assert "not durable" in out
    f = files_by_path(m.stat())["slow"]
    assert f["state"] in ("dirty", "flushing") and f["ram_bytes"] >= len(blob)
    m.wait_durable(timeout=120)
    out = m.cli("evict", str(m.mnt / "slow")).stdout
    assert "evicted 16 MiB" in out
    assert files_by_path(m.stat())["slow"]["ram_bytes"] == 0
    assert (m.mnt / "slow").read_bytes() == blob


def test_flush_bandwidth_cap_is_honoured(mounts):
    m = mounts()
    m.mount(env={"CKPTFS_FLUSH_BANDWIDTH": "8MiB"})
    size = 24 << 20
    start = time.monotonic()
    (m.mnt / "capped").write_bytes(os.urandom(size))
    m.wait_durable(timeout=120)
    elapsed = time.monotonic() - start
    # The pacing limiter lets the first chunk through at once, so the lower
    # bound is (size - one chunk) / cap; anything faster means the cap is ignored.
    assert elapsed >= (size - (4 << 20)) / (8 << 20) * 0.9, elapsed
    s = m.stat()
    assert s["flush"]["bandwidth_cap"] == 8 << 20
    assert s["flush"]["bytes_stored"] >= size


def test_stat_reports_states_dedup_and_history(mounts):
    m = mounts()
    m.mount()
    blob = os.urandom(9 << 20)
    (m.mnt / "d1").mkdir()
    (m.mnt / "d1" / "x.bin").write_bytes(blob)
    (m.mnt / "d1" / "y.bin").write_bytes(blob)  # same bytes: stored once
    m.wait_durable()
    s = m.stat()
    assert s["mountpoint"] == str(m.mnt) and s["backing"] == str(m.backing)
    assert s["node"] and s["peers"] == []
    files = files_by_path(s)
    assert files["d1/x.bin"]["state"] == "durable" and files["d1/x.bin"]["size"] == len(blob)
    assert files["d1/x.bin"]["holders"] == [s["node"]]
    assert s["flush"]["bytes_deduped"] >= len(blob)
    assert s["flush"]["bytes_stored"] < 2 * len(blob)
    assert {h["path"] for h in s["history"]} >= {"d1/x.bin", "d1/y.bin"}
    # stat of a path inside the mount lists only what is under it
    sub = m.stat(m.mnt / "d1" / "y.bin")
    assert [f["path"] for f in sub["files"]] == ["d1/y.bin"]
    history = (m.backing / ".ckptfs" / "history" / f"{s['node']}.csv").read_text()
    assert "d1/x.bin" in history and history.startswith("time,path,size")
    human = m.cli("stat", str(m.mnt)).stdout
    assert "durable" in human and "d1/x.bin" in human
    assert "saved by dedup" in m.cli("stat", str(m.mnt), "--verbose").stdout
    assert all(h["mirrored_s"] == "" for h in s["history"])  # no buddy here
    # A rewrite, long after the first open: its times count from its own open.
    time.sleep(1.5)
    (m.mnt / "d1" / "x.bin").write_bytes(os.urandom(1 << 20))
    m.wait_durable()
    again = [h for h in m.stat()["history"] if h["path"] == "d1/x.bin"]
    assert len(again) == 2 and 0 <= again[1]["close_s"] < 1.0, again


def test_fsync_of_open_file_publishes_without_closing(mounted):
    fd = os.open(mounted.mnt / "live", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        os.write(fd, b"a" * 1000)
        os.fsync(fd)
        assert read_manifest(mounted.backing / "live").size == 1000
        os.write(fd, b"b" * 1000)
    finally:
        os.close(fd)
    assert (mounted.mnt / "live").read_bytes() == b"a" * 1000 + b"b" * 1000


def test_flush_wait_does_not_flush_a_file_twice(mounts):
    m = mounts()
    m.mount(env={"CKPTFS_FLUSH_BANDWIDTH": "16MiB"})
    (m.mnt / "once.bin").write_bytes(os.urandom(16 << 20))
    assert m.file_state("once.bin") in ("dirty", "flushing")
    m.wait_durable()  # asks again for a file already being flushed
    m.umount()  # and once more
    lines = (m.backing / ".ckptfs" / "history").glob("*.csv")
    records = [ln for p in lines for ln in p.read_text().splitlines() if ",once.bin," in ln]
    assert len(records) == 1, records


def test_an_operators_flush_and_the_umount_do_not_wait_out_flush_settle(mounts):
    """`flush.settle` delays a closed file's flush (a rename usually follows
    the close); `ckptfs flush`, `flush --wait` and the umount want the files
    durable now, so they cut it short for every file queued until then."""
    m = mounts()
    m.mount(env={"CKPTFS_FLUSH_SETTLE": "600"})
    (m.mnt / "a.bin").write_bytes(os.urandom(1 << 20))
    time.sleep(0.5)
    assert m.file_state("a.bin") == "dirty"  # settling
    start = time.monotonic()
    m.cli("flush", str(m.mnt), "--wait", "--timeout", "60", timeout=90)
    assert m.file_state("a.bin") == "durable"
    (m.mnt / "b.bin").write_bytes(os.urandom(1 << 20))
    m.cli("flush", str(m.mnt))  # without --wait: starts it
    wait_for(
        lambda: m.file_state("b.bin") == "durable",
        60,
        lambda: f"b.bin durable, not {m.file_state('b.bin')}",
    )
    (m.mnt / "c.bin").write_bytes(os.urandom(1 << 20))
    m.umount()
    assert time.monotonic() - start < 120  # not 600 s per file
    assert read_manifest(m.backing / "c.bin").state == "durable"


def wait_prefault(m, timeout: float = 30) -> dict:  # noqa: ANN001
    return wait_for(
        lambda: (cache := m.stat()["cache"])["prefault"] != "running" and cache,
        timeout,
        lambda: f"the prefault pass to end: {m.stat()['cache']}",
    )


def test_stat_names_where_the_prefault_pass_is(mounts):
    m = mounts()
    m.mount(cache_size="64MiB")
    cache = wait_prefault(m)
    assert cache["prefault"] == "done" and cache["prefaulted"] == cache["capacity"], cache
    assert "(done)" in m.cli("stat", str(m.mnt), "--verbose").stdout
    m.kill()
    # A killed daemon's arena is kept, already backed, for the next daemon to
    # adopt: the pass finds nothing to touch, and still says it is done
    # (benchmarks wait for that, so it must not hang on the bytes count).
    m.mount(cache_size="64MiB")
    cache = wait_prefault(m)
    assert cache["prefault"] == "done" and cache["prefaulted"] == 0, cache
    m.umount()
    m.mount(cache_size="64MiB", env={"CKPTFS_CACHE_PREFAULT": "false"})
    assert m.stat()["cache"]["prefault"] == "off"
