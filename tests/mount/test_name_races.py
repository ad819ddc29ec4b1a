"""Names changing under a path walk: the bytes a resolved inode reads.

The kernel resolves a path to an inode (LOOKUP) and opens it afterwards; an
unlink or a rename over the name can fall in between, from this process or
another. On any POSIX filesystem the open then gets the file the walk
resolved. ckptfs used to drop an unlinked file's bytes as soon as no handle
was open, so such an open read zeros (or, through the kernel's page cache,
a mix of the old bytes and zeros): ``torch.load`` of a checkpoint being
replaced by ``os.replace`` returned wrong tensors about once in a thousand
loads (tests/frameworks/test_frameworks_replace.py, in CI).

These drive the filesystem without FUSE (lifecycle_harness.py), the kernel's
part played by the test; the last test checks on a real mount that the
kernel does forget a removed file's inode, so its memory is not held.
"""

from __future__ import annotations

import errno
import os
import random
import shutil
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import trio
import trio.testing
from ckptfs.fs.content.state import FileState
from ckptfs.fs.namespace.inodes import ROOT
from ckptfs.fs.namespace.posix import Caller, SetAttr
from ckptfs.fs.store.manifest import MAGIC
from lifecycle_harness import (
    CALLER,
    SIZE,
    Harness,
    audit,
    close,
    name_reads,
    read_handle,
    read_inode,
    save,
)
from waits import wait_for


def close_and_flush(h: Harness, *fhs: int) -> None:
    """close() of each handle (FLUSH, then RELEASE); then the flusher runs."""
    close(h, *fhs)
    h.direct(h.background_steps, 100)


def forget(h: Harness, ino: int) -> None:
    async def run() -> None:
        inode = h.core.fs.inodes.get(ino)
        h.core.fs.forget(ino, inode.nlookup if inode is not None else 0)

    h.direct(run)


def held(h: Harness, file_id: str) -> bool:
    return any(f.file_id == file_id for f in h.core.cache.all_files())


def consistent(h: Harness) -> None:
    async def run() -> list[str]:
        return audit(h.core)

    assert h.direct(run) == []


@pytest.mark.parametrize("before", ["pending", "durable", "durable-evicted"])
def test_an_inode_resolved_before_a_replace_opens_the_old_bytes(h: Harness, before: str) -> None:
    old, new = random.randbytes(SIZE), random.randbytes(SIZE)
    first = save(h, "model.pt", old)
    if before != "pending":
        h.direct(h.background_steps, 100)
        assert h.core.fs.inodes[first].file.state is FileState.DURABLE
    if before == "durable-evicted":
        h.core.evict("")
    ino = h.call(h.core.fs.lookup, ROOT, "model.pt").ino  # the walk resolved the name
    old_id = h.core.fs.inodes[ino].file.file_id
    save(h, "model.pt.tmp", new)
    h.call(h.core.fs.rename, ROOT, "model.pt.tmp", ROOT, "model.pt", 0)
    h.direct(h.background_steps, 100)  # the new version flushed meanwhile
    consistent(h)
    assert read_inode(h, ino) == old  # then the walk opens it
    assert held(h, old_id)  # the kernel has not forgotten the inode yet
    forget(h, ino)
    assert not held(h, old_id), "a forgotten, unlinked file still holds memory"
    consistent(h)
    new_ino = h.call(h.core.fs.lookup, ROOT, "model.pt").ino
    assert new_ino != ino
    assert read_inode(h, new_ino) == new


def test_an_unlinked_file_lives_until_its_last_handle_and_inode(h: Harness) -> None:
    data = random.randbytes(SIZE)
    ino = save(h, "a", data)
    fs = h.core.fs
    file_id = fs.inodes[ino].file.file_id
    fh, _ = h.call(fs.open, ino, os.O_RDONLY, CALLER)
    h.call(fs.unlink, ROOT, "a")
    h.call(fs.release, fh)
    assert held(h, file_id)  # the kernel still knows the inode
    assert read_inode(h, ino) == data
    forget(h, ino)
    assert not held(h, file_id)
    h.direct(h.background_steps, 100)  # a flush that had pinned its slots gives up
    assert h.core.cache.arena.used_slots == 0
    consistent(h)


