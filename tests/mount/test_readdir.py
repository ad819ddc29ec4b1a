"""Directory listings: READDIRPLUS binds an inode for each entry it sends and
for no other, at offsets that keep meaning the same entry while names come
and go; and the inode table's index of named children, by which a directory
the kernel forgot stays while its children need it and goes with the last."""

from __future__ import annotations

import os
import random
import stat
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from ckptfs.fs.fuse import abi as abi
from ckptfs.fs.fuse.abi import Op
from ckptfs.fs.fuse.operations import Operations
from ckptfs.fs.fuse.session import Request
from ckptfs.fs.namespace.inodes import ROOT, InodeTable
from lifecycle_harness import CALLER, Harness
from waits import wait_for

REPLY = 4096  # the kernel's smallest READDIRPLUS buffer: about 20 entries


# ----- the inode table's children index ----------------------------------------------------


class NoFiles:
    """The cache's side of the inode table, for tables of directories only."""

    def inode_attached(self, f: Any, ino: int, unlinked: bool) -> None:
        raise AssertionError("no file is attached in these tests")

    inode_unlinked = inode_detached = inode_attached


def check(table: InodeTable) -> None:
    """The index counts by_name's names per directory; each named inode has
    that name and its parent in the table (its path can be computed); and
    nothing is kept that nothing needs (no leak)."""
    assert table.children == dict(Counter(parent for parent, _ in table.by_name))
    for (parent, name), ino in table.by_name.items():
        inode = table.by_ino[ino]
        assert (inode.parent, inode.name, inode.unlinked) == (parent, name, False)
        assert parent in table.by_ino, (parent, name)
    for ino, inode in table.by_ino.items():
        named_dir = inode.kind == "dir" and not inode.unlinked and ino in table.children
        assert ino == ROOT or inode.nlookup or inode.opens or named_dir, inode


def test_a_directory_forgotten_before_its_child_goes_with_it() -> None:
    """The kernel's BATCH_FORGET may name a directory before its child."""
    table = InodeTable(NoFiles())
    d = table.bind(ROOT, "d", "dir", ("dir", 1))
    d.nlookup = 1
    sub = table.bind(d.ino, "sub", "dir", ("dir", 2))
    sub.nlookup = 1
    f = table.bind(sub.ino, "f", "plain", ("plain", 3))
    f.nlookup = 1
    assert table.forget(d.ino, 1) is None  # kept: its child's path goes through it
    assert table.forget(sub.ino, 1) is None
    assert table.forget(f.ino, 1) is f
    assert set(table.by_ino) == {ROOT} and not table.by_name


def test_the_children_index_stays_true_through_every_change() -> None:
    """Random lookups (some finding another file at a name), forgets, opens
    and closes, unlinks, rmdirs and renames, as the kernel and the filesystem
    make them; after each the index and the table agree, and once the
    kernel forgets everything only the root is left."""
    rng = random.Random(7)
    table = InodeTable(NoFiles())
    names = [f"n{i}" for i in range(6)]
    serial = iter(range(10, 1 << 30))

    def held() -> list[Any]:
        """What the kernel holds a reference to (named or not)."""
        return [i for i in table.by_ino.values() if i.nlookup and i.ino != ROOT]

    def named() -> list[Any]:
        return [i for i in held() if not i.unlinked]

    def dirs() -> list[Any]:
        return [table[ROOT], *(i for i in named() if i.kind == "dir")]

    def full_dir(inode: Any) -> bool:
        return inode is not None and inode.kind == "dir" and inode.ino in table.children

    def under(ino: int, top: int) -> bool:
        while ino != ROOT:
            if ino == top:
                return True
            ino = table[ino].parent
        return False

    for _ in range(4000):
        op = rng.choice(("lookup", "lookup", "forget", "open", "unlink", "rename"))
        if op == "lookup":
            parent = rng.choice(dirs())
            there = table.child(parent.ino, name := rng.choice(names))
            if there is not None and (full_dir(there) or rng.random() < 0.8):
                kind, ident = there.kind, there.ident  # what was there
            else:  # another file put there meanwhile (never over a full directory)
                kind = rng.choice(("dir", "plain", "file"))
                ident = (kind, next(serial))
            table.bind(parent.ino, name, kind, ident).nlookup += 1
        elif op == "forget" and (candidates := held()):
            inode = rng.choice(candidates)
            table.forget(inode.ino, rng.randint(1, inode.nlookup))
        elif op == "open" and (candidates := held()):
            inode = rng.choice(candidates)
            if inode.opens and rng.random() < 0.6:
                inode.opens -= 1
                if not inode.nlookup and not inode.opens:
                    table.forget(inode.ino, 0)  # as release does
            else:
                inode.opens += 1
        elif op == "unlink" and (candidates := named()):
            inode = rng.choice(candidates)
            if not full_dir(inode):  # rmdir: of an empty directory only
                table.detach(inode.parent, inode.name)
        elif op == "rename" and (candidates := named()):
            inode = rng.choice(candidates)
            parent = rng.choice([p for p in dirs() if not under(p.ino, inode.ino)])
            there = table.child(parent.ino, name := rng.choice(names))
            if not full_dir(there):  # not over a directory that is not empty
                table.move(inode, parent.ino, name)
        check(table)

    for inode in list(table.by_ino.values()):  # every handle closed
        if inode.opens:
            inode.opens = 0
            table.forget(inode.ino, 0)
    forgets = [(i.ino, i.nlookup) for i in held()]
    rng.shuffle(forgets)  # parents before their children too
    for ino, count in forgets:
        table.forget(ino, count)
        check(table)
    assert set(table.by_ino) == {ROOT} and not table.by_name and not table.children


