"""The FUSE fast paths of FileSystem (``open_now``, ``release_now``,
``flush_now``, ``getattr_now``), called as the session's reader calls them:
synchronously on the loop, between two task steps, with no task of their
own. Each either answers exactly as its async operation would, or declines
(None/False) before it changes anything, and the async operation then does
the whole work.
"""

from __future__ import annotations

import errno
import functools
import os
import random
import time
from typing import Any

import pytest
from ckptfs.fs.content.cachedfile import ChunkMap
from ckptfs.fs.content.state import FileRole
from ckptfs.fs.namespace.inodes import ROOT
from ckptfs.fs.namespace.posix import Caller, FsError
from ckptfs.fs.store.manifest import Manifest, new_id
from lifecycle_harness import CALLER, Harness, close, inline, opened, read_now_copied
from manifests import write_store_manifest


def tables(h: Harness) -> tuple[Any, ...]:
    """What an open or a release changes: handles, opens and file references."""
    fs = h.core.fs
    inodes = {i: (n.opens, n.nlookup, n.kernel_version) for i, n in fs.inodes.by_ino.items()}
    files = {f.file_id: (f.handles, f.writers) for f in h.core.cache.files.values()}
    return (dict(fs.handles), inodes, files)


def test_a_reader_opens_and_closes_inline(h: Harness) -> None:
    fs = h.core.fs
    ino, fh = opened(h, "a.pt")  # the lookup checked the manifest just now
    close(h, fh)
    before = tables(h)
    got = inline(h, fs.open_now, ino, os.O_RDONLY, CALLER)
    assert got is not None
    fh2, keep = got
    assert keep  # the kernel's pages are of this very version
    assert fs.handles[fh2].file is fs.inodes[ino].file and not fs.handles[fh2].writable
    assert inline(h, fs.getattr_now, ino).size == fs.inodes[ino].file.size
    assert inline(h, fs.flush_now, fh2) is True  # a reader's close publishes nothing
    assert inline(h, fs.release_now, fh2) is True
    assert tables(h) == before


def test_it_declines_what_needs_the_store_or_the_loop(h: Harness, monkeypatch: Any) -> None:
    fs = h.core.fs
    ino, fh = opened(h, "b.pt")
    close(h, fh)
    before = tables(h)
    # Written through: a writable open may truncate, adopt or wait.
    assert inline(h, fs.open_now, ino, os.O_WRONLY, CALLER) is None
    assert inline(h, fs.open_now, ino, os.O_RDWR | os.O_TRUNC, CALLER) is None
    # The check is older than fuse.open_recheck: close-to-open reads the manifest.
    monkeypatch.setattr(fs.config, "open_recheck", 0.0)
    assert inline(h, fs.open_now, ino, os.O_RDONLY, CALLER) is None
    assert inline(h, fs.getattr_now, ino) is None
    # Directories and unknown inodes go the usual way too.
    assert inline(h, fs.open_now, ROOT, os.O_RDONLY, CALLER) is None
    assert tables(h) == before


def test_a_file_being_written_here_opens_inline(h: Harness, monkeypatch: Any) -> None:
    """Our copy is the current one while a writer has it: no check needed."""
    fs = h.core.fs
    monkeypatch.setattr(fs.config, "open_recheck", 0.0)
    fh_w, attr = h.call(fs.create, ROOT, "w.pt", 0o644, os.O_WRONLY | os.O_CREAT, CALLER)
    h.call(fs.write, fh_w, 0, b"x" * 100)
    got = inline(h, fs.open_now, attr.ino, os.O_RDONLY, CALLER)
    assert got is not None
    fh_r, keep = got
    assert not keep  # modified: the kernel must not keep older pages
    assert inline(h, fs.getattr_now, attr.ino).size == 100
    # The writer's close publishes, and its release may commit: not inline.
    assert inline(h, fs.flush_now, fh_w) is False
    assert inline(h, fs.release_now, fh_w) is False
    assert inline(h, fs.release_now, fh_r) is True
    close(h, fh_w)


