"""A read-only open whose manifest check is due (close-to-open, older than
``fuse.open_recheck``), and a lookup of a name whose inode we hold, checked
by the FUSE request thread itself: it reads the manifest with the state
lock let go (``Backing.entry_here``; its session bounds the read, see
test_storecall.py and test_fusesession.py), and
answers only if the manifest still names our copy's version and nothing was
renamed or removed meanwhile (``FileSystem.open_check_wanted`` /
``open_checked``, ``lookup_check_wanted`` / ``lookup_checked``); otherwise
the loop answers the usual way. Driven without FUSE as the session drives
it, then through real mounts sharing one backing directory.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time
from typing import Any

import pytest
from ckptfs.fs.inodes import ROOT
from lifecycle_harness import Harness
from test_fast_paths import inline, tables
from test_getattr import CALLER, close, opened, rewrite_elsewhere, save


def test_a_due_check_is_made_off_the_loop_and_the_open_answered(
    h: Harness, monkeypatch: Any
) -> None:
    fs = h.core.fs
    ino, fh = opened(h, "k.pt")
    close(h, fh)
    monkeypatch.setattr(fs.config, "open_recheck", 0.0)
    assert inline(h, fs.open_now, ino, os.O_RDONLY, CALLER) is None  # the check is due
    check = inline(h, fs.open_check_wanted, ino, os.O_RDONLY)
    assert check is not None and check.path == "k.pt" and check.f is fs.inodes[ino].file
    before = tables(h)
    entry = fs.backing.entry_here(check.path)  # off the loop, as the request thread does
    assert entry is not None and entry.manifest is not None
    assert tables(h) == before  # reading changed nothing
    got = inline(h, fs.open_checked, check, entry, CALLER)
    assert got is not None
    fh2, keep = got
    assert keep  # the kernel's pages are of this very version
    assert fs.handles[fh2].file is check.f and not fs.handles[fh2].writable
    assert fs.inodes[ino].checked_at == entry.read_at  # recorded, as the loop's check does
    close(h, fh2)
    # Nothing else is planned: writable opens, directories.
    assert inline(h, fs.open_check_wanted, ino, os.O_WRONLY) is None
    assert inline(h, fs.open_check_wanted, ROOT, os.O_RDONLY) is None


def test_a_rename_done_here_is_the_moved_file_s_check(h: Harness, monkeypatch: Any) -> None:
    """torch.save to a temporary name, then os.replace: the rename's own
    store call read the source's manifest just before it renamed it, under
    the namespace lock. That read is the moved file's check, so the first
    open after the rename needs no store read; its ctime is the rename's,
    and it runs out like any other check."""
    fs = h.core.fs
    monkeypatch.setattr(fs.config, "open_recheck", 10.0)
    data = random.randbytes(70_000)
    save(h, "m.pt.tmp", data)  # closed, pending: not flushed yet
    renamed_after = time.time_ns()
    h.call(fs.rename, ROOT, "m.pt.tmp", ROOT, "m.pt", 0)
    inode = fs.inodes.child(ROOT, "m.pt")
    assert inode is not None and inode.file is not None
    assert inode.checked is not None and inode.checked.manifest is not None
    assert inode.checked.manifest.version == inode.file.version
    attr = inline(h, fs.getattr_now, inode.ino)
    assert attr is not None and attr.size == len(data) and attr.ctime_ns >= renamed_after
    got = inline(h, fs.open_now, inode.ino, os.O_RDONLY, CALLER)
    assert got is not None  # no check due
    close(h, got[0])
    monkeypatch.setattr(fs.config, "open_recheck", 0.0)
    assert inline(h, fs.open_now, inode.ino, os.O_RDONLY, CALLER) is None


def test_a_checked_open_declines_whatever_changed(h: Harness, monkeypatch: Any) -> None:
    """Each decline leaves the tables as they were; the loop's open then
    reads the manifest again and does what it does (ESTALE, a reload)."""
    fs = h.core.fs
    monkeypatch.setattr(fs.config, "open_recheck", 0.0)

    def declined(name: str, meanwhile: Any) -> None:
        ino, fh = opened(h, name)
        close(h, fh)
        check = inline(h, fs.open_check_wanted, ino, os.O_RDONLY)
        assert check is not None
        entry = meanwhile(check) or fs.backing.entry_here(check.path)
        assert entry is not None
        before = tables(h)
        assert inline(h, fs.open_checked, check, entry, CALLER) is None
        assert tables(h) == before

    # Another node's new version at the name.
    declined("m.pt", lambda check: rewrite_elsewhere(h, "m.pt", os.urandom(100)))

    def renamed(check: Any) -> Any:
        entry = fs.backing.entry_here(check.path)  # read before the rename...
        h.call(fs.rename, ROOT, "n.pt", ROOT, "o.pt", 0)  # ...and answered after it
        return entry

    declined("n.pt", renamed)

    def rewritten_here(check: Any) -> None:
        fh_w, _ = h.call(fs.open, check.inode.ino, os.O_WRONLY | os.O_TRUNC, CALLER)
        h.call(fs.write, fh_w, 0, b"new")  # our copy is now the one to read

    declined("p.pt", rewritten_here)


def test_a_lookup_of_a_held_name_is_checked_off_the_loop(h: Harness) -> None:
    """The kernel looks a cached name up again once its entry timeout (1 s)
    ran out: answered as the loop's lookup would, the lookup counted."""
    fs = h.core.fs
    ino, fh = opened(h, "l.pt")
    close(h, fh)
    inode = fs.inodes[ino]
    nlookup = inode.nlookup
    check = inline(h, fs.lookup_check_wanted, ROOT, "l.pt")
    assert check is not None and check.inode is inode and check.path == "l.pt"
    entry = fs.backing.entry_here(check.path)
    assert entry is not None
    attr = inline(h, fs.lookup_checked, ROOT, "l.pt", check, entry)
    assert attr is not None and attr.ino == ino
    assert inode.nlookup == nlookup + 1 and inode.checked_at == entry.read_at
    _same(h.call(fs.lookup, ROOT, "l.pt"), attr, "ino", "size", "mode", "mtime_ns")
    assert inode.nlookup == nlookup + 2
    assert inline(h, fs.lookup_check_wanted, ROOT, "missing.pt") is None  # a new name

    # Another node's new version at the name, or a rename meanwhile: declined,
    # nothing counted; the loop's lookup binds the new version to a new inode.
    def declined(name: str, meanwhile: Any) -> None:
        ino, fh = opened(h, name)
        close(h, fh)
        _lookup_declined(h, name, ino, meanwhile)

    declined("v.pt", lambda check: rewrite_elsewhere(h, "v.pt", os.urandom(100)))
    assert h.call(fs.lookup, ROOT, "v.pt").size == 100
    declined("w.pt", _renamed_meanwhile(h, "w.pt", "x.pt"))


