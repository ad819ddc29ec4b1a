"""A file replaced on another node, then renamed over here, while the kernel
still holds its inode.

Found by the fault trials (docs/FAULT-TRIALS.md, bug 8): a read on the
writer's node returned the size of its checkpoint, its first 64 KiB and its
last 256 KiB right, and zeros between. The steps:

1. this node saved ``model.pt`` (pending; the kernel keeps the inode, with
   the head and tail pages the close pushed, and its size);
2. another node replaced ``model.pt``; this node's flusher found the name
   naming another file and retired its own, which nothing held open, so its
   pages went back to the cache;
3. this node renamed its next save over ``model.pt``: the inode lost its
   name here and, as an inode unlinked through this mount does, kept its
   file for the kernel's last uses, though that file had no bytes left;
4. an open of that inode (a path walk that resolved the name before the
   rename) read the kept file: zeros wherever the kernel had no page.

Driven without FUSE (lifecycle_harness.py).
"""

from __future__ import annotations

import errno
import os
import random
import time

import pytest
from ckptfs.fs.content.state import FileState
from ckptfs.fs.namespace.inodes import ROOT
from ckptfs.fs.namespace.posix import Caller, SetAttr
from ckptfs.fs.store.manifest import Manifest, new_id, read_manifest, write_manifest
from ckptfs.fs.store.renamelog import write_record
from lifecycle_harness import (
    CALLER,
    SIZE,
    Harness,
    close,
    errno_of,
    inline,
    name_reads,
    read_handle,
    read_inode,
    save,
    saved,
)


def test_an_inode_whose_file_went_while_it_had_its_name_never_reads_zeros(h: Harness):
    ours, theirs, next_save = (random.randbytes(SIZE) for _ in range(3))
    ino = save(h, "model.pt", ours)  # pending here; the kernel holds the inode
    # Another node (or a login node) puts another file at the name.
    tmp = h.backing / ".model.pt.elsewhere"
    tmp.write_bytes(theirs)
    os.replace(tmp, h.backing / "model.pt")
    h.direct(h.background_steps, 100)  # the flush finds the name gone: the file goes
    save(h, "model.pt.tmp", next_save)
    h.call(h.core.fs.rename, ROOT, "model.pt.tmp", ROOT, "model.pt", 0)
    # The open of the old inode gets its bytes, or is sent back to the name
    # (ESTALE: the kernel looks it up again); never bytes that no file had.
    try:
        fh, _ = h.call(h.core.fs.open, ino, os.O_RDONLY, CALLER)
    except OSError as exc:
        assert errno_of(exc) == errno.ESTALE, exc
    else:
        try:
            got = bytearray()
            while piece := h.call(h.core.fs.read, fh, len(got), 5000):
                got += piece
        except OSError as exc:
            assert errno_of(exc) == errno.ESTALE, exc
        else:
            assert bytes(got) == ours, "the old inode read bytes its file never had"
        finally:
            h.call(h.core.fs.release, fh)
    assert name_reads(h, "model.pt") == next_save


def rewritten_elsewhere(h: Harness, name: str, like: str) -> None:
    """Another node rewrites ``name`` in place (an O_TRUNC open keeps the
    file's id) with the content of ``like``, and makes it durable."""
    key = h.core.backing.key  # another node's daemon has it too (.ckptfs)
    mine = read_manifest(h.backing / name, key=key)
    other = read_manifest(h.backing / like, key=key)
    assert mine is not None and other is not None
    rewrite = Manifest(
        mine.file_id, new_id(), other.size, mine.mode, time.time_ns(), "durable", ["n9"],
        list(other.chunks), other.chunking, seq=mine.seq + 1,
    )  # fmt: skip
    st = os.stat(h.backing / name)
    write_manifest(h.backing / f".{name}.n9", rewrite, owner=(st.st_uid, st.st_gid), key=key)
    os.replace(h.backing / f".{name}.n9", h.backing / name)


