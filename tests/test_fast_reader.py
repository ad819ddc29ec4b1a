"""The request thread's compiled reader (fs/_fastreader.c) and its open
tickets.

Three layers: the reader alone, on a SOCK_SEQPACKET socket pair standing in
for /dev/fuse (one message per request, as /dev/fuse reads); the tickets the
filesystem issues, which must never say yes where ``open_now`` says no, and
whose handles must be exactly what ``open_now`` makes; and real mounts, where
torch.load's opens and isatty go through it while files are rewritten,
replaced and removed."""

from __future__ import annotations

import errno
import gc
import os
import random
import socket
import stat
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from ckptfs.fs import _fastreader, fusesession
from ckptfs.fs import fuseabi as abi
from ckptfs.fs.filesystem import DIR_ATTR_REUSE, Attr, check_identity
from ckptfs.fs.fuseabi import Op
from ckptfs.fs.inodes import ROOT
from ckptfs.fs.manifest import ParsedManifests
from conftest import wait_for
from lifecycle_harness import Harness
from test_fast_paths import inline, tables
from test_getattr import CALLER, close, opened, rewrite_elsewhere

KEEP = abi.FOPEN_KEEP_CACHE | abi.FOPEN_NOFLUSH
BUF = bytearray(1 << 16)


def request(op: int, unique: int, nodeid: int, body: bytes = b"", ids=(1000, 1000, 4242)) -> bytes:
    uid, gid, pid = ids
    size = abi.IN_HEADER.size + len(body)
    return abi.IN_HEADER.pack(size, op, unique, nodeid, uid, gid, pid, 0, 0) + body


def open_request(unique: int, ino: int, flags: int = os.O_RDONLY) -> bytes:
    return request(Op.OPEN, unique, ino, abi.OPEN_IN.pack(flags, 0))


class Rig:
    """A reader over one end of a socket pair; the test is the kernel."""

    def __init__(self) -> None:
        self.kernel, self.daemon = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.daemon.setblocking(False)
        self.kernel.setblocking(False)
        self.wake_r, self.wake_w = os.pipe()
        self.lock = threading.Lock()
        self.holds = SimpleNamespace(loop_waits=False)
        self.reader = _fastreader.Reader(self.daemon.fileno(), self.wake_r, self.lock, self.holds)

    def send(self, *requests: bytes) -> None:
        for r in requests:
            self.kernel.send(r)

    def replies(self) -> list[bytes]:
        out = []
        while True:
            try:
                out.append(self.kernel.recv(1 << 16))
            except BlockingIOError:
                return out

    def close(self) -> None:
        self.kernel.close()
        self.daemon.close()
        os.close(self.wake_r)
        os.close(self.wake_w)


@pytest.fixture
def rig() -> Iterator[Rig]:
    r = Rig()
    yield r
    r.close()


def test_isatty_gets_enotty_from_the_reader(rig: Rig) -> None:
    rig.send(request(Op.IOCTL, 7, 5, b"\0" * 32))
    assert rig.reader.serve(BUF, 1000) == _fastreader.ANSWERED
    assert rig.replies() == [abi.OUT_HEADER.pack(16, -errno.ENOTTY, 7)]
    assert (rig.reader.ioctls, rig.reader.opens) == (1, 0)


def test_a_ticketed_read_only_open_is_answered_and_its_handle_queued(rig: Rig) -> None:
    r = rig.reader
    r.issue(5, time.monotonic() + 60, KEEP, KEEP)
    rig.send(open_request(11, 5), open_request(12, 5, os.O_RDONLY | os.O_NONBLOCK))
    assert r.serve(BUF, 1000) == _fastreader.ANSWERED  # both, in one call
    first, second = _fastreader.FIRST_FH, _fastreader.FIRST_FH + 1
    header = abi.OUT_HEADER.size + abi.OPEN_OUT.size
    assert rig.replies() == [
        abi.OUT_HEADER.pack(header, 0, 11) + abi.OPEN_OUT.pack(first, KEEP, 0),
        abi.OUT_HEADER.pack(header, 0, 12) + abi.OPEN_OUT.pack(second, KEEP, 0),
    ]
    assert r.pending == 2
    assert r.drain() == [(first, 5, 1000, 1000, 4242, 0.0), (second, 5, 1000, 1000, 4242, 0.0)]
    assert r.pending == 0 and r.drain() == []
    assert not rig.lock.locked()  # taken for each open, and let go
    assert r.opens == 2


def test_a_tickets_first_open_may_differ_from_the_next(rig: Rig) -> None:
    """The first compiled open of a ticket makes the kernel's pages the
    file's (FileSystem._kernel_may_keep): the ones after it may keep them."""
    r = rig.reader
    r.issue(5, time.monotonic() + 60, abi.FOPEN_NOFLUSH, KEEP)
    rig.send(open_request(13, 5), open_request(14, 5), open_request(15, 5))
    assert r.serve(BUF, 1000) == _fastreader.ANSWERED
    flags = [abi.OPEN_OUT.unpack_from(x, abi.OUT_HEADER.size)[1] for x in rig.replies()]
    assert flags == [abi.FOPEN_NOFLUSH, KEEP, KEEP]


def test_a_python_error_in_the_open_leaves_it_to_python(rig: Rig, monkeypatch: Any) -> None:
    """The open was read already: it must get an answer, from Python's path,
    with the state lock let go and the error reported."""

    class Broken:
        @property
        def loop_waits(self) -> bool:
            raise ValueError("a bug")

    reported: list[Any] = []
    monkeypatch.setattr("sys.unraisablehook", reported.append)
    reader = _fastreader.Reader(rig.daemon.fileno(), rig.wake_r, rig.lock, Broken())
    reader.issue(5, time.monotonic() + 60, KEEP, KEEP)
    req = open_request(16, 5)
    rig.send(req)
    n = reader.serve(BUF, 1000)
    assert n == len(req) and bytes(BUF[:n]) == req
    assert rig.replies() == [] and not rig.lock.locked() and reader.pending == 0
    assert [type(u.exc_value) for u in reported] == [ValueError]


