"""Ctrl-C of a training job whose save waits on ckptfs (FUSE_INTERRUPT).

When the backing store hangs (an NFS server that stopped answering), a save
waits: its writes for cache space once the cache is full of bytes the store
has not taken, its close for the store to take the manifest. A signal to the
job ends those waits at once (EINTR, or a short write), so Ctrl-C works as on
a local disk instead of when the store comes back. Nothing the job wrote
before is lost: once the store answers again the file is published and
flushed, and a cold remount reads back exactly the bytes the job wrote. The
same for a close waiting at ``durability: backing``, and for loads of a
checkpoint no longer in RAM that wait for the store's chunks.

The backing store here is the tests' NFS stand-in (countingfs), stopped with
SIGSTOP to hang it.
"""

from __future__ import annotations

import errno
import hashlib
import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import trio
from children import TIMEOUT, go, interrupt, next_line, stop
from ckptfs.fs import interrupts
from countingfs import CountingMount, counting_mount
from mounts import Mount, fuse_requests
from waits import wait_for

MiB = 1 << 20

WRITER = textwrap.dedent(
    """
    import os, signal, sys
    # A signal caught for another reason (as DataLoader catches SIGCHLD).
    signal.signal(signal.SIGUSR1, lambda *_: None)
    path, expected, size = sys.argv[1], sys.argv[2], int(sys.argv[3])
    data = os.urandom(size)
    with open(expected, "wb") as f:
        f.write(data)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    print("writing", flush=True)
    try:
        pos = 0
        while pos < size:
            pos += os.write(fd, data[pos : pos + (1 << 20)])
        print("written", flush=True)
    except KeyboardInterrupt:
        print("write interrupted", flush=True)
    try:
        os.close(fd)
        print("closed", flush=True)
    except BaseException as exc:
        print("close ended by", type(exc).__name__, flush=True)
    """
)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[CountingMount]:
    """The NFS stand-in as the backing store; never left stopped."""
    with counting_mount(tmp_path / "backing-real", tmp_path / "backing") as cm:
        try:
            yield cm
        finally:
            cm.proc.send_signal(signal.SIGCONT)


def spawn_writer(path: Path, expected: Path, size: int) -> subprocess.Popen[str]:
    writer = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(path), str(expected), str(size)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert next_line(writer) == "writing"
    return writer


def reads_back(m: Mount, rel: str, expected: bytes) -> None:
    """The whole file, now, after a flush and again from a cold cache."""
    assert (m.mnt / rel).read_bytes() == expected
    m.wait_durable()
    m.umount()
    shutil.rmtree(m.cache_dir)
    m.cache_dir = m.cache_dir.with_name(m.cache_dir.name + "-cold")
    m.env["CKPTFS_CACHE_DIR"] = str(m.cache_dir)
    m.mount()
    assert (m.mnt / rel).read_bytes() == expected
    assert m.file_state(rel) == "durable"
    m.umount()


@contextmanager
def save_while_the_store_hangs(
    store: CountingMount, m: Mount, expected: Path
) -> Iterator[subprocess.Popen[str]]:
    """A save of four times the cache, the store stopped (SIGSTOP) once the
    file is open: yields the writer once it waits for cache space. The store
    answers again afterwards."""
    m.mount(cache_size="64MiB")
    m.allowed_log = ["backing store", "has waited", "spilling", "failed again"]
    writer = spawn_writer(m.mnt / "ckpt.pt", expected, 256 * MiB)
    store.proc.send_signal(signal.SIGSTOP)
    try:
        wait_for(lambda: m.stat()["cache"]["waiting_writers"] >= 1, TIMEOUT, "backpressure")
        yield writer
    finally:
        store.proc.send_signal(signal.SIGCONT)
        stop(writer)