def test_a_lookup_racing_a_rename_binds_what_the_name_is(h: Harness) -> None:
    """A LOOKUP (the kernel revalidating a cached name) reads the name just
    before a rename over it and would bind the result just after: it must not
    give the name the replaced file's identity, nor take it from the file
    renamed there. It reads the name again and binds the renamed file."""
    old, new = random.randbytes(SIZE), random.randbytes(SIZE)
    old_ino = save(h, "model.pt", old)
    save(h, "model.pt.tmp", new)
    h.direct(h.background_steps, 100)
    fs = h.core.fs
    real_entry = fs.backing.entry
    read_done, go_on = trio.Event(), trio.Event()
    results: dict[str, object] = {}

    async def held_entry(path: str, *args):  # noqa: ANN202 - the backing store's Entry
        entry = await real_entry(path, *args)
        if trio.lowlevel.current_task().name.endswith("walk") and not read_done.is_set():
            read_done.set()
            await go_on.wait()
        return entry

    async def race() -> None:
        async def walk() -> None:
            results["walk"] = await fs.lookup(ROOT, "model.pt")

        async def replace() -> None:
            await fs.rename(ROOT, "model.pt.tmp", ROOT, "model.pt", 0)
            results["renamed"] = True

        h.gate.grant("fg", 10_000)
        h.gate.grant("bg", 10_000)
        fs.backing.entry = held_entry
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(walk, name="walk")
                with trio.fail_after(10):
                    await read_done.wait()  # the walk has read the old file's entry
                nursery.start_soon(replace, name="replace")
                with trio.fail_after(10):
                    while "renamed" not in results:  # lookups never hold up a rename
                        await trio.sleep(0.001)
                go_on.set()
        finally:
            fs.backing.entry = real_entry

    h.direct(race)
    bound = fs.inodes.child(ROOT, "model.pt")
    new_id = h.manifests()["model.pt"].file_id
    assert bound is not None and bound.ident == ("file", new_id)
    assert results["walk"].ino == bound.ino  # it read the name again after the rename
    assert read_inode(h, bound.ino) == new
    assert bound.file.file_id == new_id
    # The file it replaced is kept for the inode the kernel still has (from its create).
    assert read_inode(h, old_ino) == old
    forget(h, old_ino)
    consistent(h)


def test_an_open_while_a_rename_replaces_its_file_comes_after_the_rename(h: Harness) -> None:
    """torch.load(mmap=True) reads through one open and opens the path again
    for the mmap. An open that the kernel sends for the file a path walk found
    while a rename onto that name is still in flight (the rename waits for the
    backing store) waits for the rename and answers ESTALE, so that the kernel
    walks the path again and opens the new file: the load then reads one
    version, not the old one through its first open and the new one through
    its second. A thread that has the old file open already (that second
    open) gets it at once; a thread sent back once is not sent back again by
    a second rename (the kernel retries only once, then fails the open)."""
    old, new, newer = (random.randbytes(SIZE) for _ in range(3))
    ino = save(h, "model.pt", old)
    h.direct(h.background_steps, 100)
    fs = h.core.fs
    loader = Caller(0, 0, tid=101)  # in a load of model.pt: it has the file open
    fh_loading, _ = h.call(fs.open, ino, os.O_RDONLY, loader)
    save(h, "model.pt.tmp", new)
    real_rename = fs.backing.rename_reading
    events: dict[str, trio.Event] = {}
    results: dict[str, Any] = {}

    async def held_rename(*args: Any, **kw: Any) -> Any:
        events["renaming"].set()
        await events["go_on"].wait()
        return await real_rename(*args, **kw)

    async def open_as(key: str, ino: int, caller: Caller) -> None:
        try:
            results[key] = (await fs.open(ino, os.O_RDONLY, caller))[0]
        except OSError as exc:
            results[key] = errno.errorcode[exc.errno]

    async def race(source: str, other: Caller, opener: str) -> None:
        h.gate.grant("fg", 10_000)
        h.gate.grant("bg", 10_000)
        events.update(renaming=trio.Event(), go_on=trio.Event())
        results.pop("renamed", None)
        fs.backing.rename_reading = held_rename
        try:
            async with trio.open_nursery() as nursery:

                async def replace() -> None:
                    await fs.rename(ROOT, source, ROOT, "model.pt", 0)
                    results["renamed"] = True

                nursery.start_soon(replace)
                with trio.fail_after(10):
                    await events["renaming"].wait()
                target = fs.inodes.child(ROOT, "model.pt").ino
                # No answer without the wait for the rename: the fast path declines.
                assert fs.open_now(target, os.O_RDONLY, other) is None
                nursery.start_soon(open_as, opener, target, other)
                if opener == "other":
                    # The loading thread's second open: the file it reads, now.
                    opened = fs.open_now(target, os.O_RDONLY, loader)
                    assert opened is not None
                    results["loader"] = opened[0]
                await trio.testing.wait_all_tasks_blocked()
                assert opener not in results and "renamed" not in results
                events["go_on"].set()
        finally:
            fs.backing.rename_reading = real_rename

    h.direct(race, "model.pt.tmp", Caller(0, 0, tid=202), "other")
    assert results["other"] == "ESTALE"  # the kernel walks again: the new file
    assert (fs.opens_waited_for_rename, fs.opens_sent_back) == (1, 1)
    assert read_handle(h, results["loader"]) == old
    new_ino = h.call(fs.lookup, ROOT, "model.pt").ino
    assert new_ino != ino and read_inode(h, new_ino) == new

    # Its retry meets a second rename onto the name: it waits, then opens.
    save(h, "model.pt.tmp2", newer)
    h.direct(race, "model.pt.tmp2", Caller(0, 0, tid=202), "retry")
    assert read_handle(h, results["retry"]) == new
    assert (fs.opens_waited_for_rename, fs.opens_sent_back) == (2, 1)
    for fh in (fh_loading, results["loader"], results["retry"]):
        h.call(fs.release, fh)
    assert read_inode(h, h.call(fs.lookup, ROOT, "model.pt").ino) == newer
    forget(h, ino)
    forget(h, new_ino)
    consistent(h)