def test_past_its_deadline_a_ticket_is_checked_against_its_manifest(
    rig: Rig, tmp_path: Path
) -> None:
    """Close-to-open: once the last check is older than fuse.open_recheck,
    the reader stats the manifest itself (a local store) and answers only if
    it is the very file that check read; the ticket then lasts recheck from
    that check, and the handle carries when it began."""
    store = tmp_path / "store"
    store.mkdir()
    (store / "a.pt").write_bytes(b"manifest one")
    root = os.open(store, os.O_RDONLY | os.O_DIRECTORY)
    try:
        r = rig.reader
        r.checks_in(root)
        identity = ParsedManifests.identity(os.stat(store / "a.pt"))
        r.issue(5, time.monotonic() - 1, KEEP, KEEP, "a.pt", identity, 60.0)
        before = time.monotonic()
        rig.send(open_request(71, 5), open_request(72, 5))
        assert r.serve(BUF, 1000) == _fastreader.ANSWERED
        assert len(rig.replies()) == 2
        assert r.checks == 1  # the second open is within the check's recheck
        (first, second) = r.drain()
        assert first[5] >= before and second[5] == 0.0
        # Rewritten since (another node's new version): Python's check says.
        (store / "a.tmp").write_bytes(b"manifest two")
        os.replace(store / "a.tmp", store / "a.pt")
        r.issue(5, time.monotonic() - 1, KEEP, KEEP, "a.pt", identity, 60.0)
        req = open_request(73, 5)
        rig.send(req)
        assert r.serve(BUF, 1000) == len(req) and rig.replies() == []
        assert r.checks == 2
        # Gone, or a ticket without a manifest: Python's too.
        os.unlink(store / "a.pt")
        r.issue(5, time.monotonic() - 1, KEEP, KEEP, "a.pt", identity, 60.0)
        rig.send(req)
        assert r.serve(BUF, 1000) == len(req)
        r.issue(5, time.monotonic() - 1, KEEP, KEEP)
        rig.send(req)
        assert r.serve(BUF, 1000) == len(req)
        assert rig.replies() == [] and r.drain() == []
    finally:
        os.close(root)


def test_without_a_local_store_a_ticket_past_its_deadline_is_pythons(rig: Rig) -> None:
    r = rig.reader  # no checks_in: the store may be NFS, whose stat may hang
    r.issue(5, time.monotonic() - 1, KEEP, KEEP, "a.pt", (1, 2, 3, 4, 5), 60.0)
    req = open_request(74, 5)
    rig.send(req)
    assert r.serve(BUF, 1000) == len(req) and r.checks == 0


def _no_ticket(rig: Rig) -> None:
    pass


def _expired(rig: Rig) -> None:
    rig.reader.issue(5, time.monotonic() - 0.001, KEEP, KEEP)


def _lapsed(rig: Rig) -> None:
    rig.reader.issue(5, time.monotonic() + 60, KEEP, KEEP)
    rig.reader.invalidate()  # the loop took the state lock back


def _withdrawn(rig: Rig) -> None:
    rig.reader.issue(5, time.monotonic() + 60, KEEP, KEEP)
    rig.reader.withdraw(5)


def _another_inode_in_its_slot(rig: Rig) -> None:
    rig.reader.issue(5 + 256, time.monotonic() + 60, KEEP, KEEP)  # evicts nothing of 5's


def _state_taken(rig: Rig) -> None:
    rig.reader.issue(5, time.monotonic() + 60, KEEP, KEEP)
    rig.lock.acquire()  # the loop runs


def _loop_waits(rig: Rig) -> None:
    rig.reader.issue(5, time.monotonic() + 60, KEEP, KEEP)
    rig.holds.loop_waits = True


@pytest.mark.parametrize(
    "flags", [os.O_RDONLY, os.O_WRONLY, os.O_RDWR, os.O_RDONLY | os.O_TRUNC], ids=str
)
@pytest.mark.parametrize(
    "setup",
    [
        _no_ticket,
        _expired,
        _lapsed,
        _withdrawn,
        _another_inode_in_its_slot,
        _state_taken,
        _loop_waits,
    ],
)
def test_an_open_no_ticket_covers_is_handed_to_python_untouched(
    rig: Rig, setup: Any, flags: int
) -> None:
    if setup is _no_ticket or flags == os.O_RDONLY:
        setup(rig)
    else:  # a valid ticket: the flags alone make it Python's
        rig.reader.issue(5, time.monotonic() + 60, KEEP, KEEP)
    req = open_request(21, 5, flags)
    rig.send(req)
    n = rig.reader.serve(BUF, 1000)
    assert n == len(req) and bytes(BUF[:n]) == req
    assert rig.replies() == []
    assert rig.reader.drain() == [] and rig.reader.opens == 0


def test_answers_before_a_request_for_python_are_kept(rig: Rig) -> None:
    r = rig.reader
    r.issue(5, time.monotonic() + 60, KEEP, KEEP)
    lookup = request(Op.LOOKUP, 33, ROOT, b"x.pt\0")
    rig.send(open_request(31, 5), request(Op.IOCTL, 32, 5, b"\0" * 32), lookup)
    n = r.serve(BUF, 1000)
    assert bytes(BUF[:n]) == lookup
    assert [abi.OUT_HEADER.unpack_from(x)[2] for x in rig.replies()] == [31, 32]
    assert (r.opens, r.ioctls, r.pending) == (1, 1, 1)


def test_the_wait_ends_on_its_timeout_or_when_woken(rig: Rig) -> None:
    start = time.monotonic()
    assert rig.reader.serve(BUF, 50) == _fastreader.TIMED_OUT
    assert time.monotonic() - start >= 0.045
    os.write(rig.wake_w, b"x")
    assert rig.reader.serve(BUF, -1) == _fastreader.WOKEN


def test_a_reply_the_kernel_refuses_is_counted_not_raised(rig: Rig) -> None:
    rig.send(request(Op.IOCTL, 41, 5))
    rig.kernel.shutdown(socket.SHUT_RD)  # replies now fail with EPIPE
    assert rig.reader.serve(BUF, 1000) == _fastreader.ANSWERED
    assert rig.reader.write_errors == 1


# ----- GETATTR and LOOKUP from attr and entry tickets ----------------------------------------


def _attr(ino: int, mode: int = stat.S_IFREG | 0o644, size: int = 1000) -> Attr:
    return Attr(ino, mode, size, 1, 1000, 1000, 11, 22, 33, 4096)


def _dir_identity(path: Path) -> tuple[int, ...]:
    return check_identity(os.stat(path), directory=True)