def test_ctrl_c_ends_a_save_waiting_for_a_hung_store(store, mounts, tmp_path):
    m = mounts()
    expected = tmp_path / "expected"
    with save_while_the_store_hangs(store, m, expected) as writer:
        # A signal that does not ask the job to stop leaves the write waiting.
        writer.send_signal(signal.SIGUSR1)
        wait_for(lambda: fuse_requests(m)["signals_ignored"] >= 1, TIMEOUT, "the ignored signal")
        time.sleep(0.5)
        assert writer.poll() is None
        assert m.stat()["cache"]["waiting_writers"] >= 1
        took = interrupt(writer, "write interrupted")
        assert took < 5, took
        # Its close publishes the manifest in the store, which hangs: a
        # second Ctrl-C ends that wait too.
        time.sleep(1)
        assert writer.poll() is None
        took = interrupt(writer, "close ended by KeyboardInterrupt")
        assert took < 5, took
        writer.wait(10)
        assert m.stat()["cache"]["waiting_writers"] == 0
        assert fuse_requests(m)["interrupts"] >= 2
    data = expected.read_bytes()
    written = (m.mnt / "ckpt.pt").stat().st_size
    assert 0 < written < len(data)
    reads_back(m, "ckpt.pt", data[:written])


def test_kill_9_of_a_save_waiting_for_a_hung_store_returns_at_once(store, mounts, tmp_path):
    """Without an answer to its INTERRUPT, a process killed while its request
    waits in the daemon stays in the kernel (state D) until the wait ends."""
    m = mounts()
    expected = tmp_path / "expected"
    with save_while_the_store_hangs(store, m, expected) as writer:
        start = time.monotonic()
        writer.kill()
        writer.wait(TIMEOUT)
        assert time.monotonic() - start < 5
        wait_for(lambda: m.stat()["cache"]["waiting_writers"] == 0, 10, "no waiting writer")
    # Its file is closed by the kernel: committed with what was written.
    data = expected.read_bytes()
    wait_for(lambda: m.file_state("ckpt.pt") in ("pending", "flushing", "durable"), TIMEOUT,
             "the commit of the killed writer's file")  # fmt: skip
    written = (m.mnt / "ckpt.pt").stat().st_size
    assert 0 < written < len(data)
    reads_back(m, "ckpt.pt", data[:written])


def test_ctrl_c_ends_a_close_waiting_for_durability(mounts, tmp_path):
    m = mounts()
    # A store at 1 KiB/s: its first chunk goes at once, the next in hours.
    m.mount("--durability", "backing", env={"CKPTFS_FLUSH_BANDWIDTH": "1KiB"})
    m.allowed_log = ["with data not yet durable"]
    expected = tmp_path / "expected"
    writer = spawn_writer(m.mnt / "ckpt.pt", expected, 9 * MiB)
    try:
        assert next_line(writer) == "written"
        time.sleep(0.5)
        assert writer.poll() is None  # in close(), waiting for the store
        took = interrupt(writer, "close ended by KeyboardInterrupt")
        assert took < 5, took
        writer.wait(10)
    finally:
        stop(writer)
    assert m.file_state("ckpt.pt") == "flushing"  # published, on its way
    data = expected.read_bytes()
    # The store never catches up: the daemon dies, and the next mount (a store
    # that keeps up) recovers the file from the cache and flushes it.
    m.kill()
    m.mount()
    reads_back(m, "ckpt.pt", data)


READER = textwrap.dedent(
    """
    import hashlib, os, sys
    flags = os.O_RDONLY | (os.O_DIRECT if sys.argv[2] == "direct" else 0)
    fd = os.open(sys.argv[1], flags)
    print("opened", flush=True)
    sys.stdin.readline()
    outcome, digest = "read interrupted", hashlib.sha256()
    try:
        while block := os.read(fd, 1 << 20):
            digest.update(block)
        outcome = "read " + digest.hexdigest()
    except KeyboardInterrupt:
        pass
    print(outcome, flush=True)
    """
)