def test_a_rename_right_after_a_save_finds_no_flush_to_wait_for(h: Harness) -> None:
    """torch.save to a temporary name, then os.replace. The kernel holds the
    replaced file's inode lock for as long as the RENAME takes, and readers'
    lseek(SEEK_END) of it waits for that lock; a flush that started at the
    close would make the rename wait for its manifest publish. The flush
    starts ``flush.settle`` after the close: the rename finds none, and the
    file is flushed once, at its final name."""
    fs = h.core.fs
    settle = 1.0  # the save and the rename take milliseconds: well inside it
    h.core.flusher.settle = settle
    old, new = random.randbytes(SIZE), random.randbytes(SIZE)
    first = save(h, "model.pt", old)
    time.sleep(settle + 0.1)
    h.direct(h.background_steps, 100)
    assert fs.inodes[first].file.state is FileState.DURABLE
    start = time.monotonic()
    f = fs.inodes[save(h, "model.pt.tmp", new)].file
    assert f.state is FileState.PENDING and f.flushing is None
    assert not h.gate.waiting["bg"]  # the flusher waits for the settle, not at the store
    h.call(fs.rename, ROOT, "model.pt.tmp", ROOT, "model.pt", 0)
    assert time.monotonic() - start < settle, "the test's premise: all within the settle"
    assert f.flushing is None and f.path == "model.pt"
    time.sleep(settle + 0.1)
    h.direct(h.background_steps, 100)
    assert f.state is FileState.DURABLE
    manifests = h.manifests()
    assert "model.pt.tmp" not in manifests
    assert (manifests["model.pt"].file_id, manifests["model.pt"].state) == (f.file_id, "durable")
    assert name_reads(h, "model.pt") == new
    forget(h, first)
    consistent(h)


class _Died(Exception):
    pass