def test_the_last_reader_of_a_removed_file_drops_it(h: Harness) -> None:
    """Open handles keep an unlinked file's bytes; the last release lets go."""
    fs = h.core.fs
    ino, fh = opened(h, "c.pt")
    f = fs.inodes[ino].file
    assert f.ram_count  # its pages are in RAM
    h.call(fs.unlink, ROOT, "c.pt")
    assert f.unlinked and f.ram_count  # still readable through fh
    assert inline(h, fs.release_now, fh) is True
    assert fh not in fs.handles
    inline(h, fs.forget, ino, fs.inodes[ino].nlookup)  # the kernel forgets it
    assert not f.ram_count and not f.pages  # dropped: its slots went back


def test_a_plain_file_is_opened_on_the_loop(h: Harness) -> None:
    """Its reads go to a descriptor of the backing file, opened in a thread."""
    (h.backing / "plain.bin").write_bytes(b"plain bytes")
    fs = h.core.fs
    ino = h.call(fs.lookup, ROOT, "plain.bin").ino
    assert inline(h, fs.open_now, ino, os.O_RDONLY, Caller(0, 0)) is None
    fh, _ = h.call(fs.open, ino, os.O_RDONLY, CALLER)
    assert inline(h, fs.release_now, fh) is False  # its descriptor is closed in a thread
    h.call(fs.release, fh)


def test_open_flags_leave_the_flush_to_whoever_may_write(h: Harness) -> None:
    """FOPEN_NOFLUSH (no FLUSH at close) only for a handle that cannot write:
    a read-only open. A create's handle writes whatever its flags say, and
    its close must commit (the close is the durability point)."""
    from ckptfs.fs.fuse import abi as abi
    from ckptfs.fs.fuse.abi import Op
    from ckptfs.fs.fuse.operations import Operations
    from ckptfs.fs.fuse.session import Request

    ops = Operations(h.core.fs, writeback_cache=False)

    def create(name: str, flags: int) -> int:
        body = memoryview(abi.CREATE_IN.pack(flags, 0o644, 0o022, 0) + name.encode() + b"\0")
        entry, opened = h.call(ops.create, Request(Op.CREATE, 1, ROOT, 0, 0, 1, body))
        fh, open_flags, _ = abi.OPEN_OUT.unpack(opened)
        assert h.core.fs.handles[fh].writable
        h.call(h.core.fs.release, fh)
        return open_flags

    for flags in (os.O_RDONLY, os.O_WRONLY, os.O_RDWR, os.O_RDONLY | os.O_EXCL):
        assert not create(f"new{flags}", os.O_CREAT | flags) & abi.FOPEN_NOFLUSH, flags
    ino, fh = opened(h, "c.pt")
    close(h, fh)
    body = memoryview(abi.OPEN_IN.pack(os.O_RDONLY, 0))
    fh_r, open_flags, _ = abi.OPEN_OUT.unpack(
        h.call(ops.open, Request(Op.OPEN, 2, ino, 0, 0, 1, body))
    )
    assert open_flags & abi.FOPEN_NOFLUSH and not h.core.fs.handles[fh_r].writable
    h.call(h.core.fs.release, fh_r)


def test_a_read_of_bytes_in_ram_is_answered_inline_as_by_a_task(h: Harness) -> None:
    """A file saved here keeps its pages in RAM: every read of it needs no
    await, and gives exactly what the async read gives, across pages and
    past the end."""
    fs = h.core.fs
    data = random.randbytes(3 * fs.cache.page_size + 1234)
    ino, fh = opened(h, "r.pt", data)
    size = len(data)
    page = fs.cache.page_size
    ranges = [(0, 4), (0, 65536), (page - 100, 200), (page - 10, 2 * page + 20),
              (size - 22, 65536), (size - 1, 1), (size, 10), (size + 4096, 10)]  # fmt: skip
    for off, n in ranges:
        want = data[off : off + n]
        assert h.call(fs.read, fh, off, n) == want, (off, n)
        assert read_now_copied(h, fh, off, n) == want, (off, n)
    close(h, fh)