def spawn_reader(path: Path, how: str) -> subprocess.Popen[str]:
    """A reader (``how``: "direct", O_DIRECT, or "buffered") that has opened
    ``path`` and reads it whole once told to go."""
    reader = subprocess.Popen(
        [sys.executable, "-c", READER, str(path), how],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert next_line(reader) == "opened"
    return reader


@contextmanager
def evicted_while_the_store_hangs(
    store: CountingMount, m: Mount, data: bytes, readers: list[str]
) -> Iterator[list[subprocess.Popen[str]]]:
    """``data`` saved, durable and evicted from RAM; readers (one per item of
    ``readers``: how it opens) that opened it; the store stopped. The store
    answers again afterwards."""
    m.mount(cache_size="64MiB")
    m.allowed_log = ["backing store"]
    (m.mnt / "ckpt.pt").write_bytes(data)
    m.wait_durable()
    m.cli("evict", str(m.mnt / "ckpt.pt"))
    procs: list[subprocess.Popen[str]] = []
    try:
        procs += [spawn_reader(m.mnt / "ckpt.pt", how) for how in readers]
        store.proc.send_signal(signal.SIGSTOP)
        yield procs
    finally:
        store.proc.send_signal(signal.SIGCONT)
        for r in procs:
            stop(r)


def test_ctrl_c_ends_a_read_waiting_for_a_hung_store(store, mounts):
    """A load of a checkpoint no longer in RAM reads its chunks from the
    store. When the store hangs, Ctrl-C (or kill -9) of a reader whose READ
    waits in the daemon takes effect at once, whether it reads the chunk
    itself or waits for another reader's read of it; a reader that waited
    for an interrupted reader's chunk reads it itself, and gets every byte
    once the store answers. O_DIRECT readers: their READs are their own
    (without ASYNC_DIO), where a buffered read's are the kernel's read-ahead,
    which no signal but SIGKILL ends (the next test)."""
    m = mounts()
    data = random.randbytes(24 * MiB)
    with evicted_while_the_store_hangs(store, m, data, ["direct"] * 4) as readers:
        first, waiter, killed, patient = readers
        go(first)
        time.sleep(1)  # in the store, reading the chunk
        for r in (waiter, killed, patient):
            go(r)
        time.sleep(1)  # waiting for the first reader's chunk
        assert all(r.poll() is None for r in readers)
        took = interrupt(waiter, "read interrupted")
        assert took < 5, took
        start = time.monotonic()
        killed.kill()
        killed.wait(TIMEOUT)
        assert time.monotonic() - start < 5
        took = interrupt(first, "read interrupted")
        assert took < 5, took
        time.sleep(1)
        assert patient.poll() is None  # it waits for the store, not fails
        assert fuse_requests(m)["interrupts"] >= 3
        # The first reader's read goes on for the patient one, and shows.
        assert m.stat()["cache"]["chunk_reads_left_running"] >= 1
        assert "still running for other readers" in m.cli("stat", str(m.mnt), "-v").stdout
        store.proc.send_signal(signal.SIGCONT)
        assert next_line(patient) == "read " + hashlib.sha256(data).hexdigest()
    assert m.stat()["cache"]["chunk_reads_failed"] == 0  # an interrupt is no failure
    reads_back(m, "ckpt.pt", data)


def test_kill_9_of_a_load_waiting_for_a_hung_store_returns_at_once(store, mounts):
    """A buffered read waits for the kernel's read-ahead (background READs,
    never interrupted): Ctrl-C waits for the store, SIGKILL does not."""
    m = mounts()
    data = random.randbytes(24 * MiB)
    with evicted_while_the_store_hangs(store, m, data, ["buffered"]) as (reader,):
        go(reader)
        time.sleep(1)
        assert reader.poll() is None
        start = time.monotonic()
        reader.kill()
        reader.wait(TIMEOUT)
        assert time.monotonic() - start < 5
    reads_back(m, "ckpt.pt", data)


def test_loads_interrupted_or_killed_at_random_while_the_store_hangs(store, mounts):
    """Rounds of 2-5 readers (O_DIRECT or buffered) of an evicted
    checkpoint, started while the store hangs; some are interrupted
    (O_DIRECT) or killed at random moments, then the store answers: every
    reader left reads the whole file, every one ended returns within
    seconds, and the cache holds nothing after an evict (no slot left
    behind by a read given up on)."""
    seed = int.from_bytes(os.urandom(4), "little")
    rng = random.Random(seed)
    m = mounts()
    m.mount(cache_size="64MiB")
    m.allowed_log = ["backing store"]
    digests = {}
    for i in range(2):
        data = rng.randbytes(rng.randrange(8 * MiB, 20 * MiB))
        (m.mnt / f"c{i}.pt").write_bytes(data)
        digests[f"c{i}.pt"] = hashlib.sha256(data).hexdigest()
    m.wait_durable()
    for rnd in range(5):
        where = f"seed {seed}, round {rnd}"
        m.cli("evict", str(m.mnt))
        name = rng.choice(sorted(digests))
        hows = [rng.choice(["direct", "direct", "buffered"]) for _ in range(rng.randrange(2, 6))]
        readers = [spawn_reader(m.mnt / name, how) for how in hows]
        try:
            store.proc.send_signal(signal.SIGSTOP)
            for r in readers:
                go(r)
                time.sleep(rng.random() * 0.2)
            time.sleep(rng.random() * 0.5)
            ended = rng.sample(range(len(readers)), rng.randrange(0, len(readers)))
            for i in ended:
                if hows[i] == "direct" and rng.random() < 0.6:
                    readers[i].send_signal(signal.SIGINT)
                else:
                    readers[i].kill()
            start = time.monotonic()
            for i in ended:
                readers[i].wait(TIMEOUT)
            assert time.monotonic() - start < 5, where
            store.proc.send_signal(signal.SIGCONT)
            for i, r in enumerate(readers):
                if i not in ended:
                    assert next_line(r) == "read " + digests[name], (where, hows[i])
        finally:
            store.proc.send_signal(signal.SIGCONT)
            for r in readers:
                stop(r)
        assert hashlib.sha256((m.mnt / name).read_bytes()).hexdigest() == digests[name], where
        m.cli("evict", str(m.mnt))
        wait_for(lambda: m.stat()["cache"]["used"] == 0, 10, f"an empty cache ({where})")
    assert m.stat()["cache"]["chunk_reads_failed"] == 0


SAVER = textwrap.dedent(
    """
    import hashlib, os, random, signal, sys
    tmp, final, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
    rng = random.Random(seed)
    data = rng.randbytes(rng.randrange(4 << 20, 24 << 20))
    print("start", flush=True)
    outcome = "interrupted"
    try:
        try:
            with open(tmp, "wb") as f:
                for pos in range(0, len(data), 1 << 20):
                    f.write(data[pos : pos + (1 << 20)])
            os.replace(tmp, final)
            outcome = "replaced"
        finally:
            # A signal from here on finds the save over: the line that
            # says how it ended is printed whole.
            signal.signal(signal.SIGINT, signal.SIG_IGN)
    except KeyboardInterrupt:
        pass
    print(outcome, flush=True)
    """
)

LOADER = textwrap.dedent(
    """
    import hashlib, signal, sys
    print("start", flush=True)
    outcome = "interrupted"
    try:
        try:
            with open(sys.argv[1], "rb") as f:
                outcome = "read " + hashlib.sha256(f.read()).hexdigest()
        finally:
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # as in SAVER
    except KeyboardInterrupt:
        pass
    print(outcome, flush=True)
    """
)


def saved(seed: int) -> bytes:
    """What SAVER writes for ``seed``."""
    rng = random.Random(seed)
    return rng.randbytes(rng.randrange(4 << 20, 24 << 20))


def run_interrupted(script: str, args: list[str], delay: float) -> str:
    """Run ``script``, SIGINT it ``delay`` seconds after it started; its last line."""
    cmd = [sys.executable, "-c", script, *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    try:
        assert next_line(proc) == "start"
        time.sleep(delay)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(TIMEOUT) is not None
        assert proc.stdout is not None
        out = proc.stdout.read().strip()
    finally:
        stop(proc)
    # A signal after the script's own end leaves it no line to print.
    return out.splitlines()[-1] if out else "done"


def test_ctrl_c_at_random_points_of_saves_and_loads_loses_nothing(mounts):
    """Savers (a temporary name, then os.replace) and loaders, each sent
    SIGINT at a random point: whatever the signal interrupted, a replaced
    checkpoint reads back whole (now, after a flush, and from a cold cache), a
    load reads one whole version or is interrupted, a temporary file holds a
    prefix of what its saver wrote, and the store checks clean."""
    m = mounts()
    m.mount()
    rng = random.Random(13)
    current: dict[str, bytes] = {}  # what each name holds
    partial: dict[str, bytes] = {}
    outcomes: list[str] = []
    for seed in range(40):
        name = f"ckpt{seed % 4}.pt"
        tmp = f"{name}.tmp{seed}"
        delay = rng.uniform(0, 0.05)  # a save takes 10-60 ms
        last = run_interrupted(SAVER, [str(m.mnt / tmp), str(m.mnt / name), str(seed)], delay)
        outcomes.append(last)
        new, old = saved(seed), current.get(name)
        got = (m.mnt / name).read_bytes() if (m.mnt / name).exists() else None
        if last in ("replaced", "done"):
            assert got == new, name
        else:
            # The signal came before the rename or just after it returned.
            assert last == "interrupted", last
            assert got in (old, new), name
            partial[tmp] = new
        if got is not None:
            current[name] = got
        if current:
            target = rng.choice(sorted(current))
            line = run_interrupted(LOADER, [str(m.mnt / target)], rng.uniform(0, 0.01))
            if line.startswith("read"):
                assert line.split()[1] == hashlib.sha256(current[target]).hexdigest()
            else:
                assert line in ("interrupted", "done"), line
    assert "replaced" in outcomes and "interrupted" in outcomes, outcomes

    def check_all() -> None:
        for name, data in current.items():
            assert (m.mnt / name).read_bytes() == data, name
        for tmp, data in partial.items():
            if (m.mnt / tmp).exists():  # never renamed: a prefix of it
                assert data.startswith((m.mnt / tmp).read_bytes()), tmp

    check_all()
    m.wait_durable()
    check_all()
    m.umount()
    shutil.rmtree(m.cache_dir)
    m.mount()
    check_all()
    assert "all well" in m.cli("check", str(m.mnt)).stdout
    m.umount()
    assert not m.unexpected_log_lines()


@pytest.mark.parametrize(
    "sigpnd, shdpnd, stop",
    [
        ("0000000000000000", "0000000000000000", False),
        ("0000000000000000", "0000000000010000", False),  # SIGCHLD (17)
        ("0000000000000200", "0000000000010000", False),  # SIGUSR1 (10) of the thread
        ("0000000000000000", "0000000000000002", True),  # SIGINT (2) to the process
        ("0000000000000100", "0000000000000000", True),  # SIGKILL (9): a fatal signal
        ("0000000000000000", "0000000000004000", True),  # SIGTERM (15)
    ],
)
def test_stop_signals_are_read_from_the_callers_status(tmp_path, sigpnd, shdpnd, stop):
    (tmp_path / "42").mkdir()
    (tmp_path / "42" / "status").write_text(
        f"Name:\tpython\nState:\tS (sleeping)\nSigQ:\t0/94000\n"
        f"SigPnd:\t{sigpnd}\nShdPnd:\t{shdpnd}\nSigBlk:\t0000000000000000\n"
    )
    assert interrupts.stop_requested(42, proc=str(tmp_path)) is stop
    assert interrupts.stop_requested(43, proc=str(tmp_path))  # gone: nobody waits
    assert not interrupts.stop_requested(0, proc=str(tmp_path))  # not visible from here


def test_only_the_handlers_own_waits_end_and_only_while_they_wait():
    async def main() -> None:
        with interrupts.interruptible("outside any request"):
            await trio.sleep(0)  # no request: nothing to interrupt
        with interrupts.handling(7, 1234) as inflight:
            with interrupts.interruptible("a wait done before the signal"):
                await trio.sleep(0)
            inflight.interrupt()  # not waiting now: marked
            with pytest.raises(interrupts.Interrupted) as err:
                with interrupts.interruptible("a wait after the signal"):
                    raise AssertionError("an interrupted request waits no more")
            assert err.value.errno == errno.EINTR
            assert "a wait after the signal: interrupted" in str(err.value)
            done: list[str] = []

            async def started_by_the_handler() -> None:
                with interrupts.interruptible("another task's wait"):
                    await trio.sleep(0.05)
                done.append("not interrupted")

            async with trio.open_nursery() as nursery:
                nursery.start_soon(started_by_the_handler)
            assert done == ["not interrupted"]

    trio.run(main)