def open_then_rewritten_elsewhere(h: Harness, ours: bytes, theirs: bytes) -> tuple[int, int]:
    """``model.pt`` saved here as ``ours`` and open for reading, then
    rewritten on another node to ``theirs``: (its inode, the handle)."""
    saved(h, "model.pt", ours)
    saved(h, "other.pt", theirs)
    ino = h.call(h.core.fs.lookup, ROOT, "model.pt").ino
    fh, _ = h.call(h.core.fs.open, ino, os.O_RDONLY, CALLER)
    rewritten_elsewhere(h, "model.pt", "other.pt")
    return ino, fh


def test_a_version_read_here_while_another_node_rewrites_it_keeps_its_size(h: Harness):
    """Bug 1 of docs/FAULT-TRIALS.md: a reader here holds the file open (or
    its RELEASE is on its way) while another node rewrites it in place to
    another size. The name's new version gets an inode of its own: the
    kernel keeps one size per inode, and one inode with handles of both
    versions read one version's bytes up to the other's size."""
    ours, theirs = random.randbytes(SIZE), random.randbytes(SIZE // 2 + 1234)
    ino, fh = open_then_rewritten_elsewhere(h, ours, theirs)
    fs = h.core.fs
    attr = h.call(fs.lookup, ROOT, "model.pt")
    assert attr.size == len(theirs), "a lookup gave the new version the open one's size"
    assert read_inode(h, attr.ino) == theirs
    # The open handle reads its version whole, and its inode keeps its size.
    assert read_handle(h, fh) == ours
    assert h.call(fs.getattr, ino).size == len(ours)
    # A path walk that resolved the name before the rewrite opens the old
    # inode, which no longer has the name: it gets that inode's version.
    assert read_inode(h, ino) == ours
    close(h, fh)
    assert name_reads(h, "model.pt") == theirs


def test_an_open_of_an_inode_open_on_an_older_version_is_sent_to_the_name(h: Harness):
    """The same, with no lookup between the rewrite and the next open (the
    kernel's entry was still valid): the open of the inode whose handle
    reads the old version is sent back (ESTALE), and the kernel's lookup
    that follows gives the name's version an inode of its own."""
    ours, theirs = random.randbytes(SIZE), random.randbytes(SIZE + 5000)
    ino, fh = open_then_rewritten_elsewhere(h, ours, theirs)
    fs = h.core.fs
    inline(h, lambda: setattr(fs.inodes.get(ino), "checked", None))  # the check expired
    with pytest.raises(OSError) as raised:
        h.call(fs.open, ino, os.O_RDONLY, CALLER)
    assert errno_of(raised.value) == errno.ESTALE
    attr = h.call(fs.lookup, ROOT, "model.pt")
    assert attr.ino != ino and attr.size == len(theirs)
    assert read_inode(h, attr.ino) == theirs
    assert read_handle(h, fh) == ours and h.call(fs.getattr, ino).size == len(ours)
    close(h, fh)


def test_the_readers_own_next_open_and_a_setattr_of_the_old_inode(h: Harness):
    """The thread that reads the old version opens the name again (its
    entry still names the old inode): close-to-open, it is sent back to the
    name and reads the new version, while its first handle reads on the old
    one. A chmod by path through the old inode is sent back too (the kernel
    retries it there), and changes neither version's size here."""
    ours, theirs = random.randbytes(SIZE), random.randbytes(SIZE + 5000)
    reader = Caller(0, 0, tid=4242)
    saved(h, "model.pt", ours)
    saved(h, "other.pt", theirs)
    fs = h.core.fs
    ino = h.call(fs.lookup, ROOT, "model.pt").ino
    fh, _ = h.call(fs.open, ino, os.O_RDONLY, reader)
    rewritten_elsewhere(h, "model.pt", "other.pt")
    inline(h, lambda: setattr(fs.inodes.get(ino), "checked", None))
    sent_back = [(fs.open, (os.O_RDONLY, reader)), (fs.setattr, (SetAttr(mode=0o600), CALLER))]
    for call, args in sent_back:
        with pytest.raises(OSError) as raised:
            h.call(call, ino, *args)
        assert errno_of(raised.value) == errno.ESTALE, call
    attr = h.call(fs.lookup, ROOT, "model.pt")
    assert attr.ino != ino and attr.size == len(theirs)
    fh2, _ = h.call(fs.open, attr.ino, os.O_RDONLY, reader)
    assert read_handle(h, fh2) == theirs and read_handle(h, fh) == ours
    assert h.call(fs.getattr, ino).size == len(ours)
    close(h, fh, fh2)


def test_a_flush_superseded_while_its_file_is_still_written_keeps_it_for_the_last_close(
    h: Harness,
):
    """Another node's newer version of the file lands at its name before a
    FLUSH here commits (a child closing an inherited descriptor, while the
    parent goes on writing): that commit is refused (no publish over a newer
    version), but the file is still being written here. It stays so, and its
    last close publishes it as a version newer still, all its bytes."""
    first, rest = random.randbytes(SIZE), random.randbytes(SIZE)
    fs = h.core.fs
    fh, _ = h.call(fs.create, ROOT, "model.pt", 0o644, os.O_WRONLY, CALLER)
    h.call(fs.write, fh, 0, first)
    key = h.core.backing.key
    mine = read_manifest(h.backing / "model.pt", key=key)
    assert mine is not None
    ahead = time.time_ns() + 300_000_000  # that node's close, 0.3 s ahead of ours
    newer = Manifest(mine.file_id, new_id(), 10, 0o644, ahead, "pending", ["n9"], seq=ahead)
    st = os.stat(h.backing / "model.pt")
    write_manifest(h.backing / ".model.pt.n9", newer, owner=(st.st_uid, st.st_gid), key=key)
    os.replace(h.backing / ".model.pt.n9", h.backing / "model.pt")
    h.call(fs.flush, fh)  # refused: the name holds a newer version
    m = read_manifest(h.backing / "model.pt", key=key)
    assert m is not None and m.version == newer.version
    h.call(fs.write, fh, len(first), rest)  # the parent writes on
    time.sleep(0.4)
    close(h, fh)
    m = read_manifest(h.backing / "model.pt", key=key)
    assert m is not None and m.version != newer.version and m.size == 2 * SIZE
    assert name_reads(h, "model.pt") == first + rest


def test_an_open_at_the_new_name_during_a_flush_at_the_old_one_does_not_drop_the_file(tmp_path):
    """Another node renames the directory of a file pending here while its
    flush publishes at the old name, and a reader here opens it at the new
    name meanwhile (the open moves the file to it): the publish's "name
    gone" is about the old name, so the flush tries again where the file is
    now, instead of following renames from the new name to nowhere and
    dropping it (fault trials, seed 46, trial 21)."""
    h = Harness(tmp_path)
    h.config.open_recheck = 0.0  # every open reads the manifest, as with peers
    h.start()
    try:
        fs = h.core.fs
        d = h.call(fs.mkdir, ROOT, "iter.tmp", 0o755, CALLER).ino
        data = random.randbytes(SIZE)
        fh, _ = h.call(fs.create, d, "shard.pt", 0o644, os.O_WRONLY, CALLER)
        h.call(fs.write, fh, 0, data)
        h.call(fs.flush, fh)
        h.call(fs.release, fh)
        [f] = h.core.cache.files.values()
        # The flusher waits at its durable publish, at the old name.
        h.direct(h.background_until, "write manifest iter.tmp/shard.pt")
        assert any(w.startswith("write manifest iter.tmp/") for w in h.gate.labels)
        write_record(h.core.backing.dirs, "iter.tmp", "iter", "other")  # as rename.py does
        os.rename(h.backing / "iter.tmp", h.backing / "iter")
        nd = h.call(fs.lookup, ROOT, "iter").ino
        ino = h.call(fs.lookup, nd, "shard.pt").ino
        rfh, _ = h.call(fs.open, ino, os.O_RDONLY, CALLER)
        h.call(fs.release, rfh)
        assert f.path == "iter/shard.pt"
        h.direct(h.background_steps, 100)
        m = read_manifest(h.backing / "iter" / "shard.pt")
        assert m.state == "durable" and f.state is FileState.DURABLE
        assert h.reassemble(m) == data
    finally:
        h.close()
