"""Where a stat's answer comes from: our copy, the last check of the name, or the store.

The kernel asks for a file's attributes again after every read: a read
invalidates its cached atime, so the next stat or fstat is a GETATTR even
within the attribute timeout. ``torch.load(mmap=True)`` stats the path between
its two opens, right after reading the zip directory; with a backing-store
round trip per GETATTR that stat was the widest part of the reopen window on
a new version. A GETATTR is answered without the store when the answer
cannot differ: the file is open here (its attributes are our copy's whatever
the name holds, see ``FileSystem._local``), or the last lookup or open saw
this very version within ``fuse.open_recheck``, the window in which an open
may reuse that check too. Otherwise the store is asked, so a version written
by another node shows as soon as the kernel asks.
"""

from __future__ import annotations

import os
import random
import time

import pytest
from ckptfs.fs.namespace.inodes import ROOT
from ckptfs.fs.namespace.posix import SetAttr
from ckptfs.fs.store import entries as backing_mod
from ckptfs.fs.store.chunkstore import ChunkStore, chunk_hash
from ckptfs.fs.store.manifest import Chunk, Manifest, new_id, read_manifest
from lifecycle_harness import CALLER, SIZE, Harness, close, opened, saved
from manifests import write_store_manifest


class StatCounter:
    """Counts the filesystem's backing-store stats (``Backing.entry``) of one path."""

    def __init__(self, h: Harness, rel: str) -> None:
        backing = h.core.fs.backing
        self.calls = 0
        real = backing.entry

        async def entry(path: str, *args):  # type: ignore[no-untyped-def]
            if path == rel:
                self.calls += 1
            return await real(path, *args)

        backing.entry = entry  # type: ignore[method-assign]


def rewrite_elsewhere(h: Harness, name: str, data: bytes) -> None:
    """Another node's flush: a new durable version of the same file at the name."""
    m = read_manifest(h.backing / name)
    ChunkStore(h.backing).put(chunk_hash(data), data)
    write_store_manifest(
        h.backing / name,
        Manifest(
            m.file_id, new_id(), len(data), 0o644, time.time_ns(), "durable", ["other"],
            [Chunk(0, len(data), chunk_hash(data))],
        ),
    )  # fmt: skip


def test_an_open_file_is_stat_from_our_copy_without_the_store(h: Harness) -> None:
    data = random.randbytes(SIZE)
    ino, fh = opened(h, "model.pt", data)
    fs = h.core.fs
    assert h.call(fs.read, fh, 0, 4096) == data[:4096]
    stats = StatCounter(h, "model.pt")
    first = h.call(fs.getattr, ino)
    assert (first.size, first.ino) == (SIZE, ino)
    # Another node writes a new version meanwhile: this open still reads ours.
    rewrite_elsewhere(h, "model.pt", random.randbytes(3 * SIZE))
    time.sleep(h.config.open_recheck + 0.05)
    again = h.call(fs.getattr, ino)
    assert again == first  # ctime too: tar checks it did not change while it read
    assert stats.calls == 0
    assert h.call(fs.read, fh, 4096, SIZE) == data[4096:]
    close(h, fh)
    # Closed: the next stat asks the store and sees the new version.
    assert h.call(fs.getattr, ino).size == 3 * SIZE
    assert stats.calls == 1


def test_a_closed_file_is_stat_from_a_check_only_within_the_recheck_window(
    h: Harness,
) -> None:
    ino, fh = opened(h, "model.pt")  # loads the file
    fs = h.core.fs
    close(h, fh)
    stats = StatCounter(h, "model.pt")
    h.call(fs.lookup, ROOT, "model.pt")  # the check a stat or open right after may reuse
    assert h.call(fs.getattr, ino).size == SIZE
    assert stats.calls == 1  # the lookup's
    time.sleep(h.config.open_recheck + 0.05)
    rewrite_elsewhere(h, "model.pt", random.randbytes(2 * SIZE))
    assert h.call(fs.getattr, ino).size == 2 * SIZE  # past the window: the store
    assert stats.calls == 2
    # That check saw a version this node does not hold: no answer from it.
    assert h.call(fs.getattr, ino).size == 2 * SIZE
    assert stats.calls == 3


def test_with_no_recheck_window_a_closed_file_is_always_stat_from_the_store(
    h: Harness,
) -> None:
    h.config.open_recheck = 0.0  # the default with peers: NFS close-to-open
    ino, fh = opened(h, "model.pt")
    fs = h.core.fs
    stats = StatCounter(h, "model.pt")
    assert h.call(fs.getattr, ino).size == SIZE  # open: our copy
    assert stats.calls == 0
    close(h, fh)
    rewrite_elsewhere(h, "model.pt", random.randbytes(2 * SIZE))
    assert h.call(fs.getattr, ino).size == 2 * SIZE  # at once, with no window
    assert stats.calls == 1


