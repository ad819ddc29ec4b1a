"""ckptfs's own FUSE session (fs/fuse/session.py) on a real mount of a tiny
filesystem: the kernel protocol, fast paths answered inline, workers,
errors, buffers, and the ways a session ends."""

from __future__ import annotations

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
from children import next_line
from ckptfs.fs.fuse import abi
from ckptfs.fs.fuse import mount as fusemount
from ckptfs.fs.fuse.abi import Op
from ckptfs.fs.fuse.session import FuseError, Handlers, Request, Session
from ckptfs.fs.interrupts import interruptible
from mounts import is_mounted

TIMEOUT = 20
# Where a child finds this module and the helpers it imports.
SEARCH_PATH = (Path(__file__).parent, Path(__file__).parents[1] / "support")
DIRS = 1 << 40  # Tiny's inode numbers of directories start here


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
        # READs get a fast path; read-only opens are direct_io, so every
        # pread is a READ.
        self.fast_reads = False

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
        )

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
        if flags & os.O_ACCMODE:  # a writer: its handle is 2, released by a worker
            return abi.open_out(2, abi.FOPEN_DIRECT_IO)
        return abi.open_out(1, abi.FOPEN_NOFLUSH | (abi.FOPEN_DIRECT_IO * self.fast_reads))

    def read_now(self, req: Request) -> bytes:
        _, off, size, *_ = abi.READ_IN.unpack_from(req.body)
        return bytes(self.files[req.nodeid][off : off + size])

    def release_now(self, req: Request) -> bytes | None:
        (fh, *_) = abi.RELEASE_IN.unpack_from(req.body)
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
) -> Iterator[tuple[Path, Session, trio.lowlevel.TrioToken]]:
    mnt = tmp_path / "mnt"
    mnt.mkdir(exist_ok=True)
    fd = fusemount.mount(str(mnt), "tinyfs", {"default_permissions"})
    extra = {} if buffers is None else {"buffers": buffers}
    session = Session(fd, tiny.handlers(), workers=32, **extra)
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
        assert not is_mounted(mnt)
        assert not errors, errors  # the session ends without an exception


def test_a_mount_answers_inline_and_through_workers(tmp_path: Path) -> None:
    data = os.urandom(3 << 20)
    tiny = Tiny(data)
    with served(tmp_path, tiny) as (mnt, session, _):
        assert is_mounted(mnt)
        assert stat.S_ISDIR(os.stat(mnt).st_mode)
        assert (mnt / "f").read_bytes() == data  # LOOKUP, GETATTR, READs on the loop
        with pytest.raises(FileNotFoundError):
            os.stat(mnt / "missing")
        fd = os.open(mnt / "f", os.O_RDONLY)
        try:  # Python's isatty: answered inline, ENOTTY
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
        assert tiny.fast_opens >= 2 and c.fast >= 2 and c.stateless >= 2 and c.handled >= 4


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
        assert c.fast >= 100  # the opens and stats took no task


def test_writes_held_by_their_handlers_do_not_stop_the_reading(tmp_path: Path) -> None:
    """More large WRITEs waiting in their handlers (as writers in backpressure
    do) than read buffers: the reader copies the next ones out and reads on,
    so a stat is still answered; every byte lands where it was written.
    (Four files: the kernel sends one file's direct writes one at a time.)"""
    tiny = Tiny(b"")
    chunk = 8 << 20
    blobs = [os.urandom(chunk) for _ in range(4)]
    with served(tmp_path, tiny, buffers=2) as (mnt, session, token):
        release = trio.Event()
        tiny.hold = release
        written: list[int | BaseException] = []
        threads = [
            threading.Thread(target=_pwrite, args=(mnt / f"f{i + 1}", blobs[i], written))
            for i in range(4)
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
    assert written == [chunk] * 4, written
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
            assert next_line(writer) == "writing"
            deadline = time.monotonic() + TIMEOUT
            while tiny.writes_in_flight < 1 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert tiny.writes_in_flight == 1
            writer.send_signal(sig)
            c = session.counters
            if interruptible_wait and sig == signal.SIGINT:
                assert next_line(writer) == "interrupted"
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
                assert next_line(writer) == "interrupted"
                assert (c.interrupts, c.signals_ignored) == (1, 0)  # marked, never acted on
            else:
                assert next_line(writer) == "SIGUSR1 handled"
                assert next_line(writer) == "wrote 4096"
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


def _pwrite(path: Path, data: bytes, written: list[int | BaseException]) -> None:
    """pwrite ``data`` at 0; what it returned, or raised, is appended to
    ``written`` (an assert in a thread could not fail the test)."""
    try:
        fd = os.open(path, os.O_WRONLY)  # direct_io: 1 MiB requests
        try:
            written.append(os.pwrite(fd, data, 0))
        finally:
            os.close(fd)
    except BaseException as exc:  # noqa: BLE001 - checked by the test
        written.append(exc)


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
    assert not is_mounted(mnt)


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
        if is_mounted(home / "mnt"):
            fusemount.unmount(str(home / "mnt"))
        shutil.rmtree(home, ignore_errors=True)


def _mount_as_nobody(mnt: Path) -> None:
    code = textwrap.dedent(
        """
        import os, sys, threading, trio
        sys.path[:0] = sys.argv[2:]
        from test_fusesession import Tiny
        from ckptfs.fs.fuse import mount as fusemount
        from ckptfs.fs.fuse.session import Session
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
        [sys.executable, "-c", code, str(mnt), *(str(p) for p in SEARCH_PATH)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["as", "nobody", "True"]
    assert not is_mounted(mnt)


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
        assert is_mounted(mnt)


@contextmanager
def fusectl() -> Iterator[Path]:
    """/sys/fs/fuse/connections, mounted for the test if it is not."""
    where = Path("/sys/fs/fuse/connections")
    ours = not is_mounted(where)
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
