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

from ckptfs.fs.namespace.inodes import ROOT
from lifecycle_harness import CALLER, SIZE, Harness, errno_of, name_reads, save


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
