"""ckptfs's own FUSE session (fs/fusesession.py) on a real mount of a tiny
filesystem: the kernel protocol, the fast paths run by the request thread only
while the trio loop is parked, hand-offs to the loop, errors, buffers, and the
ways a session ends."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import termios
import textwrap
import threading
import time
import zlib
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import trio
from ckptfs.fs import fuseabi as abi
from ckptfs.fs import fusemount, fusesession
from ckptfs.fs.fuseabi import Op
from ckptfs.fs.fusesession import (
    LOOP_IDLE,
    CheckedPath,
    FuseError,
    Handlers,
    ReadMode,
    Request,
    Session,
)
from ckptfs.fs.interrupts import interruptible

TIMEOUT = 20
DIRS = 1 << 40  # Tiny's inode numbers of directories start here


def _is_mounted(path: Path) -> bool:
    with open("/proc/self/mounts") as mounts:
        return any(line.split()[1] == str(path) for line in mounts)


@dataclass
class TinyAttr:
    ino: int
    mode: int
    size: int
    nlink: int = 1
    uid: int = 0
    gid: int = 0
    blksize: int = 4096
    atime_ns: int = 1_700_000_000 * 10**9
    mtime_ns: int = 1_700_000_000 * 10**9
    ctime_ns: int = 1_700_000_000 * 10**9


class Tiny:
    """One directory with one file, ``f``; hooks for the tests."""

    def __init__(self, data: bytes) -> None:
        # f (inode 2), and f1, f2, ... (inodes 3, 4, ...), empty until written
        self.files: dict[int, bytearray] = {2: bytearray(data)}
        self.decline = False  # the fast open declines: a worker answers
        self.timeout = 1.0  # the kernel's attribute and entry cache
        self.log: list[str] = []  # releases of writers and getattrs, as handled
        self.fast_opens = 0
        self.slow_opens = 0
        self.hold: trio.Event | None = None  # writes wait for it
        self.hold_interruptible = False  # ... in an interruptible wait
        self.writes_in_flight = 0
        self.off_loop = False  # offer the fast paths to the request thread too
        self.fast_threads: list[str] = []  # the thread each fast open ran in
        self.fast_calls: list[tuple[float, str]] = []  # (when, thread) of fast opens and releases
        # The request thread checks opens of f with a "store read" of its own
        # (CheckedPath), which waits while ``store`` is clear and sleeps
        # ``store_delay`` seconds (a slow store) when set.
        self.checked = False
        self.store = threading.Event()
        self.store.set()
        self.store_delay = 0.0
        self.store_reads: list[str] = []  # the thread each read ran in
        self.checked_opens = 0
        # READs get a fast path on the loop, and one in the request thread
        # that always declines (as ckptfs's does for bytes in a chunk's
        # frame); read-only opens are direct_io, so every pread is a READ.
        self.fast_reads = False
        self.reads_declined_off_loop = 0

    def _attr(self, ino: int) -> TinyAttr:
        if ino == abi.ROOT_ID or ino >= DIRS:
            return TinyAttr(ino, stat.S_IFDIR | 0o755, 0)
        return TinyAttr(ino, stat.S_IFREG | 0o644, len(self.files.setdefault(ino, bytearray())))

    @property
    def data(self) -> bytearray:
        return self.files[2]

    def handlers(self) -> Handlers:
        return Handlers(
            slow={
                Op.LOOKUP: self.lookup,
                Op.GETATTR: self.getattr,
                Op.OPEN: self.open,
                Op.READ: self.read,
                Op.WRITE: self.write,
                Op.FLUSH: self.ok,
                Op.RELEASE: self.release,
                Op.SETATTR: self.getattr,
                Op.MKDIR: self.mkdir,
                Op.UNLINK: self.unlink,
                Op.RMDIR: self.rmdir,
            },
            fast={
                Op.OPEN: self.open_now,
                Op.RELEASE: self.release_now,
                Op.GETATTR: self.getattr_now,
                **({Op.READ: self.read_now} if self.fast_reads else {}),
            },
            off_loop=(
                {
                    Op.OPEN: self.open_now,
                    Op.RELEASE: self.release_now,
                    **({Op.READ: self.read_declined} if self.fast_reads else {}),
                }
                if self.off_loop
                else {}
            ),
            off_loop_checked=(
                {Op.OPEN: CheckedPath(self.check_plan, self.check_read, self.check_finish)}
                if self.checked
                else {}
            ),
        )

    def check_plan(self, req: Request) -> int | None:
        return req.nodeid if req.nodeid == 2 else None  # f only

    def check_read(self, ino: int) -> str | None:
        self.store_reads.append(threading.current_thread().name)
        assert self.store.wait(TIMEOUT)
        if self.store_delay:
            time.sleep(self.store_delay)
        return "entry"

    def check_finish(self, req: Request, ino: int, entry: str) -> bytes | None:
        self.checked_opens += 1
        return abi.open_out(1, abi.FOPEN_NOFLUSH)

    async def lookup(self, req: Request) -> bytes:
        name = abi.names(req.body, 1)[0]
        if name == b"f":
            return abi.entry_out(self._attr(2), self.timeout)
        if name.startswith(b"f") and name[1:].isdigit():
            return abi.entry_out(self._attr(2 + int(name[1:])), self.timeout)
        if name.startswith(b"rm"):  # empty directories, for rmdir
            return abi.entry_out(self._attr(DIRS + zlib.crc32(name)), self.timeout)
        raise FuseError(errno.ENOENT)

    async def getattr(self, req: Request) -> bytes:
        return abi.attr_out(self._attr(req.nodeid), self.timeout)

    def getattr_now(self, req: Request) -> bytes | None:
        self.log.append("getattr")
        return abi.attr_out(self._attr(req.nodeid), self.timeout)

    async def open(self, req: Request) -> bytes:
        self.slow_opens += 1
        return abi.open_out(1, 0)

    def open_now(self, req: Request) -> bytes | None:
        (flags, _) = abi.OPEN_IN.unpack_from(req.body)
        if self.decline:
            return None
        self.fast_opens += 1
        self.fast_threads.append(threading.current_thread().name)
        self.fast_calls.append((time.monotonic(), threading.current_thread().name))
        if flags & os.O_ACCMODE:  # a writer: its handle is 2, released by a worker
            return abi.open_out(2, abi.FOPEN_DIRECT_IO)
        return abi.open_out(1, abi.FOPEN_NOFLUSH | (abi.FOPEN_DIRECT_IO * self.fast_reads))

    def read_now(self, req: Request) -> bytes:
        _, off, size, *_ = abi.READ_IN.unpack_from(req.body)
        return bytes(self.files[req.nodeid][off : off + size])

    def read_declined(self, req: Request) -> None:
        self.reads_declined_off_loop += 1
        return None

    def release_now(self, req: Request) -> bytes | None:
        (fh, *_) = abi.RELEASE_IN.unpack_from(req.body)
        self.fast_calls.append((time.monotonic(), threading.current_thread().name))
        return None if fh == 2 else b""

    async def release(self, req: Request) -> bytes:
        await trio.lowlevel.checkpoint()  # a writer's release awaits (a commit)
        self.log.append("release")
        return b""

    async def read(self, req: Request) -> bytes:
        _, off, size, *_ = abi.READ_IN.unpack_from(req.body)
        return bytes(self.files[req.nodeid][off : off + size])

    async def write(self, req: Request) -> bytes:
        _, off, size, *_ = abi.WRITE_IN.unpack_from(req.body)
        data = bytes(req.body[abi.WRITE_IN.size : abi.WRITE_IN.size + size])
        self.writes_in_flight += 1
        try:
            if self.hold is not None:
                with interruptible("tiny's write") if self.hold_interruptible else nullcontext():
                    await self.hold.wait()
        finally:
            self.writes_in_flight -= 1
        dest = self.files[req.nodeid]
        if off + size > len(dest):
            dest.extend(bytes(off + size - len(dest)))
        dest[off : off + size] = data
        return abi.WRITE_OUT.pack(size, 0)

    async def ok(self, req: Request) -> bytes:
        return b""

    async def mkdir(self, req: Request) -> bytes:
        raise FuseError(errno.EACCES)

    async def unlink(self, req: Request) -> bytes:
        raise ValueError("a handler bug")

    async def rmdir(self, req: Request) -> bytes | None:
        # Handler bugs that must still answer: rm-2 raises a negative errno
        # (socket.gaierror's), rm600 one past the kernel's range, rmnone
        # returns no reply at all; rmN raises errno N.
        name = abi.names(req.body, 1)[0]
        if name == b"rmnone":
            return None
        raise FuseError(int(name[2:]))


@contextmanager
def served(
    tmp_path: Path,
    tiny: Tiny,
    *,
    buffers: int | None = None,
    request_thread: bool = True,
    spin: float = 0.0,
) -> Iterator[tuple[Path, Session, trio.lowlevel.TrioToken]]:
    mnt = tmp_path / "mnt"
    mnt.mkdir(exist_ok=True)
    fd = fusemount.mount(str(mnt), "tinyfs", {"default_permissions"})
    extra = {} if buffers is None else {"buffers": buffers}
    session = Session(
        fd, tiny.handlers(), workers=32, request_thread=request_thread, spin=spin, **extra
    )
    ready = threading.Event()
    tokens: list[trio.lowlevel.TrioToken] = []
    ended = threading.Event()
    errors: list[BaseException] = []

    async def main() -> None:
        tokens.append(trio.lowlevel.current_trio_token())
        ready.set()
        await session.run()

    def loop() -> None:
        try:
            trio.run(main)
        except BaseException as exc:  # the test fails on it below
            errors.append(exc)
        finally:
            ended.set()

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    assert ready.wait(TIMEOUT)
    try:
        yield mnt, session, tokens[0]
    finally:
        session.terminate()
        ended.wait(TIMEOUT)
        fusemount.unmount(str(mnt))
        session.close()
        thread.join(TIMEOUT)
        assert not _is_mounted(mnt)
        assert not errors, errors  # the session ends without an exception


def test_a_mount_answers_inline_and_through_workers(tmp_path: Path) -> None:
    data = os.urandom(3 << 20)
    tiny = Tiny(data)
    with served(tmp_path, tiny) as (mnt, session, _):
        assert _is_mounted(mnt)
        assert stat.S_ISDIR(os.stat(mnt).st_mode)
        assert (mnt / "f").read_bytes() == data  # LOOKUP, GETATTR, READs on the loop
        with pytest.raises(FileNotFoundError):
            os.stat(mnt / "missing")
        fd = os.open(mnt / "f", os.O_RDONLY)
        try:  # Python's isatty: answered by the request thread, never the loop
            with pytest.raises(OSError) as err:
                fcntl.ioctl(fd, termios.TCGETS, bytes(64))
            assert err.value.errno == errno.ENOTTY
        finally:
            os.close(fd)
        with pytest.raises(OSError) as err:  # no xattr handler: ENOSYS, which the kernel
            os.getxattr(mnt / "f", "user.x")  # turns into "not supported"
        assert err.value.errno == errno.EOPNOTSUPP
        with pytest.raises(PermissionError):  # a handler's FuseError is the errno
            os.mkdir(mnt / "d")
        with pytest.raises(OSError) as err:  # any other exception: EIO (and logged)
            os.unlink(mnt / "f")
        assert err.value.errno == errno.EIO
        c = session.counters
        assert (
            tiny.fast_opens >= 2
            and c.fast >= 2
            and c.stateless + c.thread_stateless >= 2
            and c.handled >= 4
        )


def test_the_request_thread_answers_small_requests_while_the_loop_waits(tmp_path: Path) -> None:
    tiny = Tiny(b"abc")
    tiny.off_loop = True
    with served(tmp_path, tiny) as (mnt, session, _):
        # The LOOKUP needs a worker: the loop reads on for a moment, and
        # answers an open that comes meanwhile itself.
        os.close(os.open(mnt / "f", os.O_RDONLY))
        del tiny.fast_threads[:]
        for _ in range(50):
            os.close(os.open(mnt / "f", os.O_RDONLY))
        # One that comes while the loop still finishes its turn (the state
        # lock taken) goes to the loop, by design; the rest, the thread.
        on_thread = tiny.fast_threads.count("ckptfs-fuse")
        assert on_thread >= 45, tiny.fast_threads
        assert session.counters.thread >= 90  # of the 50 opens and their 50 releases
        assert session.mode is ReadMode.THREAD


def _epolls_listing(fd: int) -> list[str]:
    """The epoll descriptors of this process that list ``fd``."""
    found = []
    for name in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{name}") != "anon_inode:[eventpoll]":
                continue
            info = Path(f"/proc/self/fdinfo/{name}").read_text()
        except OSError:
            continue  # closed meanwhile
        if any(line.split()[:2] == ["tfd:", str(fd)] for line in info.splitlines()):
            found.append(name)
    return found


def _voluntary_switches(tid: int) -> int:
    status = Path(f"/proc/self/task/{tid}/status").read_text()
    return int(next(ln.split()[1] for ln in status.splitlines() if ln.startswith("voluntary_")))


def test_the_loop_sleeps_through_the_requests_the_thread_answers(tmp_path: Path) -> None:
    """Once the loop has read /dev/fuse itself (a LOOKUP it handed to a
    worker) and given the reading back, /dev/fuse is out of its epoll set:
    the kernel wakes every waiter of /dev/fuse at each request, and a
    registration trio leaves behind (its events masked) would wake the
    loop's thread for every request the thread answers, only to sleep again,
    preempting the thread on its CPU (docs/PERFORMANCE.md)."""
    tiny = Tiny(b"abc")
    tiny.off_loop = True
    with served(tmp_path, tiny) as (mnt, session, token):
        loop_tid = trio.from_thread.run_sync(threading.get_native_id, trio_token=token)
        # The LOOKUP needs a worker: the loop reads on, waits for /dev/fuse
        # for LOOP_IDLE since nothing follows, then gives the reading back.
        os.stat(mnt / "f")
        _wait_for(lambda: session.mode is ReadMode.THREAD)
        assert session.counters.handled >= 1
        # (The mode is the thread's a moment before the loop's reader drops
        # the registration, on its way to wait for the thread's hand-over.)
        _wait_for(lambda: _epolls_listing(session.fd) == [])
        fd = os.open(mnt / "f", os.O_RDONLY)
        try:
            before, answered = _voluntary_switches(loop_tid), session.counters.thread_stateless
            for _ in range(200):  # isatty: one IOCTL each, which the thread answers
                with pytest.raises(OSError):
                    fcntl.ioctl(fd, termios.TCGETS, bytes(64))
            woken = _voluntary_switches(loop_tid) - before
        finally:
            os.close(fd)
        assert session.counters.thread_stateless - answered == 200  # all by the thread
        assert woken < 20, f"the loop's thread slept {woken} times in 200 requests"


@pytest.mark.skipif(
    len(os.sched_getaffinity(0)) < 2, reason="the thread spins only when the caller has a CPU"
)
def test_the_request_thread_spins_for_the_callers_next_request(tmp_path: Path) -> None:
    """After an answer of its own the thread reads again for ``spin`` before
    it waits in poll(2), when its caller runs on another CPU: the isatty
    IOCTL that Python's open() sends right after its OPEN is found while it
    spins. Without spin, never. (The thread on CPU 0, the caller on 1.)"""

    def opens(mnt: Path) -> None:
        """20 opens, each with an isatty IOCTL, by another process on CPU 1
        (one of this process's threads would wait for the GIL the spinner holds)."""
        script = (
            "import errno, fcntl, os, sys, termios\n"
            "for _ in range(20):\n"
            "    fd = os.open(sys.argv[1], os.O_RDONLY)\n"
            "    try:\n"
            "        fcntl.ioctl(fd, termios.TCGETS, bytes(64))\n"
            "    except OSError as e:\n"
            "        assert e.errno == errno.ENOTTY, e\n"
            "    else:\n"
            "        raise AssertionError('a tty?')\n"
            "    os.close(fd)\n"
        )
        subprocess.run(
            [sys.executable, "-c", script, str(mnt / "f")],
            check=True,
            timeout=TIMEOUT,
            preexec_fn=lambda: os.sched_setaffinity(0, {cpus[1]}),
        )

    cpus = sorted(os.sched_getaffinity(0))
    tiny = Tiny(b"abc")
    tiny.off_loop = True

    def pin_the_reader() -> None:
        deadline = time.monotonic() + TIMEOUT
        while not (readers := [t for t in threading.enumerate() if t.name == "ckptfs-fuse"]):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        while readers[0].native_id is None:  # started, not yet running
            assert time.monotonic() < deadline
            time.sleep(0.01)
        os.sched_setaffinity(readers[0].native_id, {cpus[0]})

    with served(tmp_path, tiny, spin=0.5) as (mnt, session, _):
        pin_the_reader()
        os.close(os.open(mnt / "f", os.O_RDONLY))  # the LOOKUP: the loop reads for a while
        time.sleep(0.6)  # the thread reads, and waits in poll(2)
        c = session.counters
        thread, waits = c.thread, c.thread_waits
        opens(mnt)
        # Each IOCTL and RELEASE follows an answer by microseconds: the
        # thread answers them all, and waits only for the first OPEN (and,
        # at most, once its spin after the last answer ran out).
        assert c.thread - thread == 40, c
        assert c.thread_waits - waits <= 2, c
        assert c.spun >= 1, c  # (on a busy machine the next request is often there already)
        assert session.mode is ReadMode.THREAD
    with served(tmp_path, tiny, spin=0.0) as (mnt, session, _):
        opens(mnt)
        assert session.counters.thread >= 30 and session.counters.spun == 0
    # When the yield after a reply ran another task (the caller, on the
    # thread's CPU), the thread waits in poll(2) rather than spin beside it.
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(fusesession, "_yield_ran_another", lambda: True)
        with served(tmp_path, tiny, spin=0.5) as (mnt, session, _):
            pin_the_reader()
            opens(mnt)
            assert session.counters.thread >= 30 and session.counters.spun == 0


def test_the_request_thread_never_runs_a_fast_path_beside_a_task_step(tmp_path: Path) -> None:
    """A task step that does not await (here 0.3 s of it) holds the state
    lock: the request thread runs no fast path meanwhile, and an open that
    comes meanwhile is answered once the step is over."""
    tiny = Tiny(b"abc")
    tiny.off_loop = True
    with served(tmp_path, tiny) as (mnt, session, token):
        os.close(os.open(mnt / "f", os.O_RDONLY))  # the name is cached
        stepping = threading.Event()
        step: list[float] = []

        def hold_the_loop() -> None:
            step.append(time.monotonic())
            stepping.set()
            time.sleep(0.3)  # a task step that does not await
            step.append(time.monotonic())

        trio.from_thread.run_sync(
            lambda: trio.lowlevel.spawn_system_task(_call_sync, hold_the_loop), trio_token=token
        )
        assert stepping.wait(TIMEOUT)
        start = time.monotonic()
        os.close(os.open(mnt / "f", os.O_RDONLY))
        assert time.monotonic() - start > 0.2  # not answered beside the step
        beside = [c for c in tiny.fast_calls if step[0] < c[0] < step[1]]
        assert not beside, beside
        deadline = time.monotonic() + TIMEOUT
        while session.mode is not ReadMode.THREAD and time.monotonic() < deadline:
            time.sleep(LOOP_IDLE)
        os.close(os.open(mnt / "f", os.O_RDONLY))  # the thread reads again
        assert tiny.fast_threads[-1] == "ckptfs-fuse"


async def _call_sync(fn: Any) -> None:
    fn()


def test_a_stream_of_reads_the_thread_declines_stays_with_the_loop(tmp_path: Path) -> None:
    """READs the request thread declines (in ckptfs, bytes in a chunk's
    frame) and the loop answers inline: the loop reads on, until LOOP_IDLE
    without a request, rather than give the reading back after each READ
    and take it again with the next (a hand-over per READ)."""
    data = os.urandom(64 * 4096)
    tiny = Tiny(data)
    tiny.off_loop = tiny.fast_reads = True
    with served(tmp_path, tiny) as (mnt, session, _):
        fast = session.counters.fast
        fd = os.open(mnt / "f", os.O_RDONLY)
        try:
            got = b"".join(os.pread(fd, 4096, i * 4096) for i in range(64))
        finally:
            os.close(fd)
        assert got == data
        assert session.counters.fast - fast >= 64  # each READ answered inline by the loop
        # The first READ, and one after each pause of the caller past LOOP_IDLE.
        assert tiny.reads_declined_off_loop <= 8, tiny.reads_declined_off_loop


def test_the_thread_takes_the_state_no_more_once_the_loop_waits_for_it() -> None:
    """Lock hand-offs are not fair: a thread answering a stream of requests
    could take the state lock again each time before the loop's thread,
    woken by the release, runs. Once the loop waits for the lock, the
    thread's try fails until the loop has had it."""
    from ckptfs.fs.fusesession import _LoopHoldsState

    lock = threading.Lock()
    holds = _LoopHoldsState(lock)
    assert holds.try_take()  # the thread answers something, the loop in its I/O wait
    loop = threading.Thread(target=holds.after_io_wait, args=(0.0,))
    loop.start()
    deadline = time.monotonic() + TIMEOUT
    while not holds.loop_waits and time.monotonic() < deadline:
        time.sleep(0.001)
    assert holds.loop_waits
    lock.release()  # the thread's answer is written
    tries = [holds.try_take() for _ in range(20_000)]  # while the loop's thread wakes
    assert not any(tries)
    loop.join(TIMEOUT)
    assert not loop.is_alive() and lock.locked() and not holds.loop_waits
    holds.before_io_wait(0.0)  # the loop waits for I/O again
    assert holds.try_take()
    lock.release()


def test_a_burst_of_writes_is_read_by_the_loop_then_the_thread_reads_again(
    tmp_path: Path,
) -> None:
    tiny = Tiny(b"")
    tiny.off_loop = True
    blob = os.urandom(16 << 20)
    with served(tmp_path, tiny) as (mnt, session, _):
        handled = session.counters.handled
        _pwrite(mnt / "f1", blob)
        assert bytes(tiny.files[3]) == blob
        # 1 MiB WRITEs: each handled by a worker that took it from the loop's
        # own read, not handed over by the thread one at a time.
        assert session.counters.handled - handled >= 16
        deadline = time.monotonic() + TIMEOUT
        while "release" not in tiny.log and time.monotonic() < deadline:
            time.sleep(LOOP_IDLE)  # the writer's RELEASE comes after close() returned
        time.sleep(4 * LOOP_IDLE)
        assert session.mode is ReadMode.THREAD  # idle: the thread reads again
        thread_before = session.counters.thread
        for _ in range(10):
            os.close(os.open(mnt / "f1", os.O_RDONLY))  # its name is cached: OPEN, RELEASE
        assert session.counters.thread - thread_before >= 10


def _read_f_checked_by_the_thread(mnt: Path, tiny: Tiny, session: Any) -> None:
    """Reads f until the request thread answered one of its opens with its
    own check. An open that comes while the loop holds the state lock (its
    bookkeeping right after it gave the reading back, which a loaded machine
    stretches) goes to the loop instead, a correct answer but not the path
    under test; a few tries make that race harmless, no more."""
    checked = tiny.checked_opens
    for _ in range(5):
        _wait_for(lambda: session.mode is ReadMode.THREAD)
        assert (mnt / "f").read_bytes() == b"abc"
        if tiny.checked_opens != checked:
            break
    assert tiny.checked_opens == checked + 1


def test_a_store_read_of_the_thread_held_up_is_taken_over_by_the_loop(
    tmp_path: Path, monkeypatch: Any
) -> None:
    """The request thread's own store read (a due check of f) hangs: past
    STORE_CALL_WAIT the loop reads and answers the held-up open itself (its
    own open, as for any declined fast path), other files open, read and
    stat meanwhile, and the reading goes back to the thread only once the
    read returned (no store reads of its own within the cooldown)."""
    # Well above a healthy read even on a loaded machine: the thread's first
    # check must not be taken over (it was, once, in CI at 0.05 s).
    monkeypatch.setattr(fusesession, "STORE_CALL_WAIT", 0.3)
    monkeypatch.setattr(fusesession, "STORE_CALL_COOLDOWN", 0.5)
    tiny = Tiny(b"abc")
    tiny.checked = True
    tiny.decline = True  # no open answers without its check: the loop's opens are slow ones
    with served(tmp_path, tiny) as (mnt, session, _):
        assert (mnt / "f").read_bytes() == b"abc"  # the name is cached
        (mnt / "f1").write_bytes(b"other")
        _read_f_checked_by_the_thread(mnt, tiny, session)
        assert tiny.checked_opens == 1 and set(tiny.store_reads) == {"ckptfs-fuse"}
        assert session.counters.taken == 0
        reads = len(tiny.store_reads)
        _wait_for(lambda: session.mode is ReadMode.THREAD)
        tiny.store.clear()  # the store hangs
        slow = tiny.slow_opens
        held: list[bytes] = []
        reader = threading.Thread(target=lambda: held.append((mnt / "f").read_bytes()))
        reader.start()
        try:
            _wait_for(lambda: session.counters.taken == 1)
            reader.join(TIMEOUT)
            assert held == [b"abc"] and tiny.slow_opens == slow + 1  # answered by the loop
            assert tiny.store.is_set() is False  # while the thread's read still hangs
            for _ in range(5):  # the loop answers everyone else too
                assert (mnt / "f1").read_bytes() == b"other"
                assert os.stat(mnt).st_mode & stat.S_IFDIR
            time.sleep(4 * LOOP_IDLE)  # idle, but the thread is still held up: the loop reads on
            assert session.mode is ReadMode.LOOP and tiny.checked_opens == 1
        finally:
            tiny.store.set()
            reader.join(TIMEOUT)
        _wait_for(lambda: session.mode is ReadMode.THREAD)  # given back once the read returned
        assert tiny.checked_opens == 1  # the thread dropped the request the loop answered
        slow = tiny.slow_opens
        assert (mnt / "f").read_bytes() == b"abc"  # in the cooldown: the loop checks it
        assert tiny.slow_opens == slow + 1 and len(tiny.store_reads) == reads + 1  # the hung one
        time.sleep(0.6)
        _read_f_checked_by_the_thread(mnt, tiny, session)  # past it: the thread again
        assert tiny.checked_opens == 2 and set(tiny.store_reads) == {"ckptfs-fuse"}
        assert session.counters.taken == 1


def test_a_session_ends_cleanly_while_the_thread_is_held_up_in_the_store(
    tmp_path: Path, monkeypatch: Any
) -> None:
    """terminate() while the thread's store read hangs (not yet overrun):
    the loop takes the read's request at once and answers it, the session
    ends, and the thread, when its read returns, touches nothing."""
    monkeypatch.setattr(fusesession, "STORE_CALL_WAIT", 30.0)
    monkeypatch.setattr(fusesession, "THREAD_JOIN", 0.2)
    tiny = Tiny(b"abc")
    tiny.checked = True
    tiny.decline = True
    held: list[object] = []
    with served(tmp_path, tiny) as (mnt, session, _):
        assert (mnt / "f").read_bytes() == b"abc"
        _wait_for(lambda: session.mode is ReadMode.THREAD)
        reads = len(tiny.store_reads)
        tiny.store.clear()

        def read() -> None:  # an open only: nobody reads its READ or FLUSH once it ends
            try:
                held.append(os.open(mnt / "f", os.O_RDONLY))
            except OSError as exc:
                held.append(exc)

        reader = threading.Thread(target=read)
        reader.start()
        _wait_for(lambda: len(tiny.store_reads) == reads + 1)  # the thread is in its read
        checked = tiny.checked_opens
        session.terminate()
        reader.join(TIMEOUT)
        assert len(held) == 1 and isinstance(held[0], int), held  # opened
        assert session.counters.taken == 0
        assert session._store_watch is not None
        assert session._store_watch.overruns == 1  # taken as the session ended
    with contextlib.suppress(OSError):
        os.close(held[0])  # the connection is gone
    tiny.store.set()  # the read returns after the session ended
    time.sleep(0.2)
    assert tiny.checked_opens == checked  # nothing answered from the thread
    assert not reader.is_alive()


def test_hand_overs_and_takeovers_under_many_callers_lose_no_request(
    tmp_path: Path, monkeypatch: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Four processes at once: opens the thread answers, opens it checks
    with a store read of its own that now and then overruns (the loop takes
    the reading), lookups of new names and writes that need the loop (the
    reading handed over). Every call is answered, in bounded time, and no
    hand-over finds the loop's channel full."""
    monkeypatch.setattr(fusesession, "STORE_CALL_WAIT", 0.005)
    monkeypatch.setattr(fusesession, "STORE_CALL_COOLDOWN", 0.0)
    tiny = Tiny(b"abc")
    tiny.off_loop = True
    tiny.checked = True
    tiny.decline = True
    script = textwrap.dedent(
        """
        import os, sys
        mnt, me = sys.argv[1], int(sys.argv[2])
        for i in range(150):
            with open(os.path.join(mnt, "f"), "rb") as f:
                assert f.read() == b"abc"
            try:
                os.stat(os.path.join(mnt, f"missing-{me}-{i}"))
            except FileNotFoundError:
                pass
            with open(os.path.join(mnt, f"f{me + 1}"), "r+b" if i else "wb") as f:
                f.write(i.to_bytes(4, "little"))
        """
    )
    logged = caplog.at_level("WARNING", logger="ckptfs.fuse")
    with logged, served(tmp_path, tiny) as (mnt, session, _):
        slow = 0

        def slow_now_and_then() -> None:
            nonlocal slow
            while not done.is_set():  # every 10th read or so overruns
                tiny.store_delay = 0.02 if slow % 10 == 0 else 0.0
                slow += 1
                time.sleep(0.003)

        done = threading.Event()
        flipper = threading.Thread(target=slow_now_and_then)
        flipper.start()
        try:
            procs = [
                subprocess.Popen([sys.executable, "-c", script, str(mnt), str(k)]) for k in range(4)
            ]
            for p in procs:
                assert p.wait(timeout=120) == 0
        finally:
            done.set()
            flipper.join(TIMEOUT)
            tiny.store_delay = 0.0
        c = session.counters
        assert c.checked > 0 and c.taken > 0 and c.handled > 0, c
        for k in range(4):
            assert bytes(tiny.files[3 + k]) == (149).to_bytes(4, "little")
    errors = [r for r in caplog.records if r.levelname == "ERROR"]
    assert not errors, [r.getMessage() for r in errors]


def _wait_for(cond: Any) -> None:
    deadline = time.monotonic() + TIMEOUT
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_without_the_request_thread_the_loop_reads_everything(tmp_path: Path) -> None:
    tiny = Tiny(b"abc")
    tiny.off_loop = True
    with served(tmp_path, tiny, request_thread=False) as (mnt, session, _):
        for _ in range(10):
            assert (mnt / "f").read_bytes() == b"abc"
        assert session.counters.thread == 0 and session.counters.fast >= 20
        assert "ckptfs-fuse" not in tiny.fast_threads


def test_a_declined_fast_path_is_answered_by_the_loop(tmp_path: Path) -> None:
    tiny = Tiny(b"abc")
    tiny.decline = True
    with served(tmp_path, tiny) as (mnt, session, _):
        for _ in range(20):
            assert (mnt / "f").read_bytes() == b"abc"
        assert tiny.fast_opens == 0 and tiny.slow_opens == 20
        assert session.counters.declined == 20


def test_each_request_is_handled_in_the_order_it_came(tmp_path: Path) -> None:
    """A request without a fast path starts its handler before the next
    request is read (as pyfuse3 did): a writer's RELEASE, which the kernel
    sends after close() returns, is handled before the stat that follows,
    even when that stat is answered by a fast path."""
    tiny = Tiny(b"")
    tiny.timeout = 0.0  # every stat asks
    with served(tmp_path, tiny) as (mnt, session, _):
        for i in range(50):
            fd = os.open(mnt / "f1", os.O_WRONLY)
            os.write(fd, b"x")
            os.close(fd)
            os.stat(mnt / "f1")
            releases = [k for k, e in enumerate(tiny.log) if e == "release"]
            stats = [k for k, e in enumerate(tiny.log) if e == "getattr"]
            assert len(releases) == i + 1 and releases[-1] < stats[-1], tiny.log[-6:]
        c = session.counters
        assert c.fast + c.thread >= 100  # the opens and stats took no task


def test_writes_held_by_their_handlers_do_not_stop_the_reading(tmp_path: Path) -> None:
    """More large WRITEs waiting in their handlers (as writers in backpressure
    do) than read buffers: the thread copies the next ones out and reads on,
    so a stat is still answered; every byte lands where it was written.
    (Four files: the kernel sends one file's direct writes one at a time.)"""
    tiny = Tiny(b"")
    chunk = 8 << 20
    blobs = [os.urandom(chunk) for _ in range(4)]
    with served(tmp_path, tiny, buffers=2) as (mnt, session, token):
        release = trio.Event()
        tiny.hold = release
        threads = [
            threading.Thread(target=_pwrite, args=(mnt / f"f{i + 1}", blobs[i])) for i in range(4)
        ]
        for t in threads:
            t.start()
        deadline = time.monotonic() + TIMEOUT
        while tiny.writes_in_flight < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert tiny.writes_in_flight >= 4  # more than the 2 buffers, all held
        start = time.monotonic()
        os.stat(mnt / "f")
        assert time.monotonic() - start < 2
        trio.from_thread.run_sync(release.set, trio_token=token)
        for t in threads:
            t.join(TIMEOUT)
        assert not any(t.is_alive() for t in threads)
    for i, blob in enumerate(blobs):
        assert hashlib.sha256(tiny.files[3 + i]).digest() == hashlib.sha256(blob).digest()


SIGNALLED_WRITER = textwrap.dedent(
    """
    import os, signal, sys
    signal.signal(signal.SIGUSR1, lambda *_: print("SIGUSR1 handled", flush=True))
    fd = os.open(sys.argv[1], os.O_WRONLY)
    print("writing", flush=True)
    try:
        n = os.write(fd, b"x" * 4096)
        print("wrote", n, flush=True)
    except KeyboardInterrupt:
        print("interrupted", flush=True)
    """
)


@pytest.mark.parametrize(
    "interruptible_wait, sig",
    [(True, signal.SIGINT), (False, signal.SIGINT), (True, signal.SIGUSR1)],
)
def test_a_stop_signal_ends_only_an_interruptible_wait(
    tmp_path: Path, interruptible_wait: bool, sig: signal.Signals
) -> None:
    """Ctrl-C of a process whose write waits in its handler: the kernel sends
    INTERRUPT. A wait that opted in (interrupts.interruptible) ends, the write
    gets EINTR and Python raises KeyboardInterrupt at once. Any other wait is
    left alone, and so is every wait for a signal that does not ask the
    process to stop (SIGUSR1 here, DataLoader's SIGCHLD in a training job):
    the write completes once its handler is done."""
    tiny = Tiny(b"")
    tiny.hold_interruptible = interruptible_wait
    with served(tmp_path, tiny) as (mnt, session, token):
        release = trio.Event()
        tiny.hold = release
        writer = subprocess.Popen(
            [sys.executable, "-c", SIGNALLED_WRITER, str(mnt / "f1")],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert writer.stdout is not None
            assert writer.stdout.readline().strip() == "writing"
            deadline = time.monotonic() + TIMEOUT
            while tiny.writes_in_flight < 1 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert tiny.writes_in_flight == 1
            writer.send_signal(sig)
            c = session.counters
            if interruptible_wait and sig == signal.SIGINT:
                assert writer.stdout.readline().strip() == "interrupted"
                assert writer.wait(TIMEOUT) == 0
                assert tiny.writes_in_flight == 0
                assert bytes(tiny.files[3]) == b""  # nothing written
                assert (c.interrupts, c.signals_ignored) == (1, 0)
                return
            time.sleep(0.5)
            assert writer.poll() is None  # still waiting: no effect yet
            assert tiny.writes_in_flight == 1
            trio.from_thread.run_sync(release.set, trio_token=token)
            if sig == signal.SIGINT:
                # The write returns, then Python raises the KeyboardInterrupt.
                assert writer.stdout.readline().strip() == "interrupted"
                assert (c.interrupts, c.signals_ignored) == (1, 0)  # marked, never acted on
            else:
                assert writer.stdout.readline().strip() == "SIGUSR1 handled"
                assert writer.stdout.readline().strip() == "wrote 4096"
                assert (c.interrupts, c.signals_ignored) == (0, 1)
            assert writer.wait(TIMEOUT) == 0
            assert bytes(tiny.files[3]) == b"x" * 4096
        finally:
            if writer.poll() is None:
                trio.from_thread.run_sync(release.set, trio_token=token)
                writer.kill()
                writer.wait(TIMEOUT)
            # Every handled request's mark is gone once it is answered; the
            # writer's exit may still have its close (RELEASE) in a handler.
            deadline = time.monotonic() + TIMEOUT
            while session._in_flight and time.monotonic() < deadline:
                time.sleep(0.01)
            assert not session._in_flight


def _pwrite(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY)  # direct_io: 1 MiB requests
    try:
        assert os.pwrite(fd, data, 0) == len(data)
    finally:
        os.close(fd)


def test_an_unmount_from_outside_ends_the_session(tmp_path: Path) -> None:
    tiny = Tiny(b"abc")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    fd = fusemount.mount(str(mnt), "tinyfs", {"default_permissions"})
    session = Session(fd, tiny.handlers(), workers=8)

    async def main() -> None:
        with trio.fail_after(TIMEOUT):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(session.run)
                await trio.to_thread.run_sync(lambda: (mnt / "f").read_bytes())
                subprocess.run(["fusermount3", "-u", str(mnt)], check=True, timeout=TIMEOUT)

    try:
        trio.run(main)  # returns once run() has seen the connection end
    finally:
        session.close()
    assert not _is_mounted(mnt)


def test_an_unprivileged_mount_goes_through_fusermount3(tmp_path: Path) -> None:
    """Not root: fusermount3 mounts and hands over the /dev/fuse descriptor."""
    if os.geteuid() != 0:
        pytest.skip("needs root to drop to another user")
    # Outside pytest's tmp_path, which only root may enter.
    home = Path(tempfile.mkdtemp(prefix="ckptfs-user-"))
    home.chmod(0o755)
    (home / "mnt").mkdir()
    os.chown(home / "mnt", 65534, 65534)
    # Distributions make /dev/fuse 0666 for fusermount3's users; this
    # machine's is root's alone. As a distribution has it, for the test only.
    mode = stat.S_IMODE(os.stat("/dev/fuse").st_mode)
    os.chmod("/dev/fuse", 0o666)
    try:
        _mount_as_nobody(home / "mnt")
    finally:
        os.chmod("/dev/fuse", mode)
        if _is_mounted(home / "mnt"):
            fusemount.unmount(str(home / "mnt"))
        shutil.rmtree(home, ignore_errors=True)


def _mount_as_nobody(mnt: Path) -> None:
    code = textwrap.dedent(
        """
        import os, sys, threading, trio
        sys.path.insert(0, sys.argv[2])
        from test_fusesession import Tiny
        from ckptfs.fs import fusemount
        from ckptfs.fs.fusesession import Session
        os.setgroups([]); os.setgid(65534); os.setuid(65534)
        mnt = sys.argv[1]
        fd = fusemount.mount(mnt, "tinyfs", {"default_permissions"})
        session = Session(fd, Tiny(b"as nobody").handlers(), workers=8)
        async def main():
            async with trio.open_nursery() as n:
                n.start_soon(session.run)
                got = await trio.to_thread.run_sync(
                    lambda: open(os.path.join(mnt, "f"), "rb").read())
                mounts = open("/proc/self/mounts").read()
                print(got.decode(), "fuse.tinyfs" in mounts and mnt in mounts, flush=True)
                session.terminate()
        trio.run(main)
        fusemount.unmount(mnt)
        session.close()
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(mnt), str(Path(__file__).parent)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["as", "nobody", "True"]
    assert not _is_mounted(mnt)


def _bounded(fn: Any, *args: Any) -> BaseException | None:
    """What ``fn(*args)`` raised, from a thread, failing if it hangs."""
    out: list[BaseException | None] = []

    def call() -> None:
        try:
            fn(*args)
            out.append(None)
        except BaseException as exc:
            out.append(exc)

    t = threading.Thread(target=call, daemon=True)
    t.start()
    t.join(TIMEOUT)
    assert out, f"{fn.__name__}{args} got no answer within {TIMEOUT}s"
    return out[0]


def test_a_handler_bug_still_answers_the_caller(tmp_path: Path) -> None:
    """An errno the kernel would refuse, or no reply at all, must not leave
    the caller waiting for ever: it gets EIO."""
    with served(tmp_path, Tiny(b"")) as (mnt, session, _):
        for name in ("rm-2", "rm600", "rm0", "rmnone"):
            err = _bounded(os.rmdir, mnt / name)
            assert isinstance(err, OSError) and err.errno == errno.EIO, (name, err)
        err = _bounded(os.rmdir, mnt / "rm39")  # a real errno goes through
        assert isinstance(err, OSError) and err.errno == errno.ENOTEMPTY
        assert _is_mounted(mnt)


@pytest.mark.parametrize("where", ["answering", "handing on"])
def test_a_bug_in_the_request_thread_leaves_the_loop_reading(
    tmp_path: Path, monkeypatch: Any, caplog: pytest.LogCaptureFixture, where: str
) -> None:
    """An exception out of the request thread's own code (not a handler's,
    which becomes the reply's errno), while it answers a request or hands
    one to the loop, must not leave /dev/fuse unread: that request gets
    EIO, the loop reads every request from then on, and the failure is
    logged and counted."""
    tiny = Tiny(b"abc")
    tiny.off_loop = True
    with served(tmp_path, tiny) as (mnt, session, _):
        assert (mnt / "f").read_bytes() == b"abc"
        _wait_for(lambda: session.mode is ReadMode.THREAD)

        def in_thread() -> bool:
            return threading.current_thread().name == "ckptfs-fuse"

        if where == "answering":
            answer = Session.answer_off_loop

            def broken_answer(self: Session, req: Any) -> bool:
                if req.op == Op.OPEN and in_thread():
                    raise RuntimeError("a bug in the thread")
                return answer(self, req)

            monkeypatch.setattr(Session, "answer_off_loop", broken_answer)
            failing: Any = (os.open, mnt / "f", os.O_RDONLY)
            named = "on OPEN of inode 2"
        else:
            hand_on = Session._hand_on

            def broken_hand_on(self: Session, req: Any, buf: bytearray) -> bytearray:
                if in_thread():
                    raise RuntimeError("a bug in the thread")
                return hand_on(self, req, buf)

            monkeypatch.setattr(Session, "_hand_on", broken_hand_on)
            failing = (os.stat, mnt / "f7")  # a new name: its LOOKUP is the loop's
            named = f"on LOOKUP of inode {abi.ROOT_ID}"
        err = _bounded(*failing)
        assert isinstance(err, OSError) and err.errno == errno.EIO, err
        _wait_for(lambda: session.counters.thread_failures == 1)
        for i in range(5):  # answered by the loop, whatever the gaps between them
            assert (mnt / "f").read_bytes() == b"abc"
            assert stat.S_ISREG(os.stat(mnt / f"f{i + 10}").st_mode)
            time.sleep(2 * LOOP_IDLE)
        assert session.mode is ReadMode.LOOP
        assert session.counters.thread_failures == 1
        assert f"the FUSE request thread failed {named}" in caplog.text
        assert "a bug in the thread" in caplog.text


@contextmanager
def fusectl() -> Iterator[Path]:
    """/sys/fs/fuse/connections, mounted for the test if it is not."""
    where = Path("/sys/fs/fuse/connections")
    ours = not _is_mounted(where)
    if ours:
        proc = subprocess.run(["mount", "-t", "fusectl", "fusectl", str(where)], check=False)
        if proc.returncode != 0:
            pytest.skip("cannot mount fusectl")
    try:
        yield where
    finally:
        if ours:
            subprocess.run(["umount", str(where)], check=False, timeout=TIMEOUT)


def test_an_aborted_connection_ends_the_session_cleanly(tmp_path: Path) -> None:
    """`echo 1 > /sys/fs/fuse/connections/N/abort`, the way out of a hung
    mount: the reader gets ECONNABORTED, and the session ends as at unmount."""
    tiny = Tiny(b"abc")
    with served(tmp_path, tiny) as (mnt, session, token):
        assert (mnt / "f").read_bytes() == b"abc"
        with fusectl() as connections:
            (connections / str(os.minor(os.stat(mnt).st_dev)) / "abort").write_text("1")
        deadline = time.monotonic() + TIMEOUT
        while True:
            try:
                trio.from_thread.run_sync(lambda: None, trio_token=token)
            except trio.RunFinishedError:
                break  # session.run() returned, and trio.run with it
            assert time.monotonic() < deadline, "the session did not end after the abort"
            time.sleep(0.05)
        with pytest.raises(OSError) as err:
            (mnt / "f").read_bytes()
        assert err.value.errno == errno.ENOTCONN