def test_a_daemon_dying_inside_a_rename_keeps_the_pending_file(h: Harness) -> None:
    """A rename rewrites the journal records of the pending files it moves
    in its backing-store call, just before the rename, naming both paths:
    a daemon that dies between the two recovers the file at its old path,
    one that dies after the rename at its new one."""
    fs = h.core.fs
    real = fs.backing.rename_reading
    first, second = random.randbytes(SIZE), random.randbytes(SIZE)

    async def dies_before_renaming(*args: Any, before: Any = None, **kw: Any) -> Any:
        def records_then_death() -> None:
            before()
            raise _Died

        return await real(*args, before=records_then_death, **kw)

    save(h, "model.pt.tmp", first)  # pending: the flusher has not run
    fs.backing.rename_reading = dies_before_renaming

    def recovered_at(name: str, data: bytes) -> None:
        h.crash()
        h.start()
        assert set(h.manifests()) == {name}
        assert h.manifests()[name].state == "pending"
        assert name_reads(h, name) == data  # from the recovered RAM copy

    with pytest.raises(_Died):
        h.call(fs.rename, ROOT, "model.pt.tmp", ROOT, "model.pt", 0)
    recovered_at("model.pt.tmp", first)
    fs = h.core.fs
    save(h, "model.pt.tmp", second)
    h.call(fs.rename, ROOT, "model.pt.tmp", ROOT, "model.pt", 0)
    recovered_at("model.pt", second)
    h.direct(h.background_steps, 100)
    assert h.manifests()["model.pt"].state == "durable"
    assert name_reads(h, "model.pt") == second
    consistent(h)


def test_a_name_resolved_after_a_restart_keeps_its_file_for_the_walk(h: Harness) -> None:
    """After a restart the cache holds no file until one is opened; a walk that
    resolved the name before a replace still reads the old bytes."""
    old, new = random.randbytes(SIZE), random.randbytes(SIZE)
    save(h, "model.pt", old)
    assert h.call(h.core.drain, "", None)["ok"]
    h.stop_clean()
    h.start()
    ino = h.call(h.core.fs.lookup, ROOT, "model.pt").ino
    assert h.core.fs.inodes[ino].file is None  # only looked up, never opened
    save(h, "model.pt.tmp", new)
    h.call(h.core.fs.rename, ROOT, "model.pt.tmp", ROOT, "model.pt", 0)
    assert read_inode(h, ino) == old
    forget(h, ino)
    consistent(h)
    assert read_inode(h, h.call(h.core.fs.lookup, ROOT, "model.pt").ino) == new


def test_a_plain_file_replaced_behind_its_inode_is_stale(h: Harness) -> None:
    """A plain file (written to the backing directory directly) opened for
    reading is read from the backing store: never another file at its name."""
    first, second = random.randbytes(SIZE), random.randbytes(SIZE)
    (h.backing / "plain").write_bytes(first)
    (h.backing / "other").write_bytes(second)
    ino = h.call(h.core.fs.lookup, ROOT, "plain").ino
    assert read_inode(h, ino) == first
    os.rename(h.backing / "other", h.backing / "plain")
    with pytest.raises(OSError) as exc:
        h.call(h.core.fs.open, ino, os.O_RDONLY, CALLER)
    assert exc.value.errno == errno.ESTALE
    assert read_inode(h, h.call(h.core.fs.lookup, ROOT, "plain").ino) == second


def test_an_inode_whose_name_another_node_replaced_is_stale(h: Harness) -> None:
    """Another node renames over the name (here: the same rename in the
    shared backing directory). The inode the kernel still has for the name
    holds the old file's pages in its page cache, so opening it must not
    read the new file: ESTALE, on which the kernel looks the name up again."""
    old, new = random.randbytes(SIZE), random.randbytes(SIZE)
    ino = save(h, "model.pt", old)
    save(h, "other", new)
    h.direct(h.background_steps, 100)
    os.rename(h.backing / "other", h.backing / "model.pt")
    time.sleep(h.config.open_recheck + 0.05)  # the open looks at the name again
    with pytest.raises(OSError) as exc:
        h.call(h.core.fs.open, ino, os.O_RDONLY, CALLER)
    assert exc.value.errno == errno.ESTALE
    again = h.call(h.core.fs.lookup, ROOT, "model.pt").ino
    assert again != ino
    assert read_inode(h, again) == new


def test_the_kernel_forgets_a_removed_file_so_its_memory_goes(mounted) -> None:
    """On a real mount: bytes kept for the kernel's inode are released once
    the file is unlinked (or replaced) and nothing has it open."""
    p = mounted.mnt / "model.pt"
    p.write_bytes(os.urandom(8 << 20))
    reader = open(p, "rb")
    tmp = mounted.mnt / "model.pt.tmp"
    tmp.write_bytes(os.urandom(8 << 20))
    os.replace(tmp, p)
    assert mounted.stat()["cache"]["used"] >= 16 << 20  # the reader's file lives on
    reader.close()
    wait_used(mounted, 8 << 20)
    os.unlink(p)
    wait_used(mounted, 0)


