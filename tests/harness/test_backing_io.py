"""Backing-store calls: no descriptor leaks when the store hangs or is down,
and manifests that are never torn."""

from __future__ import annotations

import dataclasses
import errno
import os
import stat
import threading
import time
from pathlib import Path

import pytest
import trio
from ckptfs.fs.store.backing import Backing
from ckptfs.fs.store.blocking import BackingIO, Call
from ckptfs.fs.store.entries import Entry
from ckptfs.fs.store.manifest import Chunk, Manifest, read_manifest, write_manifest


def open_fds() -> set[int]:
    return {int(n) for n in os.listdir("/proc/self/fd")}


def test_an_open_abandoned_at_its_timeout_closes_its_fd_when_it_completes(
    tmp_path: Path, monkeypatch
):
    (tmp_path / "slow").write_bytes(b"x")
    release = threading.Event()
    real_open = os.open

    def hung_open(path, *args, **kwargs):  # like a hung NFS server, until released
        if path == "slow":
            release.wait(10)
        return real_open(path, *args, **kwargs)

    async def main() -> None:
        backing = Backing(tmp_path, BackingIO(timeout=0.5))
        before = open_fds()
        monkeypatch.setattr(os, "open", hung_open)
        with pytest.raises(OSError):
            await backing.open_plain("slow")
        # The thread's open completes once the store answers: its fd must not leak.
        release.set()
        deadline = time.monotonic() + 5
        while open_fds() - before and time.monotonic() < deadline:
            await trio.sleep(0.02)
        assert open_fds() - before == set()

    trio.run(main)


def test_a_fifo_or_device_in_the_store_is_never_opened(tmp_path: Path):
    """A user can put a FIFO into the backing directory (from a login node):
    opening it would block a store thread until the timeout; a device would
    open the node's own device. Neither is a file ckptfs serves."""
    os.mkfifo(tmp_path / "fifo")

    async def main() -> None:
        backing = Backing(tmp_path, BackingIO(timeout=5))
        start = time.monotonic()
        with pytest.raises(OSError) as exc:
            await backing.open_plain("fifo")
        assert exc.value.errno == errno.ESTALE
        assert time.monotonic() - start < 1
        entry = await backing.entry("fifo")
        assert entry.kind == "plain" and stat.S_ISFIFO(entry.st.st_mode)

    trio.run(main)


def test_descriptors_are_closed_while_the_store_is_marked_down(tmp_path: Path):
    (tmp_path / "f").write_bytes(b"x")

    async def main() -> None:
        io = BackingIO(timeout=5)
        backing = Backing(tmp_path, io)
        fd = await backing.open_plain("f")
        io.health = "down"  # as after a timeout: new calls fail fast for a while
        io._last_ok = time.monotonic()
        await backing.close_fd(fd)
        with pytest.raises(OSError):
            os.fstat(fd)  # closed (nothing else in this test opens files meanwhile)

    trio.run(main)


def big_manifest() -> Manifest:
    chunks = [Chunk(i * 4096, 4096, f"{i:032x}") for i in range(5000)]
    return Manifest("a" * 16, "b" * 16, 5000 * 4096, 0o640, 123, "durable", ["n1"], chunks)


def test_a_manifest_write_survives_short_writes_and_syncs_its_directory(tmp_path, monkeypatch):
    real_write, real_fsync = os.write, os.fsync
    synced_dirs = []

    def short_write(fd: int, data: bytes) -> int:
        return real_write(fd, bytes(data)[:1000])  # the kernel may write less than asked

    def fsync(fd: int) -> None:
        real_fsync(fd)
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            synced_dirs.append(fd)

    monkeypatch.setattr(os, "write", short_write)
    monkeypatch.setattr(os, "fsync", fsync)
    manifest = big_manifest()
    write_manifest(tmp_path / "x.pt", manifest)
    monkeypatch.undo()
    assert read_manifest(tmp_path / "x.pt") == manifest
    assert synced_dirs, "the directory was not fsynced after the rename"
    assert stat.S_IMODE(os.stat(tmp_path / "x.pt").st_mode) == 0o640


def test_background_work_runs_at_a_lower_priority_and_restores_it(monkeypatch):
    from ckptfs.fs.store import blocking

    def nice() -> int:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    async def main() -> tuple[int, int]:
        def work() -> tuple[int, int]:
            return nice(), threading.get_native_id()

        during, tid = await trio.to_thread.run_sync(blocking.in_background(work))
        # The worker thread is still alive (trio keeps idle threads a while).
        return during, os.getpriority(os.PRIO_PROCESS, tid)

    if not blocking._renice:
        pytest.skip("this process may not raise a thread's priority back (no CAP_SYS_NICE)")
    base = nice()
    during, after = trio.run(main)
    assert during == min(19, base + blocking.BACKGROUND_NICE)
    assert after == base  # the thread serves other work at the daemon's priority again
    # Where the priority cannot be restored, nothing is lowered, and the work still runs.
    monkeypatch.setattr(blocking, "_renice", False)
    assert blocking.in_background(nice)() == base


def test_a_kept_entry_drops_only_the_chunk_list_and_holders() -> None:
    """What a check keeps (Entry.kept) has every other field of the manifest,
    whatever fields the manifest gains."""
    m = Manifest(
        file_id="f1",
        version="v2",
        size=3,
        mode=0o100640,
        mtime_ns=5,
        state="durable",
        holders=["node-a"],
        chunks=[Chunk(0, 3, "h")],
        chunking="cdc",
        atime_ns=7,
    )
    entry = Entry("file", os.stat("/"), m, read_at=11.0)
    kept = entry.kept()
    assert (kept.kind, kept.st, kept.read_at) == ("file", entry.st, 11.0)
    assert kept.manifest is not None
    assert dataclasses.replace(kept.manifest, chunks=m.chunks, holders=m.holders) == m
    assert (kept.manifest.chunks, kept.manifest.holders) == ([], [])
    assert m.chunks and m.holders  # the entry read is not changed


def _recorded() -> tuple[Call[str], list[object], threading.Event]:
    """A Call whose ``late`` records what it released; the record; set on release."""
    released: list[object] = []
    done = threading.Event()

    def late(result: object) -> None:
        released.append(result)
        done.set()

    return Call(late), released, done


@pytest.mark.parametrize(
    "order, made, released",
    [
        # Given up on before its thread began: released at once, never made.
        (["abandon", "begin"], False, [None]),
        # Given up on while it ran: released when it ends, with its result.
        (["begin", "abandon", "finish"], True, ["fd"]),
        # Given up on after it ended, before the loop saw it: released then.
        (["begin", "finish", "abandon"], True, ["fd"]),
        # Never given up on: the loop has the result, nothing is released.
        (["begin", "finish"], True, []),
    ],
)
def test_a_call_is_released_exactly_once_whenever_the_loop_gives_up_on_it(
    order: list[str], made: bool, released: list[object]
) -> None:
    call, got, done = _recorded()
    began = None
    for step in order:
        if step == "begin":
            began = call.begin()
        elif step == "finish":
            call.finish("fd")
        else:
            call.abandon()
    assert began is made and call.began() is made
    if released:
        assert done.wait(5)
    time.sleep(0.05)  # a second release would show by now
    assert got == released