# ----- the listing's parsed manifests ---------------------------------------------------------


def test_many_plain_files_push_no_manifest_out_of_the_parsed_cache(
    tmp_path: Path, monkeypatch: Any
) -> None:
    """A listing opens every regular file to tell a manifest from a plain
    file; what it found is kept by the file's identity. Plain files count
    only their entries against the bound, not their size: a directory of
    many (more than the bound's worth of bytes) is told apart from memory at
    the next listing, and pushes no manifest out."""
    import time

    from ckptfs.fs.store import manifest as manifest_mod
    from ckptfs.fs.store.manifest import Manifest, ParsedManifests, new_id, write_manifest

    parsed = ParsedManifests(max_bytes=1 << 20)
    m = Manifest(new_id(), new_id(), 5, 0o644, time.time_ns(), "durable")
    write_manifest(tmp_path / "m", m)
    plain = [tmp_path / f"p{i:04d}" for i in range(600)]
    for p in plain:
        p.write_bytes(b"x" * 4096)  # 2.4 MB of plain files for a 1 MiB bound

    reads = 0
    real = manifest_mod.manifest_from_fd

    def counting(*args: Any) -> Any:
        nonlocal reads
        reads += 1
        return real(*args)

    monkeypatch.setattr(manifest_mod, "manifest_from_fd", counting)

    def listing() -> list[Any]:
        out = []
        for p in [tmp_path / "m", *plain]:
            fd = os.open(p, os.O_RDONLY)
            try:
                out.append(parsed.read(fd, str(p)))
            finally:
                os.close(fd)
        return out

    first = listing()
    assert first[0] == m and first[1:] == [None] * len(plain) and reads == 1 + len(plain)
    assert listing() == first and reads == 1 + len(plain)  # all from memory


# ----- READDIRPLUS, without FUSE ------------------------------------------------------------


