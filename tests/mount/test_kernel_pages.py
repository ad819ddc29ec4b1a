"""A saved file's head and tail put into the kernel's page cache at its close
(fs/namespace/kernelpages.py): what is pushed, when it is not, that changes wait for a
push, and that every read through the mount afterwards is the file's bytes."""

from __future__ import annotations

import ctypes
import mmap
import os
import random
import threading
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import trio
from ckptfs.fs.content.state import FileState
from ckptfs.fs.fuse.kernelpages import KernelPages
from ckptfs.fs.namespace.inodes import ROOT
from ckptfs.fs.namespace.kernelpages import HEAD, TAIL, KernelCache, pieces
from ckptfs.fs.namespace.posix import SetAttr
from lifecycle_harness import CALLER, Harness
from mounts import Mount

MiB = 1 << 20
PAGE = mmap.PAGESIZE


def test_the_pieces_are_the_head_and_a_page_aligned_tail():
    assert pieces(0) == []
    assert pieces(100) == [(0, 100)]
    assert pieces(HEAD + 10) == [(0, HEAD), (HEAD, HEAD + 10)]
    size = 5 * MiB + 123
    assert pieces(size) == [(0, HEAD), ((size - TAIL) // PAGE * PAGE, size)]


# ----- without FUSE: the push and what waits for it ---------------------------------------


@pytest.fixture
def big(tmp_path: Path) -> Iterator[Harness]:
    harness = Harness(tmp_path, cache_slots=256)  # 1 MiB of 4 KiB slots
    harness.start()
    yield harness
    harness.close()


class Kernel:
    """Stands in for the FUSE device: records pushes, blocks them until let go."""

    def __init__(self) -> None:
        self.pushed: list[tuple[int, int, bytes]] = []
        self.go = threading.Event()
        self.fd = os.open(os.devnull, os.O_WRONLY)  # what KernelPages duplicates

    def store(self, fd: int, nodeid: int, offset: int, data: bytes) -> bool:
        os.fstat(fd)  # a descriptor of its own, open while it pushes
        self.pushed.append((nodeid, offset, bytes(data)))
        return self.go.wait(10)

    async def close_blocks_in_push(self, nursery: trio.Nursery, fs: Any, fh: int) -> None:
        """Start the close (FLUSH) of ``fh`` and return once its push is blocked here."""
        nursery.start_soon(fs.flush, fh)
        with trio.fail_after(10):
            while not self.pushed:
                await trio.sleep(0.01)

    def pages(self, allowed: Callable[[], bool] = lambda: True) -> KernelPages:
        try:
            return KernelPages(self.fd, self.store, allowed)
        finally:
            os.close(self.fd)


def test_a_push_holds_back_writes_a_writable_open_and_a_truncate_until_it_ends(big: Harness):
    fs = big.core.fs
    kernel = Kernel()
    fs.kernel_pages = kernel.pages()
    data = random.randbytes(HEAD + TAIL + 5 * PAGE + 17)
    fh, attr = big.call(partial(fs.create, direct=True), ROOT, "a.pt", 0o644, os.O_WRONLY, CALLER)
    inode = fs.inodes[attr.ino]
    assert inode.kernel_cache is KernelCache.EMPTY
    big.call(fs.write, fh, 0, data)
    order: list[str] = []

    async def scenario() -> None:
        async with trio.open_nursery() as nursery:
            await kernel.close_blocks_in_push(nursery, fs, fh)
            assert inode.kernel_cache is KernelCache.PUSHING

            async def change() -> None:
                fh2, _ = await fs.open(attr.ino, os.O_RDWR, CALLER)
                order.append("opened")
                await fs.write(fh2, 0, b"changed")
                await fs.release(fh2)

            async def truncate() -> None:
                await fs.setattr(attr.ino, SetAttr(size=HEAD), CALLER)
                order.append("truncated")

            async def write_again() -> None:  # through the saving handle (a dup of its fd)
                await fs.write(fh, 0, b"again")
                order.append("written")

            nursery.start_soon(change)
            nursery.start_soon(truncate)
            nursery.start_soon(write_again)
            await trio.sleep(0.05)
            order.append("pushed")
            kernel.go.set()

    big.call(scenario)
    assert order[0] == "pushed" and sorted(order[1:]) == ["opened", "truncated", "written"]
    tail = (len(data) - TAIL) // PAGE * PAGE
    assert kernel.pushed == [(attr.ino, 0, data[:HEAD]), (attr.ino, tail, data[tail:])]
    # The push ended before the change: the pages it put there were the file's.
    assert fs.kernel_pages.stats() == {"files": 1, "bytes": HEAD + len(data) - tail, "refused": 0}
    assert inode.kernel_cache is KernelCache.ANY
    big.call(fs.release, fh)


def test_no_push_once_another_handle_was_opened_or_without_direct_io(big: Harness):
    fs = big.core.fs
    kernel = Kernel()
    kernel.go.set()
    fs.kernel_pages = kernel.pages()
    data = random.randbytes(3 * PAGE)
    # Another handle (a reader) may have let the kernel cache pages of it.
    fh, attr = big.call(partial(fs.create, direct=True), ROOT, "a.pt", 0o644, os.O_WRONLY, CALLER)
    big.call(fs.write, fh, 0, data)
    reader, _ = big.call(fs.open, attr.ino, os.O_RDONLY, CALLER)
    big.call(fs.flush, fh)
    # A writer through the page cache (O_RDWR) fills it itself.
    fh2, _ = big.call(fs.create, ROOT, "b.pt", 0o644, os.O_RDWR, CALLER)
    big.call(fs.write, fh2, 0, data)
    big.call(fs.flush, fh2)
    assert kernel.pushed == []
    for h in (fh, reader, fh2):
        big.call(fs.release, h)
    # The same save alone is pushed, once, however often it is flushed.
    fh3, attr3 = big.call(partial(fs.create, direct=True), ROOT, "c.pt", 0o644, os.O_WRONLY, CALLER)
    big.call(fs.write, fh3, 0, data)
    big.call(fs.flush, fh3)
    big.call(fs.flush, fh3)
    big.call(fs.release, fh3)
    assert kernel.pushed == [(attr3.ino, 0, data)]


def test_on_a_kernel_that_keeps_no_pushed_page_coherent_nothing_is_copied(
    big: Harness, monkeypatch: pytest.MonkeyPatch
):
    """Before FUSE 7.39 the mount keeps AUTO_INVAL_DATA and pushes nothing:
    the close does not even copy the head and tail out of the cache."""
    fs = big.core.fs
    kernel = Kernel()
    kernel.go.set()
    coherent = [False]
    fs.kernel_pages = kernel.pages(allowed=lambda: coherent[0])
    copies: list[tuple[int, int]] = []
    copy_in_ram = fs.cache.copy_in_ram
    monkeypatch.setattr(
        fs.cache, "copy_in_ram", lambda f, a, b: copies.append((a, b)) or copy_in_ram(f, a, b)
    )
    data = random.randbytes(3 * PAGE)

    def save(name: str) -> int:
        fh, attr = big.call(partial(fs.create, direct=True), ROOT, name, 0o644, os.O_WRONLY, CALLER)
        big.call(fs.write, fh, 0, data)
        big.call(fs.flush, fh)
        big.call(fs.release, fh)
        return attr.ino

    ino = save("a.pt")
    assert copies == [] and kernel.pushed == []
    assert fs.inodes[ino].kernel_cache is KernelCache.EMPTY
    reader, _ = big.call(fs.open, ino, os.O_RDONLY, CALLER)  # opens as before
    assert big.call(fs.read, reader, 0, len(data)) == data
    big.call(fs.release, reader)
    coherent[0] = True  # the same save where the kernel keeps them coherent: copied, pushed
    ino_b = save("b.pt")
    assert copies == [(0, len(data))] and kernel.pushed == [(ino_b, 0, data)]
    fs.kernel_pages.close()


def test_a_close_while_a_write_of_the_file_waits_neither_waits_for_it_nor_pushes(big: Harness):
    """A write waiting for room in the cache holds the file's lock for as
    long as that takes; a close of another descriptor of the file meanwhile
    (a forked child's exec closes its inherited copies: the CI found the
    suite's 32-writers test hung there) must not wait behind it."""
    fs = big.core.fs
    kernel = Kernel()
    kernel.go.set()
    fs.kernel_pages = kernel.pages()
    fh, attr = big.call(partial(fs.create, direct=True), ROOT, "a.pt", 0o644, os.O_WRONLY, CALLER)
    big.call(fs.write, fh, 0, random.randbytes(3 * PAGE))
    f = fs.handles[fh].file

    async def scenario() -> None:
        done = trio.Event()

        async def writer_waiting_for_room(task_status: trio.TaskStatus[None]) -> None:
            async with f.lock:
                task_status.started()
                await done.wait()

        async with trio.open_nursery() as nursery:
            await nursery.start(writer_waiting_for_room)
            with trio.fail_after(5):
                await fs.flush(fh)
            done.set()

    big.call(scenario)
    assert kernel.pushed == [] and f.state is FileState.PENDING
    big.call(fs.release, fh)


def test_a_push_the_session_ends_under_is_given_up_and_its_descriptor_closed_after(
    big: Harness,
):
    """A push waits for pages that READs in flight hold; once the session
    ends nobody answers them, so close() gives up the wait at once (the
    FLUSH that pushed returns, the unmount can go on) and the descriptor
    the thread writes through is closed only when that thread is done."""
    fs = big.core.fs
    kernel = Kernel()
    pages = fs.kernel_pages = kernel.pages()
    fh, attr = big.call(partial(fs.create, direct=True), ROOT, "a.pt", 0o644, os.O_WRONLY, CALLER)
    big.call(fs.write, fh, 0, random.randbytes(3 * PAGE))

    async def scenario() -> None:
        async with trio.open_nursery() as nursery:
            await kernel.close_blocks_in_push(nursery, fs, fh)
            pages.close()
        # The flush returned with the thread still blocked, its descriptor open.
        assert fs.inodes[attr.ino].kernel_cache is KernelCache.ANY
        assert pages.threads == 1
        fd = pages._fd
        held = os.fstat(fd)
        kernel.go.set()
        with trio.fail_after(10):
            while pages.threads:
                await trio.sleep(0.01)
        # Closed by the thread as it ended: the number is free, or another
        # file's by now (the Core opens files of its own meanwhile).
        try:
            now = os.fstat(fd)
        except OSError:
            pass
        else:
            assert (now.st_dev, now.st_ino) != (held.st_dev, held.st_ino)

    big.call(scenario)
    assert pages.stats()["refused"] == 1
    assert big.call(pages.push, attr.ino, [(0, b"x")]) is False  # closed: no more pushes
    big.call(fs.release, fh)


# ----- through a real mount ------------------------------------------------------------


def resident(path: Path) -> set[int]:
    """The pages of ``path`` in the kernel's page cache (mincore), read-free."""
    libc = ctypes.CDLL(None, use_errno=True)
    size = path.stat().st_size
    with open(path, "rb") as f, mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY) as mm:
        addr = ctypes.addressof(ctypes.c_char.from_buffer(mm))
        vec = (ctypes.c_ubyte * -(-size // PAGE))()
        if libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(size), vec) != 0:
            raise OSError(ctypes.get_errno(), "mincore")
        return {i for i, v in enumerate(vec) if v & 1}


def reads_whole(path: Path) -> bytes:
    with open(path, "rb", buffering=0) as f:
        return f.read()


def test_a_save_leaves_its_head_and_tail_cached_and_every_later_read_is_true(mounted: Mount):
    """torch.save's pattern (a temporary name written with O_WRONLY, then
    os.replace): at the close the head and tail pages are in the kernel's
    page cache before anything read them, and no other page is. Then the
    file is changed every way a job changes a file (in place through a
    page-cache writer and a direct-I/O writer, truncated, saved over), with
    a reader and a mapping kept open across, and every read, old handle or
    new, whole file compared, gives the bytes the file holds."""
    mnt = mounted.mnt
    size = 3 * MiB + 12345
    data = bytearray(os.urandom(size))
    (mnt / "ckpt.pt.tmp").write_bytes(data)
    os.replace(mnt / "ckpt.pt.tmp", mnt / "ckpt.pt")
    pushed = mounted.stat()["fuse"]["pages_pushed"]
    tail = (size - TAIL) // PAGE * PAGE
    assert pushed == {"files": 1, "bytes": HEAD + size - tail, "refused": 0}
    shown = f"page cache at their close: 1 file(s), {(HEAD + size - tail) >> 10} KiB"
    assert shown in mounted.cli("stat", str(mnt), "--verbose").stdout
    want = set(range(HEAD // PAGE)) | set(range(tail // PAGE, -(-size // PAGE)))
    # No page but those (nothing read the file), and those there: all of
    # them but what the kernel may have reclaimed meanwhile (a clean page
    # may go at any moment; a CI run under memory pressure lost one of 81).
    got = resident(mnt / "ckpt.pt")
    assert got <= want and len(want - got) <= 2, sorted(want ^ got)
    assert reads_whole(mnt / "ckpt.pt") == data

    reader = os.open(mnt / "ckpt.pt", os.O_RDONLY)
    mapped = mmap.mmap(reader, 0, access=mmap.ACCESS_READ)
    try:
        for how in ("r+b", "direct", "truncate"):
            if how == "r+b":
                with open(mnt / "ckpt.pt", "r+b", buffering=0) as w:
                    for off in (100, size - 50):
                        patch = os.urandom(40)
                        w.seek(off)
                        w.write(patch)
                        data[off : off + 40] = patch
            elif how == "direct":  # O_WRONLY in place: direct I/O
                fd = os.open(mnt / "ckpt.pt", os.O_WRONLY)
                try:
                    patch = os.urandom(PAGE)
                    os.pwrite(fd, patch, 0)
                    data[:PAGE] = patch
                finally:
                    os.close(fd)
            else:
                size -= 5000
                os.truncate(mnt / "ckpt.pt", size)
                del data[size:]
            assert os.pread(reader, size + 10, 0) == data, how
            assert mapped[:PAGE] == data[:PAGE], how
            assert reads_whole(mnt / "ckpt.pt") == data, how
    finally:
        mapped.close()
        os.close(reader)

    # A file written through the page cache (w+b: O_RDWR) is not pushed.
    with open(mnt / "other.json", "w+b") as f:
        f.write(b"{}")
    assert mounted.stat()["fuse"]["pages_pushed"]["files"] == 1
    # Saved over (a new file at the name): its own pages, pushed again.
    new = os.urandom(2 * MiB + 3)
    (mnt / "ckpt.pt.tmp").write_bytes(new)
    os.replace(mnt / "ckpt.pt.tmp", mnt / "ckpt.pt")
    assert mounted.stat()["fuse"]["pages_pushed"]["files"] == 2
    assert reads_whole(mnt / "ckpt.pt") == new
    mounted.umount()
    mounted.mount()
    assert reads_whole(mnt / "ckpt.pt") == new