def _file_identity(path: Path) -> tuple[int, ...]:
    return check_identity(os.stat(path), directory=False)


@pytest.fixture
def store(rig: Rig, tmp_path: Path) -> Iterator[Path]:
    """A local store with a directory and a manifest, for the reader's checks."""
    root = tmp_path / "store"
    (root / "run").mkdir(parents=True)
    (root / "run" / "a.pt").write_bytes(b"manifest one")
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    rig.reader.checks_in(fd)
    yield root
    os.close(fd)


def _answered(rig: Rig, unique: int, body: bytes) -> None:
    assert rig.replies() == [abi.OUT_HEADER.pack(16 + len(body), 0, unique) + body]


def getattr_request(unique: int, ino: int) -> bytes:
    return request(Op.GETATTR, unique, ino, b"\0" * 16)  # fuse_getattr_in: flags, fh


def lookup_request(unique: int, parent: int, name: bytes) -> bytes:
    return request(Op.LOOKUP, unique, parent, name + b"\0")


def test_a_getattr_is_answered_from_its_ticket_until_the_deadline(rig: Rig) -> None:
    r = rig.reader
    reply = abi.attr_out(_attr(5), 1.0)
    r.issue_attr(5, time.monotonic() + 60, reply, 0.5)
    rig.send(getattr_request(81, 5), getattr_request(82, 5))
    assert r.serve(BUF, 1000) == _fastreader.ANSWERED
    assert rig.replies() == [abi.OUT_HEADER.pack(16 + len(reply), 0, u) + reply for u in (81, 82)]
    # No check made, no kernel reference taken: nothing for the filesystem.
    assert (r.getattrs, r.checks, r.pending, r.drain_seen()) == (2, 0, 0, [])


def test_past_its_deadline_a_getattr_is_answered_after_a_stat_that_finds_the_same(
    rig: Rig, store: Path
) -> None:
    """A directory's attributes: the same identity, every field they show
    included; then the ticket lasts recheck from that check, and the
    filesystem learns of it."""
    r = rig.reader
    reply = abi.attr_out(_attr(3, stat.S_IFDIR | 0o755), 1.0)
    r.issue_attr(3, time.monotonic() - 1, reply, 60.0, "run", _dir_identity(store / "run"), True)
    before = time.monotonic()
    rig.send(getattr_request(83, 3), getattr_request(84, 3))
    assert r.serve(BUF, 1000) == _fastreader.ANSWERED
    assert len(rig.replies()) == 2 and r.checks == 1  # the second within the recheck
    ((ino, lookup, checked_at),) = r.drain_seen()
    assert (ino, lookup) == (3, False) and checked_at >= before
    req = getattr_request(85, 3)
    # A mode changed (its ctime may stay within one tick of the clock): Python's.
    st = os.stat(store / "run")
    changed = list(check_identity(st, True))
    changed[7] ^= 0o070  # (dev, ino, size, mtime, ctime, atime, nlink, mode, uid, gid)
    r.issue_attr(3, time.monotonic() - 1, reply, 60.0, "run", tuple(changed), True)
    rig.send(req)
    assert r.serve(BUF, 1000) == len(req) and rig.replies() == []
    # A file's ticket where a directory is now (or the reverse): Python's.
    as_file = _dir_identity(store / "run")[:5]
    r.issue_attr(3, time.monotonic() - 1, reply, 60.0, "run", as_file, False)
    rig.send(req)
    assert r.serve(BUF, 1000) == len(req)
    # Without a path to check, past the deadline: Python's.
    r.issue_attr(3, time.monotonic() - 1, reply, 60.0)
    rig.send(req)
    assert r.serve(BUF, 1000) == len(req) and rig.replies() == [] and r.drain_seen() == []
    # Its atime moved (a readdir in the store; no other field): its attributes did too.
    r.issue_attr(3, time.monotonic() - 1, reply, 60.0, "run", _dir_identity(store / "run"), True)
    os.listdir(store / "run")
    after = os.stat(store / "run")
    if after.st_atime_ns == st.st_atime_ns:
        pytest.skip("the store's filesystem does not update atime on a readdir")
    assert after.st_ctime_ns == st.st_ctime_ns  # only the atime
    rig.send(req)
    assert r.serve(BUF, 1000) == len(req) and rig.replies() == []


def _entry_slot(parent: int, name: bytes) -> int:
    """fs/_fastreader.c's slot of an entry ticket (FNV-1a), to find a collision."""
    h = 1469598103934665603 ^ parent
    for byte in name:
        h = ((h ^ byte) * 1099511628211) % (1 << 64)
    return h % 256


def test_a_lookup_is_answered_from_its_entry_ticket_after_a_stat_that_finds_the_same(
    rig: Rig, store: Path
) -> None:
    r = rig.reader
    reply = abi.entry_out(_attr(7), 1.0)
    identity = _file_identity(store / "run" / "a.pt")
    r.issue_entry(3, b"a.pt", 7, reply, "run/a.pt", identity, False)
    before = time.monotonic()
    rig.send(lookup_request(91, 3, b"a.pt"), lookup_request(92, 3, b"a.pt"))
    assert r.serve(BUF, 1000) == _fastreader.ANSWERED
    assert rig.replies() == [abi.OUT_HEADER.pack(16 + len(reply), 0, u) + reply for u in (91, 92)]
    assert (r.lookups, r.checks) == (2, 2)  # a lookup looks at the store each time
    seen = r.drain_seen()
    assert [(ino, lookup) for ino, lookup, _ in seen] == [(7, True), (7, True)]
    assert all(at >= before for _, _, at in seen)
    # Another name, another parent, a name in the same slot: Python's.
    same_slot = next(
        name
        for i in range(100_000)
        if (name := f"x{i}.pt".encode()) and _entry_slot(3, name) == _entry_slot(3, b"a.pt")
    )
    for req in (
        lookup_request(93, 3, b"b.pt"),
        lookup_request(94, 4, b"a.pt"),
        lookup_request(95, 3, same_slot),
    ):
        rig.send(req)
        assert r.serve(BUF, 1000) == len(req) and bytes(BUF[: len(req)]) == req
    # Replaced in the store (another node's new version): Python's check says.
    (store / "run" / "a.tmp").write_bytes(b"manifest two")
    os.replace(store / "run" / "a.tmp", store / "run" / "a.pt")
    req = lookup_request(96, 3, b"a.pt")
    rig.send(req)
    assert r.serve(BUF, 1000) == len(req)
    assert rig.replies() == [] and r.drain_seen() == [] and r.lookups == 2