def record_size(namelen: int) -> int:
    """The bytes of a fuse_direntplus with a name of ``namelen`` (8-aligned)."""
    return -(-(abi.ENTRY_OUT.size + abi.DIRENT.size + namelen) // 8) * 8


def records(reply: bytes) -> list[tuple[int, str, tuple[int, ...]]]:
    """(offset, name, fuse_attr fields) of each fuse_direntplus in a reply,
    after checking that the entry's node id and the dirent's ino agree."""
    out = []
    pos = 0
    while pos < len(reply):
        entry = abi.ENTRY_OUT.unpack_from(reply, pos)
        ino, off, namelen, kind = abi.DIRENT.unpack_from(reply, pos + abi.ENTRY_OUT.size)
        start = pos + abi.ENTRY_OUT.size + abi.DIRENT.size
        name = reply[start : start + namelen].decode()
        attr = entry[6:]
        assert entry[0] == ino == attr[0], name
        assert kind == (attr[9] >> 12) & 0o17
        out.append((off, name, attr))
        pos += record_size(namelen)
    assert pos == len(reply)
    return out


class Lister:
    """READDIRPLUS requests through Operations, as the kernel sends them."""

    def __init__(self, h: Harness, dino: int) -> None:
        self.h = h
        self.ops = Operations(h.core.fs, writeback_cache=False)
        body = memoryview(abi.OPEN_IN.pack(0, 0))
        opened = h.call(self.ops.opendir, Request(Op.OPENDIR, 1, dino, 0, 0, 1, body))
        self.fh = abi.OPEN_OUT.unpack(opened)[0]
        self.dino = dino

    def read(self, offset: int, size: int = REPLY) -> list[tuple[int, str, tuple[int, ...]]]:
        body = memoryview(abi.READ_IN.pack(self.fh, offset, size, 0, 0, 0, 0))
        reply = self.h.call(
            self.ops.readdirplus, Request(Op.READDIRPLUS, 2, self.dino, 0, 0, 1, body)
        )
        return records(reply)

    def close(self) -> None:
        body = memoryview(abi.RELEASE_IN.pack(self.fh, 0, 0, 0))
        self.ops.releasedir_now(Request(Op.RELEASEDIR, 3, self.dino, 0, 0, 1, body))


def written(h: Harness, dino: int, name: str, data: bytes) -> int:
    """A file created, written and closed through the filesystem; its inode."""
    fs = h.core.fs
    fh, attr = h.call(fs.create, dino, name, 0o640, os.O_WRONLY, CALLER)
    h.call(fs.write, fh, 0, data)
    h.call(fs.release, fh)
    return attr.ino


def test_readdirplus_binds_and_counts_only_what_it_sends(h: Harness, monkeypatch: Any) -> None:
    """Across many requests, with names added and removed between them (in
    the store directly and through the filesystem): every name that stayed
    comes exactly once, none twice, at consecutive offsets, with its own
    attributes; each request computes attributes for, binds and counts a
    kernel reference for exactly the entries it sends; a request from an
    earlier offset sends the same entries again; once the kernel forgets
    what it got, the table is as before."""
    fs = h.core.fs
    dino = h.call(fs.mkdir, ROOT, "many", 0o755, CALLER).ino
    d = h.backing / "many"
    sizes = {f"p{i:04d}": i % 251 for i in range(600)}
    for name, size in sizes.items():
        (d / name).write_bytes(b"x" * size)
    mine = {f"w{i:02d}": 1000 + i for i in range(12)}
    created = {written(h, dino, name, b"y" * size) for name, size in mine.items()}
    h.direct(h.background_steps, 200)
    sizes.update(mine)
    before = set(fs.inodes.by_ino)

    computed = 0
    real_attr = fs._attr

    def counting_attr(*args: Any) -> Any:
        nonlocal computed
        computed += 1
        return real_attr(*args)

    monkeypatch.setattr(fs, "_attr", counting_attr)
    lister = Lister(h, dino)
    rng = random.Random(3)
    seen: list[tuple[int, str, tuple[int, ...]]] = []
    changed: set[str] = set()
    offset = 0
    while True:
        computed, known = 0, set(fs.inodes.by_ino)
        got = lister.read(offset)
        if not got:
            break
        assert computed == len(got)  # attributes of what is sent only
        new = {attr[0] for _, _, attr in got} - known
        assert set(fs.inodes.by_ino) - known == new  # bound: what is sent only
        assert [off for off, _, _ in got] == list(range(offset + 1, offset + len(got) + 1))
        seen += got
        offset = got[-1][0]
        # Between two requests, names not sent yet removed (in the store,
        # or through the filesystem) and a name added.
        unseen = sorted(set(sizes) - {n for _, n, _ in seen} - changed)
        for name in rng.sample(unseen, min(2, len(unseen))):
            changed.add(name)
            if name in mine:
                h.call(fs.unlink, dino, name)
            else:
                (d / name).unlink()
        (d / f"new{offset:05d}").write_bytes(b"z")
        changed.add(f"new{offset:05d}")
    # An earlier offset still means the same entry (the kernel may resume
    # from any it was given): the same names again, from the start and from
    # the middle (seen[i] is at offset i + 1).
    first = lister.read(0)
    middle = seen[len(seen) // 2][0]
    more = lister.read(middle)
    assert [(o, n) for o, n, _ in first] == [(o, n) for o, n, _ in seen[: len(first)]]
    assert [(o, n) for o, n, _ in more] == [(o, n) for o, n, _ in seen[middle : middle + len(more)]]
    lister.close()

    names = [n for _, n, _ in seen]
    assert len(names) == len(set(names))  # no name twice
    assert set(sizes) - changed <= set(names)  # every name that stayed
    for _, name, attr in seen:
        ino, size, mode = attr[0], attr[1], attr[9]
        assert fs.inodes[ino].name == name and fs.inodes[ino].parent == dino
        if name in changed:
            continue
        assert size == sizes[name] and stat.S_ISREG(mode), name
        assert mode & 0o777 == (0o640 if name in mine else (d / name).stat().st_mode & 0o777)
        assert (ino in created) == (name in mine), name  # the inode the kernel knew
    # One reference per entry sent (and the create's, of a file created here).
    sent = Counter(attr[0] for _, _, attr in seen + first + more)
    for ino, count in sent.items():
        assert fs.inodes[ino].nlookup == count + (ino in created), fs.inodes[ino]

    for _, _, attr in seen + first + more:  # the kernel forgets what it was sent
        fs.forget(attr[0], 1)
    assert set(fs.inodes.by_ino) == before
    check(fs.inodes)


def test_a_large_reply_lets_other_tasks_run_and_if_cancelled_counts_nothing(
    h: Harness,
) -> None:
    """A reply of thousands of entries (a getdents of 1 MiB) binds them in
    batches, other tasks running between; cancelled meanwhile, it takes
    back every reference it counted, as the kernel got none."""
    import trio

    fs = h.core.fs
    dino = h.call(fs.mkdir, ROOT, "big", 0o755, CALLER).ino
    for i in range(2000):
        (h.backing / "big" / f"f{i:05d}").write_bytes(b"")
    lister = Lister(h, dino)
    assert len(lister.read(0, record_size(len("f00000")))) == 1  # the listing is read
    before = {i: n.nlookup for i, n in fs.inodes.by_ino.items()}

    async def cancelled_midway() -> list[int]:
        turns = 0
        at: list[int] = []  # other tasks' turns when each name was asked about

        async def other() -> None:
            nonlocal turns
            while True:
                await trio.sleep(0)
                turns += 1

        async with trio.open_nursery() as nursery:
            nursery.start_soon(other)
            await trio.sleep(0)
            with trio.CancelScope() as scope:

                def fits(name: str) -> bool:
                    at.append(turns)
                    if len(at) == 1500:
                        scope.cancel()
                    return True

                await fs.readdir(lister.fh, 1, fits)
            nursery.cancel_scope.cancel()
        return at

    at = h.direct(cancelled_midway)
    assert 1500 <= len(at) < 1999 and at[-1] > at[0]  # cut short; others ran between
    assert {i: n.nlookup for i, n in fs.inodes.by_ino.items()} == before
    got = lister.read(1, 1 << 20)  # and then sent in full
    assert [off for off, _, _ in got] == list(range(2, 2001))
    assert all(fs.inodes[attr[0]].nlookup == 1 for _, _, attr in got)
    lister.close()


# ----- through a real mount ----------------------------------------------------------------


def inodes_of(m: Any) -> int:
    return int(m.stat()["fuse"]["inodes"])


def test_a_large_directory_listed_while_names_change(mounted: Any) -> None:
    """A listing by readdir(3) (many READDIRPLUS), names created and removed
    through the mount and in the store between its reads: each name that
    stayed comes exactly once with its own size and inode, none twice; a
    new listing shows what is there now; then the kernel forgets
    (drop_caches) and the daemon's table shrinks back to the root."""
    if os.geteuid() != 0:
        pytest.skip("dropping the kernel's caches takes root")
    m = mounted
    d = m.mnt / "ckpt"
    d.mkdir()
    sizes = {f"plain-{i:05d}": i % 509 for i in range(2500)}
    for name, size in sizes.items():
        (m.backing / "ckpt" / name).write_bytes(b"p" * size)
    mine = {f"mine-{i:03d}": 700 + i for i in range(150)}
    for name, size in mine.items():
        (d / name).write_bytes(b"m" * size)
    m.wait_durable()
    sizes.update(mine)

    def forgotten() -> bool:
        Path("/proc/sys/vm/drop_caches").write_text("2\n")
        return inodes_of(m) == 1  # the root

    wait_for(forgotten, 30, "the kernel to forget every inode")
    rng = random.Random(5)
    now = set(sizes)
    changed: set[str] = set()
    seen: list[tuple[str, int, int]] = []
    with os.scandir(d) as it:
        for n, entry in enumerate(it):
            if entry.name in changed:  # removed after glibc read it in
                seen.append((entry.name, entry.inode(), -1))
            else:
                st = entry.stat(follow_symlinks=False)  # what READDIRPLUS gave the kernel
                assert st.st_ino == entry.inode()
                seen.append((entry.name, entry.inode(), st.st_size))
            if n % 200 == 0:
                gone = set(rng.sample(sorted(now - {s[0] for s in seen}), 3))
                for name in gone:
                    os.unlink(d / name)
                (m.backing / "ckpt" / f"added-{n}").write_bytes(b"a")
                (d / f"made-{n}").write_bytes(b"b")
                added = {f"added-{n}", f"made-{n}"}
                now = (now - gone) | added
                changed |= gone | added
    names = [s[0] for s in seen]
    assert len(names) == len(set(names))
    assert set(sizes) - changed <= set(names)
    for name, ino, size in seen:
        if name not in changed:
            assert size == sizes[name], name
            assert os.lstat(d / name).st_ino == ino, name  # the inode the kernel kept
    assert set(os.listdir(d)) == now
    wait_for(forgotten, 30, "every inode of the listings forgotten")