def test_a_read_that_needs_a_chunk_waits_for_it(h: Harness) -> None:
    """Evicted to its stored chunks, a file's read declines inline (a task
    reads the chunk, and starts the read-ahead); once a frame holds the
    chunk, it is answered without an await."""
    fs = h.core.fs
    data = random.randbytes(2 * fs.cache.page_size + 77)
    ino, fh = opened(h, "e.pt", data)
    f = fs.inodes[ino].file
    assert inline(h, fs.cache.evict, f) and not f.ram_count
    assert read_now_copied(h, fh, 0, 4096) is None  # no frame yet
    assert h.call(fs.read, fh, 0, 4096) == data[:4096]  # the chunk's frame is read
    assert read_now_copied(h, fh, 100, 4096) == data[100:4196]
    close(h, fh)
    h.call(fs.unlink, ROOT, "e.pt")
    assert read_now_copied(h, fh, 0, 10) is None  # a released handle: a task's EBADF


async def _no_peer_answers(*args: object) -> bytes:
    raise OSError(errno.EHOSTUNREACH, "no peer answers in this test")


def test_an_open_of_a_version_whose_mirror_here_was_dropped_is_sent_back_once(
    h: Harness,
) -> None:
    """This node is the buddy of n1, whose file r.pt is pending. An open
    here read its manifest (REMOTE, read from the mirror here) and closed;
    then n1 let go of that version and the mirror was dropped, before the
    next open here, which needs no new look at the manifest yet, held it.
    No holder may serve it now, and a read of a mapping that fails is
    SIGBUS: the open answers ESTALE (the kernel looks the name up again)
    and forgets the check, the fast path leaves it to the loop, and the
    kernel's retry by the same thread gets what it asked for."""
    fs, cache = h.core.fs, h.core.cache
    cache.peer_fetch = _no_peer_answers  # peers exist: pending elsewhere is REMOTE
    data = random.randbytes(cache.page_size + 904)
    fid, mid = new_id(), "m0"
    m = Manifest(fid, new_id(), len(data), 0o644, time.time_ns(), "pending", ["n1", "model"])
    write_store_manifest(h.backing / "r.pt", m)
    page = cache.page_size
    mirror_page = functools.partial(cache.mirror_page, timeout=1)
    for p, part in enumerate((data[:page], data[page:])):
        assert h.direct(mirror_page, "n1", mid, fid, p, 1, memoryview(part))
    ram = {0: (1, page), 1: (1, len(data) - page)}
    assert inline(h, cache.mirror_commit, "n1", mid, m, "r.pt", 0, 0, ram, {}, ChunkMap(), 1) == []

    ino = h.call(fs.lookup, ROOT, "r.pt").ino
    fh, _ = h.call(fs.open, ino, os.O_RDONLY, CALLER)  # the manifest read: our mirror's version
    f = fs.handles[fh].file
    assert f is not None and f.role is FileRole.REMOTE and not cache.dropped_here(f)
    assert h.call(fs.read, fh, 0, len(data)) == data  # from the mirror here
    close(h, fh)
    assert inline(h, cache.mirror_drop, "n1", mid, "")  # n1 replaced or removed it
    assert cache.held_version(fid, m.version) is None and cache.dropped_here(f)
    assert fs.inodes[ino].checked is not None
    before = tables(h)

    caller = Caller(0, 0, tid=4242)
    assert inline(h, fs.open_now, ino, os.O_RDONLY, caller) is None  # the loop's to send back
    with pytest.raises(FsError) as sent_back:
        h.call(fs.open, ino, os.O_RDONLY, caller)
    assert sent_back.value.errno == errno.ESTALE and "r.pt" in str(sent_back.value)
    assert fs.inodes[ino].checked is None  # the next lookup reads the manifest again
    assert tables(h) == before  # no handle was made
    # The kernel retries once, for the same thread: a second ESTALE would
    # reach the caller, so it gets the file it asked for.
    fh, _ = h.call(fs.open, ino, os.O_RDONLY, caller)
    assert fs.handles[fh].file is f
    close(h, fh)
    # Another thread's open is sent back too (once each).
    with pytest.raises(FsError):
        h.call(fs.open, ino, os.O_RDONLY, Caller(0, 0, tid=4243))