@pytest.mark.parametrize(
    "how", ["covered", "lapsed", "withdrawn", "state taken", "loop waits", "no store"]
)
def test_a_lookup_or_getattr_no_ticket_covers_is_pythons(
    rig: Rig, tmp_path: Path, how: str
) -> None:
    r = rig.reader
    (tmp_path / "a.pt").write_bytes(b"m")
    root = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        if how != "no store":
            r.checks_in(root)
        identity = _file_identity(tmp_path / "a.pt")
        r.issue_entry(ROOT, b"a.pt", 7, abi.entry_out(_attr(7), 1.0), "a.pt", identity, False)
        r.issue_attr(7, time.monotonic() - 1, abi.attr_out(_attr(7), 1.0), 9.0, "a.pt", identity)
        if how == "lapsed":
            r.invalidate()
        elif how == "withdrawn":
            r.withdraw_entry(ROOT, b"a.pt")
            r.withdraw(7)
        elif how == "state taken":
            rig.lock.acquire()
        elif how == "loop waits":
            rig.holds.loop_waits = True
        if how == "covered":  # the control: these very tickets answer
            rig.send(lookup_request(97, ROOT, b"a.pt"), getattr_request(98, 7))
            assert r.serve(BUF, 1000) == _fastreader.ANSWERED
            assert len(rig.replies()) == 2 and (r.lookups, r.getattrs) == (1, 1)
            return
        for req in (lookup_request(97, ROOT, b"a.pt"), getattr_request(98, 7)):
            rig.send(req)
            assert r.serve(BUF, 1000) == len(req) and bytes(BUF[: len(req)]) == req
        assert rig.replies() == [] and r.pending == 0
        assert (r.lookups, r.getattrs) == (0, 0)
    finally:
        os.close(root)


def test_tickets_it_cannot_keep_are_refused(rig: Rig, store: Path) -> None:
    r = rig.reader
    reply = abi.entry_out(_attr(7), 1.0)
    identity = _file_identity(store / "run" / "a.pt")
    # Valid tickets first: a refused issue over them leaves nothing that answers.
    r.issue_entry(1, b"a.pt", 7, reply, "run/a.pt", identity, False)
    r.issue_attr(7, time.monotonic() + 60, abi.attr_out(_attr(7), 1.0), 1.0)
    with pytest.raises(ValueError):
        r.issue_entry(1, b"a\0b", 7, reply, "a", (1, 2, 3, 4, 5), False)
    with pytest.raises(ValueError):
        r.issue_entry(1, b"x" * 256, 7, reply, "a", (1, 2, 3, 4, 5), False)
    with pytest.raises(ValueError):
        r.issue_entry(1, b"a.pt", 7, reply[:-1], "a.pt", (1, 2, 3, 4, 5), False)
    with pytest.raises(TypeError):
        r.issue_entry(1, b"a.pt", 7, reply, None, identity, False)  # a lookup is always checked
    with pytest.raises(ValueError):
        r.issue_attr(7, 0.0, reply, 1.0)  # an entry's reply is no attr reply
    with pytest.raises(TypeError):
        r.issue_attr(7, 0.0, abi.attr_out(_attr(7), 1.0), 1.0, "d", (1, 2, 3, 4, 5), True)
    # Nothing half-issued answers.
    for req in (lookup_request(99, 1, b"a.pt"), getattr_request(100, 7)):
        rig.send(req)
        assert r.serve(BUF, 1000) == len(req)
    assert rig.replies() == [] and (r.lookups, r.getattrs) == (0, 0)


def _holds(rig: Rig, adopted: list[Any], seen: list[Any] | None = None) -> Any:
    """The session's lock protocol (fusesession._LoopHoldsState) over the
    rig's reader, as Session._start_compiled wires it; the loop holds the lock."""
    holds = fusesession._LoopHoldsState(rig.lock)
    holds.adopt = adopted.extend
    holds.adopt_seen = (seen if seen is not None else []).extend
    rig.reader = _fastreader.Reader(rig.daemon.fileno(), rig.wake_r, rig.lock, holds)
    holds.fast = rig.reader
    rig.lock.acquire()
    return holds


def test_the_loops_turn_lapses_every_ticket_and_adopts_first(rig: Rig) -> None:
    adopted: list[Any] = []
    holds = _holds(rig, adopted)
    holds.before_io_wait(0)  # the loop waits for I/O: the thread may take the lock
    rig.reader.issue(5, time.monotonic() + 60, KEEP, KEEP)
    rig.send(open_request(51, 5))
    assert rig.reader.serve(BUF, 1000) == _fastreader.ANSWERED
    assert adopted == []
    holds.after_io_wait(0)  # the loop's turn: it may change anything now
    assert [o[1] for o in adopted] == [5] and rig.reader.pending == 0
    holds.before_io_wait(0)
    req = open_request(52, 5)
    rig.send(req)
    assert rig.reader.serve(BUF, 1000) == len(req)  # the ticket lapsed: Python's
    rig.replies()


def test_the_threads_python_adopts_before_it_reads_any_state(rig: Rig) -> None:
    adopted: list[Any] = []
    holds = _holds(rig, adopted)
    holds.before_io_wait(0)
    rig.reader.issue(5, time.monotonic() + 60, KEEP, KEEP)
    rig.send(open_request(61, 5), open_request(62, 5))
    assert rig.reader.serve(BUF, 1000) == _fastreader.ANSWERED
    assert holds.try_take()  # the request thread's Python, for its next request
    assert [o[0] for o in adopted] == [_fastreader.FIRST_FH, _fastreader.FIRST_FH + 1]
    rig.lock.release()
    # Its Python tickets stay: only the loop's turn lapses them.
    rig.send(open_request(63, 5))
    assert rig.reader.serve(BUF, 1000) == _fastreader.ANSWERED
    holds.after_io_wait(0)