def _same(on_loop: Any, off_loop: Any, *fields: str) -> None:
    """The loop's answer and the thread's agree on ``fields``."""
    assert [getattr(on_loop, k) for k in fields] == [getattr(off_loop, k) for k in fields]


def _lookup_declined(h: Harness, name: str, ino: int, meanwhile: Any) -> None:
    """A checked lookup of ``name`` (inode ``ino``) with ``meanwhile(check)``
    run between its plan and its answer (returning the entry it read, or
    None): declined, with nothing changed or counted."""
    fs = h.core.fs
    check = inline(h, fs.lookup_check_wanted, ROOT, name)
    assert check is not None
    entry = meanwhile(check) or fs.backing.entry_here(check.path)
    before = (tables(h), fs.inodes[ino].nlookup)
    assert inline(h, fs.lookup_checked, ROOT, name, check, entry) is None
    assert (tables(h), fs.inodes[ino].nlookup) == before


def _renamed_meanwhile(h: Harness, old: str, new: str) -> Any:
    """A ``meanwhile`` for :func:`_lookup_declined`: the entry is read, then
    the name renamed through the mount."""

    def renamed(check: Any) -> Any:
        entry = h.core.fs.backing.entry_here(check.path)
        h.call(h.core.fs.rename, ROOT, old, ROOT, new, 0)
        return entry

    return renamed


def test_a_lookup_of_a_held_directory_is_checked_off_the_loop(h: Harness) -> None:
    """Every step of a path walk is looked up again once its entry ran out:
    a directory we hold is answered as the loop's lookup would (the same
    inode, counted); another directory at the name, or a rename meanwhile,
    is declined with nothing changed."""
    fs = h.core.fs
    for name in ("d", "e", "r"):
        h.call(fs.mkdir, ROOT, name, 0o755, CALLER)
    attr = h.call(fs.lookup, ROOT, "d")
    inode = fs.inodes[attr.ino]
    nlookup = inode.nlookup
    check = inline(h, fs.lookup_check_wanted, ROOT, "d")
    assert check is not None and check.inode is inode and check.f is None and check.path == "d"
    entry = fs.backing.entry_here(check.path)
    got = inline(h, fs.lookup_checked, ROOT, "d", check, entry)
    assert got is not None and got.ino == attr.ino and inode.nlookup == nlookup + 1
    _same(h.call(fs.lookup, ROOT, "d"), got, "ino", "mode", "nlink", "mtime_ns")

    def replaced_elsewhere(check: Any) -> None:  # another node's rmdir, and a rename
        os.mkdir(fs.backing.root / "other")
        os.rmdir(fs.backing.root / "e")
        os.rename(fs.backing.root / "other", fs.backing.root / "e")

    old = h.call(fs.lookup, ROOT, "e").ino
    _lookup_declined(h, "e", old, replaced_elsewhere)
    assert h.call(fs.lookup, ROOT, "e").ino != old  # the loop binds the new one
    _lookup_declined(h, "r", h.call(fs.lookup, ROOT, "r").ino, _renamed_meanwhile(h, "r", "s"))