def wait_used(m, limit: int, timeout: float = 20) -> None:
    wait_for(
        lambda: m.stat()["cache"]["used"] <= limit,
        timeout,
        lambda: f"the cache to hold <= {limit} bytes, not {m.stat()['cache']['used']}",
        interval=0.1,
    )


def open_plain_to_append(h: Harness, name: str, data: bytes) -> tuple[int, int]:
    """A plain file (put in the backing directory directly) opened for
    writing without O_TRUNC, which adopts it: (inode, handle)."""
    (h.backing / name).write_bytes(data)
    ino = h.call(h.core.fs.lookup, ROOT, name).ino
    fh, _ = h.call(h.core.fs.open, ino, os.O_WRONLY, CALLER)
    return ino, fh


def append_while(
    h: Harness, ino: int, meanwhile: Callable[[], Awaitable[object]]
) -> dict[str, Any]:
    """Open the plain file ``ino`` for appending and, once its adoption is
    copying the plain bytes in, run ``meanwhile()`` (another process's call).
    Returns {"fh": the handle, "meanwhile": what the call returned}."""
    fs = h.core.fs
    out: dict[str, Any] = {}
    copying = trio.Event()
    real_copy = fs._copy_plain

    async def copy(*args: Any) -> None:
        copying.set()
        await real_copy(*args)

    async def both() -> None:
        async def opener() -> None:
            out["fh"], _ = await fs.open(ino, os.O_WRONLY, CALLER)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(opener)
            await copying.wait()
            out["meanwhile"] = await meanwhile()

    fs._copy_plain = copy
    try:
        h.call(both)
    finally:
        fs._copy_plain = real_copy
    return out


def test_a_plain_file_put_at_an_adopted_name_is_not_overwritten(h: Harness) -> None:
    """Appending to a plain backing file makes it a ckptfs file at its first
    publish, which replaces the plain file. If another plain file is put at
    the name meanwhile (copied into the shared directory from elsewhere), the
    publish must not overwrite it: as on NFS, writes to a file renamed over
    go to the old file, and the new one stays."""
    first, second = random.randbytes(SIZE), random.randbytes(SIZE)
    (h.backing / "other").write_bytes(second)
    fs = h.core.fs
    _, fh = open_plain_to_append(h, "plain", first)  # adopts: its bytes are copied in
    h.call(fs.write, fh, SIZE, b"appended")
    os.rename(h.backing / "other", h.backing / "plain")
    close_and_flush(h, fh)
    assert (h.backing / "plain").read_bytes() == second
    again = h.call(fs.lookup, ROOT, "plain").ino
    assert read_inode(h, again) == second


def test_a_plain_file_given_the_adopted_ones_inode_number_is_not_overwritten(
    h: Harness,
) -> None:
    """Another node deletes the plain file and copies another one to its
    name (rm; cp): ext4, and an NFS server on it, hands the new file the freed
    inode number at once. It is still another file and must stay."""
    first, second = random.randbytes(SIZE), random.randbytes(SIZE)
    plain = h.backing / "plain"
    fs = h.core.fs
    _, fh = open_plain_to_append(h, "plain", first)
    adopted = plain.stat().st_ino
    h.call(fs.write, fh, SIZE, b"appended")
    os.unlink(plain)
    plain.write_bytes(second)
    if plain.stat().st_ino != adopted:
        pytest.skip("this filesystem did not reuse the inode number (test_mirror_unit covers it)")
    close_and_flush(h, fh)
    assert plain.read_bytes() == second


def test_a_lookup_of_an_adopted_name_before_its_first_publish_finds_the_same_file(
    h: Harness,
) -> None:
    """Until its first publish the name still shows the plain file; a lookup
    then (a stat after the kernel's entry timeout) must give the same inode,
    not a second adoption whose writes one of the two publishes would drop."""
    first = random.randbytes(SIZE)
    fs = h.core.fs
    ino, fh1 = open_plain_to_append(h, "plain", first)
    h.call(fs.write, fh1, SIZE, b"one")
    again = h.call(fs.lookup, ROOT, "plain")
    assert again.ino == ino and again.size == SIZE + 3  # our copy's size, not the plain file's
    fh2, _ = h.call(fs.open, again.ino, os.O_WRONLY, CALLER)
    h.call(fs.write, fh2, SIZE + 3, b"two")
    close_and_flush(h, fh1, fh2)
    assert name_reads(h, "plain") == first + b"onetwo"