def test_lookups_and_checks_answered_in_c_are_adopted_before_any_state_is_read(
    rig: Rig, tmp_path: Path
) -> None:
    """A LOOKUP answered by the reader is a kernel reference the filesystem
    must count before a FORGET of it can be handled: whoever takes the lock
    next (the loop's turn, the thread's Python) adopts it first."""
    adopted: list[Any] = []
    seen: list[Any] = []
    holds = _holds(rig, adopted, seen)
    (tmp_path / "a.pt").write_bytes(b"m")
    root = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        rig.reader.checks_in(root)
        holds.before_io_wait(0)
        identity = _file_identity(tmp_path / "a.pt")
        rig.reader.issue_entry(
            ROOT, b"a.pt", 7, abi.entry_out(_attr(7), 1.0), "a.pt", identity, False
        )
        rig.send(lookup_request(101, ROOT, b"a.pt"))
        assert rig.reader.serve(BUF, 1000) == _fastreader.ANSWERED
        assert holds.try_take()  # the thread's Python
        assert [(ino, lookup) for ino, lookup, _ in seen] == [(7, True)]
        rig.lock.release()
        rig.send(lookup_request(102, ROOT, b"a.pt"))  # its tickets stay for the thread
        assert rig.reader.serve(BUF, 1000) == _fastreader.ANSWERED
        holds.after_io_wait(0)  # the loop's turn: adopts, then lapses every ticket
        assert [(ino, lookup) for ino, lookup, _ in seen] == [(7, True), (7, True)]
        holds.before_io_wait(0)
        req = lookup_request(103, ROOT, b"a.pt")
        rig.send(req)
        assert rig.reader.serve(BUF, 1000) == len(req)
        holds.after_io_wait(0)
        assert rig.replies() and rig.reader.pending == 0 and adopted == []
    finally:
        os.close(root)


# ----- the tickets the filesystem issues -------------------------------------------------------


def test_a_ticket_is_issued_exactly_where_open_now_opens(h: Harness, monkeypatch: Any) -> None:
    fs = h.core.fs
    ino, fh = opened(h, "a.pt")  # its lookup checked the manifest just now
    close(h, fh)
    ticket = inline(h, fs.open_ticket, ino)
    assert ticket is not None
    assert ticket.keep and ticket.keep_later
    assert ticket.deadline == fs.inodes[ino].checked_at + fs.config.open_recheck
    # The manifest that check read, for the reader's own check after the deadline.
    assert ticket.manifest == "a.pt"
    assert ticket.identity == ParsedManifests.identity(os.stat(h.backing / "a.pt"))
    got = inline(h, fs.open_now, ino, os.O_RDONLY, CALLER)
    assert got is not None and got[1] == ticket.keep
    inline(h, fs.release_now, got[0])
    # Where open_now declines, no ticket: a directory, an unknown inode, a
    # check older than fuse.open_recheck (close-to-open reads the manifest).
    assert inline(h, fs.open_ticket, ROOT) is None
    assert inline(h, fs.open_ticket, 999_999) is None
    monkeypatch.setattr(fs.config, "open_recheck", 0.0)
    assert inline(h, fs.open_now, ino, os.O_RDONLY, CALLER) is None
    assert inline(h, fs.open_ticket, ino) is None


def test_a_ticket_lasts_no_longer_than_the_check_it_rests_on(h: Harness) -> None:
    fs = h.core.fs
    ino, fh = opened(h, "b.pt")
    close(h, fh)
    deadline = inline(h, fs.open_ticket, ino).deadline
    time.sleep(max(0.0, deadline - time.monotonic()) + 0.01)
    assert inline(h, fs.open_now, ino, os.O_RDONLY, CALLER) is None
    assert inline(h, fs.open_ticket, ino) is None
    # Another node's new version: the check that finds it issues no ticket.
    rewrite_elsewhere(h, "b.pt", random.randbytes(1000))
    h.call(fs.lookup, ROOT, "b.pt")
    assert inline(h, fs.open_ticket, ino) is None


def test_no_ticket_while_a_rename_is_in_flight(h: Harness) -> None:
    fs = h.core.fs
    ino, fh = opened(h, "c.pt")
    close(h, fh)
    assert inline(h, fs.open_ticket, ino) is not None
    with fs.ns_lock.replacing("/elsewhere.pt"):  # any rename: the ticket names no path
        assert inline(h, fs.open_ticket, ino) is None
    assert inline(h, fs.open_ticket, ino) is not None


def test_a_file_written_here_gets_a_ticket_without_keeping_pages(h: Harness) -> None:
    fs = h.core.fs
    fh_w, attr = h.call(fs.create, ROOT, "w.pt", 0o644, os.O_WRONLY | os.O_CREAT, CALLER)
    h.call(fs.write, fh_w, 0, b"x" * 100)
    ticket = inline(h, fs.open_ticket, attr.ino)
    assert (ticket.deadline, ticket.keep, ticket.keep_later) == (float("inf"), False, False)
    assert ticket.manifest is None  # our copy is the current one: nothing to check
    got = inline(h, fs.open_now, attr.ino, os.O_RDONLY, CALLER)
    assert got is not None and got[1] is False
    inline(h, fs.release_now, got[0])
    close(h, fh_w)


def test_an_unlinked_inode_gets_no_ticket(h: Harness) -> None:
    fs = h.core.fs
    ino, fh = opened(h, "d.pt")
    h.call(fs.unlink, ROOT, "d.pt")
    assert inline(h, fs.open_ticket, ino) is None
    close(h, fh)


def test_an_adopted_handle_is_what_open_now_makes(h: Harness) -> None:
    fs = h.core.fs
    ino, fh = opened(h, "e.pt")
    close(h, fh)
    before = tables(h)
    fh_now, _ = inline(h, fs.open_now, ino, os.O_RDONLY, CALLER)
    by_open_now = tables(h)
    inline(h, fs.release_now, fh_now)
    assert tables(h) == before
    adopted = _fastreader.FIRST_FH + 7
    inline(h, fs.adopt_open, adopted, ino, CALLER)
    handles, inodes, files = tables(h)
    want_handles, want_inodes, want_files = by_open_now
    assert (inodes, files) == (want_inodes, want_files)
    assert handles[adopted] == want_handles[fh_now]
    assert inline(h, fs.release_now, adopted) is True
    assert tables(h) == before