def test_a_getattr_due_is_checked_off_the_loop(h: Harness, monkeypatch: Any) -> None:
    """A stat the fast path declines (a closed file's check too old, a
    directory's attributes older than their reuse): answered as getattr()
    would with the entry the thread read."""
    fs = h.core.fs
    ino, fh = opened(h, "g.pt")
    close(h, fh)
    monkeypatch.setattr(fs.config, "open_recheck", 0.0)
    assert inline(h, fs.getattr_now, ino) is None
    check = inline(h, fs.getattr_check_wanted, ino)
    entry = fs.backing.entry_here(check.path)
    assert entry is not None
    attr = inline(h, fs.getattr_checked, check, entry)
    assert attr is not None and fs.inodes[ino].checked_at == entry.read_at
    _same(h.call(fs.getattr, ino), attr, "ino", "size", "mode", "mtime_ns")
    root = inline(h, fs.getattr_check_wanted, ROOT)
    assert root.path == ""
    root_entry = fs.backing.entry_here(root.path)
    got = inline(h, fs.getattr_checked, root, root_entry)
    assert got is not None and got.ino == ROOT
    assert fs.inodes[ROOT].dir_attrs is root_entry  # reused by the next stats
    check = inline(h, fs.getattr_check_wanted, ino)
    entry = fs.backing.entry_here(check.path)
    h.call(fs.rename, ROOT, "g.pt", ROOT, "h.pt", 0)  # meanwhile: declined
    assert inline(h, fs.getattr_checked, check, entry) is None


def test_no_read_of_its_own_while_the_store_is_not_healthy(h: Harness) -> None:
    fs = h.core.fs
    ino, fh = opened(h, "q.pt")
    close(h, fh)
    fs.backing.io.health = "slow"
    try:
        assert fs.backing.entry_here("q.pt") is None
    finally:
        fs.backing.io.health = "normal"
    assert fs.backing.entry_here("q.pt") is not None


def _opens(path: str, n: int) -> bytes:
    """``n`` opens of ``path`` (each read whole) by another process; the last bytes."""
    script = (
        "import sys\n"
        "for _ in range(int(sys.argv[2])):\n"
        "    with open(sys.argv[1], 'rb') as f:\n"
        "        data = f.read()\n"
        "sys.stdout.buffer.write(data)\n"
    )
    return subprocess.run(
        [sys.executable, "-c", script, path, str(n)], check=True, capture_output=True, timeout=60
    ).stdout


def test_opens_through_a_mount_are_checked_by_the_request_thread(mounts: Any) -> None:
    """Two unpeered mounts of one backing directory, every open re-reading
    the manifest (fuse.open_recheck: 0): a reader's opens are checked by the
    request thread, and a new version written through the other mount is
    what the next open reads, whole."""
    env = {"CKPTFS_FUSE_OPEN_RECHECK": "0"}
    a, b = mounts("a"), mounts("b")
    a.mount(env=env)
    b.mount(env=env)
    first, second = os.urandom(3 * 4096 + 11), os.urandom(2 * 4096 + 5)
    (a.mnt / "ckpt.pt").write_bytes(first)
    a.cli("flush", str(a.mnt), "--wait")
    assert _opens(str(b.mnt / "ckpt.pt"), 1) == first  # b's lookup and first open
    before = b.stat()["fuse"]["requests"]["checked"]
    assert _opens(str(b.mnt / "ckpt.pt"), 20) == first
    checked = b.stat()["fuse"]["requests"]["checked"] - before
    assert checked >= 15, checked  # (one that meets the loop mid-turn is the loop's)
    (a.mnt / "ckpt.pt.tmp").write_bytes(second)
    os.replace(a.mnt / "ckpt.pt.tmp", a.mnt / "ckpt.pt")
    a.cli("flush", str(a.mnt), "--wait")
    assert _opens(str(b.mnt / "ckpt.pt"), 1) == second
    assert _opens(str(b.mnt / "ckpt.pt"), 5) == second
    time.sleep(1.2)  # past the kernel's entry timeout: the next stat looks the name up
    before = b.stat()["fuse"]["requests"]["checked"]
    assert os.stat(b.mnt / "ckpt.pt").st_size == len(second)
    assert b.stat()["fuse"]["requests"]["checked"] > before
    assert "after its own store read" in b.cli("stat", str(b.mnt)).stdout
    b.umount()
    a.umount()