def test_a_flush_wait_during_an_adoption_waits_for_the_whole_copy(h: Harness) -> None:
    """`ckptfs flush --wait` commits files being written. A file still
    copying the plain file it adopts must be neither published half-copied
    nor found "not ours" (no manifest of its own at the name yet) and
    dropped under the open that adopts it: the flush waits for the copy."""
    first = random.randbytes(SIZE)
    (h.backing / "plain").write_bytes(first)
    fs, core = h.core.fs, h.core
    ino = h.call(fs.lookup, ROOT, "plain").ino
    out = append_while(h, ino, lambda: core.drain("", 30))
    assert out["meanwhile"]["ok"] and out["meanwhile"]["files"] == 1, out["meanwhile"]
    assert (h.backing / "plain").read_bytes().startswith(MAGIC)
    assert read_inode(h, ino) == first  # what the flush published: the whole copy
    h.call(fs.write, out["fh"], SIZE, b"appended")
    close_and_flush(h, out["fh"])
    assert name_reads(h, "plain") == first + b"appended"


def test_two_opens_adopting_one_plain_file_at_once_share_it(h: Harness) -> None:
    """Two processes open the same plain file for appending at the same
    moment: both copies start, one file results, and both writes are in it."""
    first = random.randbytes(SIZE)
    (h.backing / "plain").write_bytes(first)
    fs = h.core.fs
    ino = h.call(fs.lookup, ROOT, "plain").ino
    handles: list[int] = []

    async def both() -> None:
        async def opener() -> None:
            fh, _ = await fs.open(ino, os.O_WRONLY, CALLER)
            handles.append(fh)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(opener)
            nursery.start_soon(opener)

    h.call(both)
    assert h.core.fs.handles[handles[0]].file is h.core.fs.handles[handles[1]].file
    h.call(fs.write, handles[0], SIZE, b"one")
    h.call(fs.write, handles[1], SIZE + 3, b"two")
    close_and_flush(h, *handles)
    assert name_reads(h, "plain") == first + b"onetwo"


def test_an_adoption_whose_publish_found_the_name_gone_is_not_the_name_again(
    h: Harness,
) -> None:
    """The first publish finds the name gone for an instant (another node
    moves the plain file away and back): the adopted file is retired. The
    name, showing the very same plain file again, is then that plain file:
    read as it is, and adopted afresh by the next append."""
    first = random.randbytes(SIZE)
    fs = h.core.fs
    _, fh = open_plain_to_append(h, "plain", first)
    h.call(fs.write, fh, SIZE, b"lost")
    os.rename(h.backing / "plain", h.backing / "away")
    h.call(fs.flush, fh)  # publishes: the name is gone, so is this version
    os.rename(h.backing / "away", h.backing / "plain")
    h.call(fs.release, fh)
    h.direct(h.background_steps, 100)
    again = h.call(fs.lookup, ROOT, "plain")
    assert again.size == SIZE
    assert read_inode(h, again.ino) == first
    fh2, _ = h.call(fs.open, again.ino, os.O_WRONLY, CALLER)
    h.call(fs.write, fh2, SIZE, b"kept")
    close_and_flush(h, fh2)
    assert (h.backing / "plain").read_bytes().startswith(MAGIC)
    assert name_reads(h, "plain") == first + b"kept"


def test_a_touch_through_the_mount_during_an_adoption_lands_on_the_adopted_file(
    h: Harness,
) -> None:
    """Process B sets the times of the name while process A's append is
    still copying the plain file in. Set on the plain file, the new mtime
    would make it another file to A's first publish, and A's writes would be
    dropped: B's setattr waits for the adoption and changes the adopted file."""
    first = random.randbytes(SIZE)
    (h.backing / "plain").write_bytes(first)
    fs = h.core.fs
    ino = h.call(fs.lookup, ROOT, "plain").ino
    out = append_while(h, ino, lambda: fs.setattr(ino, SetAttr(mtime_ns=10**18), CALLER))
    assert out["meanwhile"].mtime_ns == 10**18 and out["meanwhile"].size == SIZE
    h.call(fs.write, out["fh"], SIZE, b"appended")
    close_and_flush(h, out["fh"])
    assert (h.backing / "plain").read_bytes().startswith(MAGIC)
    assert name_reads(h, "plain") == first + b"appended"