def test_an_attr_ticket_says_what_getattr_now_answers(h: Harness, monkeypatch: Any) -> None:
    fs = h.core.fs
    ino, fh = opened(h, "f.pt")
    close(h, fh)
    ticket = inline(h, fs.attr_ticket, ino)
    assert ticket.attr == inline(h, fs.getattr_now, ino)
    assert ticket.deadline == fs.inodes[ino].checked_at + fs.config.open_recheck
    assert (ticket.path, ticket.directory, ticket.recheck) == (
        "f.pt",
        False,
        fs.config.open_recheck,
    )
    assert ticket.identity == ParsedManifests.identity(os.stat(h.backing / "f.pt"))
    # The root directory, after a getattr that read its attributes.
    h.call(fs.getattr, ROOT)
    root = inline(h, fs.attr_ticket, ROOT)
    assert root.attr == inline(h, fs.getattr_now, ROOT)
    assert (root.path, root.directory) == (".", True)
    assert root.identity == check_identity(os.stat(h.backing), directory=True)
    assert root.deadline == fs.inodes[ROOT].dir_attrs_at + DIR_ATTR_REUSE
    # A name added or removed here moves them: neither reuses that look.
    h.call(fs.mkdir, ROOT, "new", 0o755, CALLER)
    assert inline(h, fs.getattr_now, ROOT) is None
    assert inline(h, fs.attr_ticket, ROOT).deadline < time.monotonic()
    # After a check finding the same entry, getattr answers the same.
    time.sleep(max(0.0, ticket.deadline - time.monotonic()) + 0.01)
    assert inline(h, fs.getattr_now, ino) is None
    assert h.call(fs.getattr, ino) == ticket.attr
    # None where getattr's answer is not the last look's: being written
    # here, an unknown inode.
    fh_w, attr = h.call(fs.create, ROOT, "w.pt", 0o644, os.O_WRONLY | os.O_CREAT, CALLER)
    assert inline(h, fs.attr_ticket, attr.ino) is None
    close(h, fh_w)
    assert inline(h, fs.attr_ticket, 999_999) is None


def test_a_look_that_began_before_a_name_changed_here_is_not_reused(h: Harness) -> None:
    """The request thread reads a directory's attributes with the lock let
    go; a mkdir in it runs meanwhile on the loop; the thread's answer then
    stands (the kernel's request came before), but neither a getattr nor an
    attr ticket reuses what it read."""
    fs = h.core.fs
    plan = inline(h, fs.getattr_check_wanted, ROOT)
    before = fs.backing.entry_here(plan.path)
    h.call(fs.mkdir, ROOT, "made", 0o755, CALLER)
    assert inline(h, fs.getattr_checked, plan, before) is not None
    assert inline(h, fs.getattr_now, ROOT) is None
    assert inline(h, fs.attr_ticket, ROOT).deadline < time.monotonic()
    # A look after it is reused again.
    h.call(fs.getattr, ROOT)
    assert inline(h, fs.getattr_now, ROOT).nlink == os.stat(h.backing).st_nlink


def test_an_entry_ticket_says_what_a_checked_lookup_answers(h: Harness) -> None:
    fs = h.core.fs
    ino, fh = opened(h, "g.pt")
    close(h, fh)
    h.call(fs.mkdir, ROOT, "run", 0o755, CALLER)

    def checked_lookup(name: str) -> Any:
        plan = inline(h, fs.lookup_check_wanted, ROOT, name)
        return inline(h, fs.lookup_checked, ROOT, name, plan, fs.backing.entry_here(plan.path))

    for name, directory in (("g.pt", False), ("run", True)):
        answer = checked_lookup(name)
        ticket = inline(h, fs.entry_ticket, ROOT, name)
        assert (ticket.child, ticket.attr) == (answer.ino, answer)
        assert (ticket.path, ticket.directory) == (name, directory)
        assert ticket.identity == check_identity(os.stat(h.backing / name), directory)
        assert checked_lookup(name) == ticket.attr  # the same entry found again
    with fs.ns_lock.replacing("/elsewhere.pt"):  # a rename in flight: no ticket
        assert inline(h, fs.entry_ticket, ROOT, "g.pt") is None
    assert inline(h, fs.entry_ticket, ROOT, "nothing.pt") is None
    # Another node's new version: the look that finds it issues none for ours.
    rewrite_elsewhere(h, "g.pt", random.randbytes(1000))
    assert checked_lookup("g.pt") is None
    # Its ticket, if the thread issued one now, is for the entry it last found,
    # which the reader's stat no longer finds.
    stale = inline(h, fs.entry_ticket, ROOT, "g.pt")
    assert stale is None or stale.identity != check_identity(os.stat(h.backing / "g.pt"), False)


def test_what_the_reader_answered_is_adopted_as_the_filesystem_would_count_it(
    h: Harness,
) -> None:
    fs = h.core.fs
    ino, fh = opened(h, "i.pt")
    close(h, fh)
    h.call(fs.mkdir, ROOT, "sub", 0o755, CALLER)
    sub = h.call(fs.lookup, ROOT, "sub").ino
    inode, d = fs.inodes[ino], fs.inodes[sub]
    lookups, checked_at, dir_at, dir_lookups = (
        inode.nlookup,
        inode.checked_at,
        d.dir_attrs_at,
        d.nlookup,
    )
    later = time.monotonic() + 5
    inline(h, fs.adopt_seen, ino, True, later)
    inline(h, fs.adopt_seen, sub, False, later)
    assert (inode.nlookup, inode.checked_at) == (lookups + 1, later)
    assert (d.dir_attrs_at, d.nlookup) == (later, dir_lookups)  # a GETATTR takes no reference
    inline(h, fs.adopt_seen, ino, True, 0.0)  # no check: only the reference
    assert (inode.nlookup, inode.checked_at) == (lookups + 2, later)
    assert checked_at < later and dir_at < later
    # The kernel's FORGETs of those references: the inode lives until the last.
    inline(h, fs.forget, ino, lookups + 1)
    assert fs.inodes.get(ino) is inode
    inline(h, fs.forget, ino, 1)
    assert fs.inodes.get(ino) is None


# ----- on real mounts -----------------------------------------------------------------------------


def _requests(m: Any) -> dict[str, Any]:
    return m.stat()["fuse"]["requests"]


def _load_loop(path: Path, sd: dict[str, Any], loads: int) -> None:
    import torch

    for _ in range(loads):
        os.stat(path)
        got = torch.load(path, mmap=True, weights_only=True)
        assert got.keys() == sd.keys()
        for k, v in sd.items():
            assert torch.equal(got[k], v), k