def test_a_path_walk_after_its_entries_expired_stays_off_the_loop(mounts: Any) -> None:
    """``run/step-N/model.pt`` stat'ed and read again after the kernel's
    entries ran out (1 s): the lookups of both directories and of the file,
    and the open, are answered by the request thread, none by a worker."""
    m = mounts("w")
    m.mount()
    data = os.urandom(2 * 4096 + 3)
    (m.mnt / "run" / "step-7").mkdir(parents=True)
    (m.mnt / "run" / "step-7" / "model.pt").write_bytes(data)
    m.cli("flush", str(m.mnt), "--wait")
    assert _opens(str(m.mnt / "run" / "step-7" / "model.pt"), 1) == data
    for _ in range(2):
        time.sleep(1.3)  # past the entry timeout, and the check's reuse
        before = m.stat()["fuse"]["requests"]
        assert os.stat(m.mnt / "run" / "step-7" / "model.pt").st_size == len(data)
        assert _opens(str(m.mnt / "run" / "step-7" / "model.pt"), 1) == data
        after = m.stat()["fuse"]["requests"]
        assert after["checked"] - before["checked"] >= 3, (before, after)
        assert after["handled"] == before["handled"], (before, after)
    m.umount()


def test_a_torch_checkpoint_loads_whole_with_every_open_checked(mounts: Any) -> None:
    torch = pytest.importorskip("torch")
    m = mounts("t")
    m.mount(env={"CKPTFS_FUSE_OPEN_RECHECK": "0"})
    gen = torch.Generator().manual_seed(5)
    sd = {f"w{i}": torch.randn(4096 + i, generator=gen) for i in range(8)}
    torch.save(sd, m.mnt / "model.pt")
    m.cli("flush", str(m.mnt), "--wait")
    for _ in range(3):
        got = torch.load(m.mnt / "model.pt", mmap=True, weights_only=True)
        assert got.keys() == sd.keys()
        assert all(torch.equal(got[k], sd[k]) for k in sd)
        del got
    assert m.stat()["fuse"]["requests"]["checked"] >= 3
    m.umount()


def test_a_checkpoint_saved_and_replaced_here_loads_through_the_request_thread(
    mounts: Any,
) -> None:
    """torch.save to a temporary name, os.replace, then torch.load(mmap=True)
    through the same mount: every request of the load (the opens, and the
    reads of bytes the save left in RAM) is answered by the request thread
    or the loop inline, none by a worker; the open needs no store read of its
    own (the rename's was its check); and every tensor comes back."""
    torch = pytest.importorskip("torch")
    m = mounts("s")
    m.mount(env={"CKPTFS_FUSE_OPEN_RECHECK": "10"})
    gen = torch.Generator().manual_seed(11)
    sd = {f"w{i}": torch.randn(3000 + 7 * i, generator=gen) for i in range(6)}
    # The kernel's entry of the name dates from the temporary name's CREATE:
    # a rename moves that entry as it is.
    created_at = time.monotonic()
    torch.save(sd, m.mnt / "model.pt.tmp")
    os.replace(m.mnt / "model.pt.tmp", m.mnt / "model.pt")
    m.cli("flush", str(m.mnt), "--wait")  # the flusher is done: the loop is idle
    # The rename made the kernel drop the root's attributes: its path walk
    # asks again, a checked GETATTR of the root (after 0.5 s, DIR_ATTR_REUSE)
    # that is no part of the open's check. Asked here, before the count.
    os.stat(m.mnt)
    before = m.stat()["fuse"]["requests"]
    got = torch.load(m.mnt / "model.pt", mmap=True, weights_only=True)
    assert got.keys() == sd.keys()
    assert all(torch.equal(got[k], sd[k]) for k in sd)
    del got
    after = m.stat()["fuse"]["requests"]
    assert after["handled"] == before["handled"], (before, after)
    assert after["thread"] > before["thread"], (before, after)
    if time.monotonic() - created_at < 0.9:  # (later, the kernel looks the name up again)
        assert after["checked"] == before["checked"], (before, after)  # the rename's check
    m.umount()