@pytest.mark.parametrize(
    "change", [SetAttr(mode=0o600), SetAttr(mtime_ns=123_000_000_000), SetAttr(uid=7)]
)
def test_a_metadata_change_here_moves_the_ctime_a_stat_shows(h: Harness, change: SetAttr) -> None:
    """chmod, utime and chown rewrite the manifest under the same version: a
    stat after them, of an open or a closed file, must not show the ctime the
    check before them saw."""
    h.config.open_recheck = 5.0  # the closed file's check would still be recent
    ino, fh = opened(h, "model.pt")
    fs = h.core.fs
    before = h.call(fs.getattr, ino)
    time.sleep(0.02)
    h.call(fs.setattr, ino, change, CALLER)
    now = os.stat(h.backing / "model.pt").st_ctime_ns
    assert now >= before.ctime_ns + 10_000_000
    assert h.call(fs.getattr, ino).ctime_ns == now  # open here
    close(h, fh)
    time.sleep(0.02)
    h.call(fs.setattr, ino, SetAttr(mode=0o640), CALLER)
    closed = h.call(fs.getattr, ino)  # closed, within the window
    assert closed.mode & 0o7777 == 0o640
    assert closed.ctime_ns == os.stat(h.backing / "model.pt").st_ctime_ns > now


def test_a_rename_here_moves_the_ctime_a_stat_shows(h: Harness) -> None:
    ino, fh = opened(h, "tmp.pt")
    fs = h.core.fs
    before = h.call(fs.getattr, ino)
    time.sleep(0.02)
    h.call(fs.rename, ROOT, "tmp.pt", ROOT, "model.pt", 0)
    after = h.call(fs.getattr, ino)
    close(h, fh)
    assert after.ctime_ns == os.stat(h.backing / "model.pt").st_ctime_ns > before.ctime_ns


def test_a_check_is_as_old_as_the_read_that_made_it(h: Harness, monkeypatch) -> None:
    """A slow store: the check's age counts from when its read began, so a
    read slower than the window is not reused as if it were fresh."""
    ino, fh = opened(h, "model.pt")  # loads the file
    fs = h.core.fs
    close(h, fh)
    real = backing_mod.PARSED.read

    def slow(fd: int, rel: str, *args):  # type: ignore[no-untyped-def]
        time.sleep(h.config.open_recheck + 0.05)
        return real(fd, rel, *args)

    monkeypatch.setattr(backing_mod.PARSED, "read", slow)
    h.call(fs.lookup, ROOT, "model.pt")
    monkeypatch.setattr(backing_mod.PARSED, "read", real)
    stats = StatCounter(h, "model.pt")
    h.call(fs.getattr, ino)
    assert stats.calls == 1


def test_an_inode_keeps_its_last_check_without_the_chunk_list(h: Harness) -> None:
    """A lookup of every file of a checkpoint tree (`ls -l`) keeps one check
    per inode for as long as the kernel keeps the inode: not the manifests'
    chunk lists, which run to thousands of entries for a large file."""
    saved(h, "model.pt", random.randbytes(SIZE))
    assert len(read_manifest(h.backing / "model.pt").chunks) > 1
    fs = h.core.fs
    ino = h.call(fs.lookup, ROOT, "model.pt").ino
    checked = fs.inodes[ino].checked
    assert checked is not None and checked.manifest is not None
    assert (checked.manifest.chunks, checked.manifest.holders) == ([], [])
    assert checked.manifest.version == read_manifest(h.backing / "model.pt").version


def test_a_stat_of_a_directory_that_began_before_its_chmod_is_not_reused_after_it(
    h: Harness,
) -> None:
    """A stat of a directory reads the store, and before it stores what it
    read, the directory is chmod'ed here (the daemon's own READY stat of
    the mount root racing an operator's chmod of it): the next stat shows
    the new mode, not the old one the slow stat kept."""
    import trio

    fs = h.core.fs
    ino = h.call(fs.mkdir, ROOT, "d", 0o755, CALLER).ino
    backing = fs.backing
    real = backing.entry
    read_old = trio.Event()
    chmodded = trio.Event()

    async def slow_entry(path: str, *args):  # type: ignore[no-untyped-def]
        found = await real(path, *args)
        if path == "d" and not read_old.is_set():
            read_old.set()
            await chmodded.wait()  # what it read is older than the chmod
        return found

    real_set = backing.set_attributes
    stored = trio.Event()

    async def set_attributes(*args, **kwargs):  # type: ignore[no-untyped-def]
        done = await real_set(*args, **kwargs)
        chmodded.set()
        await stored.wait()  # the slow stat keeps what it read, before the chmod returns
        return done

    backing.entry = slow_entry  # type: ignore[method-assign]
    backing.set_attributes = set_attributes  # type: ignore[method-assign]

    async def slow_stat() -> None:
        await fs.getattr(ino)
        stored.set()

    async def race() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(slow_stat)
            await read_old.wait()
            await fs.setattr(ino, SetAttr(mode=0o1777), CALLER)

    h.call(race)
    backing.entry = real  # type: ignore[method-assign]
    backing.set_attributes = real_set  # type: ignore[method-assign]
    assert h.call(fs.getattr, ino).mode & 0o7777 == 0o1777