def test_torch_loads_through_the_compiled_reader(mounted: Any) -> None:
    import torch

    m = mounted
    assert m.stat()["fuse"]["reader"] == "compiled"
    sd = {f"w{i}": torch.randn(4096 + i) for i in range(6)}
    torch.save(sd, m.mnt / "a.pt")
    before = _requests(m)
    _load_loop(m.mnt / "a.pt", sd, 30)
    after = _requests(m)
    # isatty's IOCTL every load, and most opens (a check older than
    # fuse.open_recheck, or the loop's turn in between, sends one to Python).
    assert after["compiled_ioctls"] - before["compiled_ioctls"] >= 30
    assert after["compiled_opens"] - before["compiled_opens"] >= 20
    assert m.stat()["fuse"]["handles"] == 0  # every handle it gave out was released


def test_a_rewrite_in_place_between_compiled_opens_is_read_whole(mounted: Any) -> None:
    """The same inode, truncated and written again by another process: the
    loop's turn lapses the ticket, so no open answers from the old state
    (no stale pages kept, no old version)."""
    import subprocess
    import sys

    import torch

    m = mounted
    path = m.mnt / "b.pt"
    ino = None
    for step in range(8):
        sd = {"w": torch.randn(50_000 + step * 1000), "step": torch.tensor(step)}
        code = (
            "import sys, torch; sd = torch.load(sys.argv[2]);"
            "f = open(sys.argv[1], 'r+b'); f.truncate(0); torch.save(sd, f); f.close()"
        )
        staged = m.root / f"staged-{step}.pt"
        torch.save(sd, staged)
        if step == 0:
            torch.save(sd, path)
        else:
            subprocess.run([sys.executable, "-c", code, str(path), str(staged)], check=True)
        ino = ino or os.stat(path).st_ino
        assert os.stat(path).st_ino == ino  # rewritten in place, never replaced
        _load_loop(path, sd, 3)
    assert _requests(m)["compiled_opens"] > 0


def test_loads_racing_replaces_and_removes_stay_whole(mounted: Any) -> None:
    """Another process replaces and removes the file while this one loads
    it: each load's tensors are one whole version (a load whose pickle is of
    the version before is torn, as on any filesystem: tests/
    test_frameworks_replace.py), or the name is gone; every handle is
    released, and the daemon logs nothing unexpected."""
    import shutil
    import subprocess
    import sys

    import torch

    m = mounted
    path = m.mnt / "c.pt"
    versions = {}
    for v in range(4):
        sd = {"w": torch.randn(20_000, generator=torch.Generator().manual_seed(v)), "v": v}
        versions[v] = sd
        # One archive name for all: every version has the same byte layout.
        torch.save(sd, m.root / f"v{v}.pt")
    shutil.copyfile(m.root / "v0.pt", path)
    writer = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import os, shutil, sys, time\n"
            "root, path = sys.argv[1], sys.argv[2]\n"
            "end = time.monotonic() + 6\n"
            "i = 0\n"
            "while time.monotonic() < end:\n"
            "    i += 1\n"
            "    tmp = path + '.tmp'\n"
            "    shutil.copyfile(f'{root}/v{i % 4}.pt', tmp)\n"
            "    os.replace(tmp, path)\n"
            "    if i % 5 == 0:\n"
            "        os.unlink(path)\n"
            "    time.sleep(0.01)\n",
            str(m.root),
            str(path),
        ]
    )
    loads = gone = 0
    try:
        while writer.poll() is None:
            try:
                got = torch.load(path, mmap=True, weights_only=True)
            except FileNotFoundError:  # removed before the first open
                gone += 1
                continue
            except RuntimeError as exc:  # removed between the two opens
                assert "No such file or directory" in str(exc), exc
                gone += 1
                continue
            whole = [v for v, sd in versions.items() if torch.equal(got["w"], sd["w"])]
            assert len(whole) == 1, f"load {loads}: tensor bytes of no whole version"
            loads += 1
    finally:
        writer.kill()
        writer.wait(10)
    assert loads > 20 and gone > 0
    requests = _requests(m)
    assert requests["compiled_opens"] > 0 and requests["compiled_ioctls"] > 0
    del got  # its mapping holds the last load's file open
    gc.collect()
    wait_for(lambda: m.stat()["fuse"]["handles"] == 0, 10, "every handle released")


def test_loads_spaced_past_the_recheck_are_checked_by_the_reader(mounts: Any) -> None:
    """Loads of a few checkpoints in turn, each more than fuse.open_recheck
    after its last check, with their attributes in the kernel's cache (no
    stat reaches the daemon before the open): the reader checks each open's
    manifest itself. Another mount of the same backing directory then
    writes a new version of one of them: the next load here reads it,
    whether the reader's check or the loop's turn (which lapses every
    ticket, and may come first) sends that open to Python's check."""
    import torch

    a, b = mounts("a"), mounts("b")
    a.mount()
    b.mount()
    sds = {}
    for i in range(4):
        sds[i] = {"w": torch.randn(8192, generator=torch.Generator().manual_seed(i))}
        torch.save(sds[i], a.mnt / f"k{i}.pt")
    a.cli("flush", str(a.mnt), "--wait")
    paths = [a.mnt / f"k{i}.pt" for i in range(4)]
    for p in paths:
        torch.load(p, mmap=True, weights_only=True)
    before = _requests(a)
    for _ in range(5):
        for i, p in enumerate(paths):
            time.sleep(0.02)  # 4 x 20 ms per round: past the 50 ms recheck
            got = torch.load(p, mmap=True, weights_only=True)
            assert torch.equal(got["w"], sds[i]["w"])
    after = _requests(a)
    assert after["compiled_checks"] - before["compiled_checks"] >= 10
    assert after["compiled_opens"] - before["compiled_opens"] >= 30
    # Another writer of the backing directory (no peers: the recheck holds).
    new = {"w": torch.randn(8192, generator=torch.Generator().manual_seed(99))}
    torch.save(new, b.mnt / "k1.pt")
    b.cli("flush", str(b.mnt), "--wait")
    time.sleep(0.1)  # past a's recheck of its last look
    got = torch.load(paths[1], mmap=True, weights_only=True)
    assert torch.equal(got["w"], new["w"])


ENTRY_TIMEOUT = 1.1  # past the kernel's entry and attribute timeouts of the mount (1 s)