def test_an_adoption_whose_first_publish_failed_is_the_name_after_its_inode_is_forgotten(
    h: Harness,
) -> None:
    """The first publish fails (a backing-store error; it is retried in the
    background) and the kernel forgets the inode, as it does with an unused
    one. The name still shows the plain file, but is the adopted file: its
    bytes are read, and the next append adds to them (no second adoption)."""
    first = random.randbytes(SIZE)
    fs = h.core.fs
    ino, fh = open_plain_to_append(h, "plain", first)
    h.call(fs.write, fh, SIZE, b"appended")
    real_replace = fs.backing.replace_manifest

    async def store_down(*args: Any, **kw: Any) -> Any:
        raise OSError(errno.EIO, "backing store unavailable")

    fs.backing.replace_manifest = store_down
    for step in (fs.flush, fs.release):
        with pytest.raises(OSError):
            h.call(step, fh)
    fs.backing.replace_manifest = real_replace
    fs.forget(ino, fs.inodes[ino].nlookup)
    assert fs.inodes.get(ino) is None
    again = h.call(fs.lookup, ROOT, "plain")
    assert again.size == SIZE + 8
    assert read_inode(h, again.ino) == first + b"appended"
    fh2, _ = h.call(fs.open, again.ino, os.O_WRONLY, CALLER)
    h.call(fs.write, fh2, SIZE + 8, b"more")
    close_and_flush(h, fh2)
    assert (h.backing / "plain").read_bytes().startswith(MAGIC)
    assert name_reads(h, "plain") == first + b"appendedmore"


def test_an_adopted_plain_file_is_replaced_by_its_publish(h: Harness) -> None:
    """The same append without a stranger: the plain file becomes a ckptfs
    file holding its old bytes and the appended ones."""
    first = random.randbytes(SIZE)
    fs = h.core.fs
    ino, fh = open_plain_to_append(h, "plain", first)
    h.call(fs.write, fh, SIZE, b"appended")
    close_and_flush(h, fh)
    assert (h.backing / "plain").read_bytes().startswith(MAGIC)
    assert read_inode(h, ino) == first + b"appended"


def test_a_walk_of_a_lost_file_renamed_over_reads_eio_not_zeros(h: Harness) -> None:
    """A node restarts without its RAM: a file still pending there is LOST
    (EIO). A path walk resolves its name; the next save renames over it
    (os.replace). The walk's open then gets the lost file, which must still
    fail, not read zeros where its bytes were, nor take writes without O_TRUNC."""
    save(h, "model.pt", random.randbytes(SIZE))  # pending: the flusher has not run
    h.crash()
    shutil.rmtree(h.cache_root)  # its RAM is gone, and no other node holds it
    h.start()
    fs = h.core.fs
    ino = h.call(fs.lookup, ROOT, "model.pt").ino  # the walk
    with pytest.raises(OSError) as exc:
        read_inode(h, ino)
    assert exc.value.errno == errno.EIO
    save(h, "model.pt.tmp", random.randbytes(SIZE))
    h.call(fs.rename, ROOT, "model.pt.tmp", ROOT, "model.pt", 0)
    for flags in (os.O_RDONLY, os.O_WRONLY):
        with pytest.raises(OSError) as exc:
            fh, _ = h.call(fs.open, ino, flags, CALLER)
            try:
                if flags == os.O_RDONLY:
                    h.call(fs.read, fh, 0, SIZE)
                else:
                    h.call(fs.write, fh, 0, b"x")
            finally:
                h.call(fs.release, fh)
        assert exc.value.errno == errno.EIO, flags
    # A full rewrite through the walk's inode is allowed, as for any lost file.
    fh, _ = h.call(fs.open, ino, os.O_WRONLY | os.O_TRUNC, CALLER)
    h.call(fs.write, fh, 0, b"new")
    assert h.call(fs.read, fh, 0, 10) == b"new"
    h.call(fs.release, fh)