def test_loads_after_the_kernels_timeouts_look_up_through_the_reader(mounts: Any) -> None:
    """Loads a second and more apart: the kernel looks each name up again
    and asks the directories' attributes; the reader answers those after
    its own stat of the store finds what the last look found. Another mount
    of the same backing directory then writes a new version and a new
    directory: each shows here once the kernel's timeouts ran out."""
    import torch

    a, b = mounts("a"), mounts("b")
    a.mount()
    b.mount()
    (a.mnt / "run").mkdir()
    sds = {
        i: {"w": torch.randn(4096 + i, generator=torch.Generator().manual_seed(i))}
        for i in range(3)
    }
    paths = [a.mnt / "run" / f"k{i}.pt" for i in range(3)]
    for p, sd in zip(paths, sds.values(), strict=True):
        torch.save(sd, p)
    a.cli("flush", str(a.mnt), "--wait")
    sizes = [os.stat(p).st_size for p in paths]
    for p in paths:
        torch.load(p, mmap=True, weights_only=True)
    before = _requests(a)
    for _ in range(3):
        time.sleep(ENTRY_TIMEOUT)
        for i, p in enumerate(paths):
            st = os.stat(p)
            assert (st.st_size, stat.S_IMODE(st.st_mode)) == (sizes[i], 0o644)
            got = torch.load(p, mmap=True, weights_only=True)
            assert torch.equal(got["w"], sds[i]["w"])
    after = _requests(a)
    assert after["compiled_lookups"] - before["compiled_lookups"] >= 6
    assert after["compiled_getattrs"] - before["compiled_getattrs"] >= 2
    # Changed from the other mount: a new version, a new directory.
    links = os.stat(a.mnt / "run").st_nlink
    new = {"w": torch.randn(9000, generator=torch.Generator().manual_seed(99))}
    torch.save(new, b.mnt / "run" / "k2.tmp")
    os.replace(b.mnt / "run" / "k2.tmp", b.mnt / "run" / "k2.pt")
    (b.mnt / "run" / "sub").mkdir()
    b.cli("flush", str(b.mnt), "--wait")
    time.sleep(ENTRY_TIMEOUT)
    assert os.stat(paths[2]).st_size == os.stat(b.mnt / "run" / "k2.pt").st_size != sizes[2]
    assert torch.equal(torch.load(paths[2], mmap=True, weights_only=True)["w"], new["w"])
    assert os.stat(a.mnt / "run").st_nlink == links + 1
    assert sorted(os.listdir(a.mnt / "run")) == ["k0.pt", "k1.pt", "k2.pt", "sub"]


def test_every_reference_a_compiled_lookup_gave_the_kernel_is_forgotten(mounted: Any) -> None:
    """The kernel forgets what it looked up (here: all at once, dropping its
    caches): the daemon frees every inode, none kept by a lookup the reader
    answered and the filesystem counted twice (that each is counted exactly
    once is test_what_the_reader_answered_is_adopted_as_the_filesystem_would_count_it's)."""
    if os.geteuid() != 0:
        pytest.skip("dropping the kernel's caches takes root")
    m = mounted
    (m.mnt / "d").mkdir()
    names = [m.mnt / "d" / f"f{i}.bin" for i in range(20)]
    for p in names:
        p.write_bytes(random.randbytes(5000))
    m.cli("flush", str(m.mnt), "--wait")
    data = {p: p.read_bytes() for p in names}
    before = _requests(m)["compiled_lookups"]
    for _ in range(2):
        time.sleep(ENTRY_TIMEOUT)
        for p in names:
            assert os.stat(p).st_size == 5000
    assert _requests(m)["compiled_lookups"] - before >= 20

    def forgotten() -> bool:
        Path("/proc/sys/vm/drop_caches").write_text("2\n")
        return m.stat()["fuse"]["inodes"] == 1  # the root

    wait_for(forgotten, 20, "every inode forgotten")
    for p in names:  # looked up again, from nothing
        assert p.read_bytes() == data[p]


def test_an_ordinary_user_loads_through_the_compiled_reader(shared_mounts: Any) -> None:
    import torch
    from test_users import GROUP, USER, run_as

    m = shared_mounts()
    m.mount()
    sd = {"w": torch.randn(30_000)}
    path = m.mnt / "u.pt"
    torch.save(sd, path)
    os.chmod(path, 0o644)
    before = _requests(m)["compiled_opens"]
    sums = run_as(
        USER,
        GROUP,
        "import json, os, sys, torch\n"
        "out = []\n"
        "for _ in range(10):\n"
        "    os.stat(sys.argv[3])\n"
        "    out.append(float(torch.load(sys.argv[3], mmap=True)['w'].sum()))\n"
        "print(json.dumps(out))\n",
        str(path),
    )
    assert sums == [float(sd["w"].sum())] * 10
    assert _requests(m)["compiled_opens"] > before


def test_the_python_reader_when_the_compiled_one_is_off(mounts: Any) -> None:
    import torch

    m = mounts()
    config = m.root / "python-reader.yaml"
    config.write_text("fuse:\n  compiled_reader: false\n")
    m.mount("--config", str(config))
    assert m.stat()["fuse"]["reader"] == "python"
    sd = {"w": torch.randn(10_000)}
    torch.save(sd, m.mnt / "p.pt")
    _load_loop(m.mnt / "p.pt", sd, 5)
    r = _requests(m)
    assert (r["compiled_opens"], r["compiled_ioctls"]) == (0, 0)
    assert r["stateless"] >= 5  # isatty, answered in Python


def test_with_peers_the_compiled_reader_is_off_unless_asked_for(tmp_path: Path) -> None:
    """Readers of a file another node replaces got more ESTALE opens with it
    (README, Limits): with peers it takes ``fuse.compiled_reader: true``."""
    from ckptfs.fs.config import load_config

    secret = tmp_path / "secret"
    secret.write_text("s" * 40)
    secret.chmod(0o600)
    cfg = tmp_path / "peers.yaml"
    cfg.write_text(
        f"peers:\n  secret_file: {secret}\n  nodes:\n"
        "    n1: 127.0.0.1:7001\n    n2: 127.0.0.1:7002\n"
    )
    assert load_config(None, {}, environ={}).compiled_reader
    assert not load_config(cfg, {"node": "n1"}, environ={}).compiled_reader
    asked = load_config(cfg, {"node": "n1", "fuse.compiled_reader": "true"}, environ={})
    assert asked.compiled_reader
