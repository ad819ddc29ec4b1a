"""ChunkStore.put: O_DIRECT chunk writes, the buffered fallback, failures, one store per digest.

No FUSE: these drive the chunk store directly, with pieces cut from an
anonymous mapping (page-aligned, like the arena) at aligned and odd offsets.
"""

from __future__ import annotations

import errno
import fcntl
import gc
import mmap
import os
import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from ckptfs.fs.store import chunkstore
from ckptfs.fs.store.chunkstore import DIRECT_ALIGN, ChunkStore, pieces_hash

MiB = 1 << 20
PS = DIRECT_ALIGN


@pytest.fixture
def source() -> Iterator[memoryview]:
    """16 MiB of random, non-periodic bytes in a page-aligned mapping."""
    m = mmap.mmap(-1, 16 * MiB)
    m[:] = random.Random(7).randbytes(16 * MiB)
    view = memoryview(m)
    yield view
    gc.collect()  # tracebacks of expected failures hold slices of it
    view.release()
    m.close()


LAYOUTS = {
    "empty": lambda v: [],
    "one byte": lambda v: [v[5:6]],
    "one aligned page": lambda v: [v[:PS]],
    "aligned pages": lambda v: [v[PS : 9 * PS], v[20 * PS : 21 * PS]],
    "aligned, tail not a page": lambda v: [v[: 3 * PS + 17]],
    "unaligned": lambda v: [v[1:5001], v[PS + 3 : 3 * PS + 11]],
    "mixed": lambda v: [
        v[2 * PS : 6 * PS],  # straight from memory
        v[7 : 7 + 100],  # bounce from here on
        v[8 * PS : 10 * PS],  # aligned again, but the bounce holds bytes already
        b"read-only bytes",
        v[MiB : 2 * MiB],
        v[3 * MiB + 1 : 3 * MiB + 2],
    ],
    "aligned after a whole page": lambda v: [v[:PS], v[3 * PS : 5 * PS], v[9:10]],
    "arena slots of a chunk at an odd offset": lambda v: [
        v[MiB - 4000 : MiB],
        v[MiB : 2 * MiB],
        v[5 * MiB : 6 * MiB],
        v[2 * MiB : 2 * MiB + 12345],
    ],
    "multi-MiB aligned": lambda v: [v[: 9 * MiB]],
    "multi-MiB unaligned": lambda v: [v[33 : 9 * MiB + 77]],
    "multi-MiB, many pieces": lambda v: [v[i * PS + (i % 3) : (i + 1) * PS] for i in range(1500)],
}


def joined(pieces: list) -> bytes:
    return b"".join(bytes(p) for p in pieces)


def leftovers(store: ChunkStore) -> list[Path]:
    return [p for p in store.root.rglob("*") if ".tmp." in p.name] if store.root.exists() else []


def spy_open(monkeypatch: pytest.MonkeyPatch, refuse_direct: bool = False) -> list[int]:
    """Record the flags of every os.open (and refuse O_DIRECT if asked)."""
    flags_seen: list[int] = []
    real_open = os.open

    def spying(path, flags, *args, **kw):  # noqa: ANN001, ANN002, ANN003, ANN202
        flags_seen.append(flags)
        if refuse_direct and flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args, **kw)

    monkeypatch.setattr(os, "open", spying)
    return flags_seen


def direct_opens(flags_seen: list[int]) -> int:
    return sum(1 for f in flags_seen if f & os.O_DIRECT and f & os.O_CREAT)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_put_stores_exactly_the_bytes(tmp_path, source, layout, monkeypatch):
    store = ChunkStore(tmp_path)
    flags_seen = spy_open(monkeypatch)
    pieces = LAYOUTS[layout](source)
    data = joined(pieces)
    digest = pieces_hash(pieces) if pieces else pieces_hash([b""])
    assert store.put(digest, pieces) == len(data)
    path = store.path_for(digest)
    assert path.stat().st_size == len(data)
    assert path.read_bytes() == data
    assert store.get(digest, len(data)) == data
    assert leftovers(store) == []
    # Written with O_DIRECT, unless this filesystem refuses it (then remembered).
    assert direct_opens(flags_seen) == 1 or not store.direct_write_ok
    # Present: nothing is written again.
    assert store.put(digest, pieces) == 0


def test_a_single_buffer_is_stored(tmp_path, source):
    store = ChunkStore(tmp_path)
    for data in (bytes(source[3:70000]), bytearray(source[:8192]), source[PS : 2 * PS + 1]):
        digest = pieces_hash([data])
        assert store.put(digest, data) == len(data)
        assert store.get(digest, len(data)) == bytes(data)


def test_bounce_buffers_are_reused_and_bounded(tmp_path, source):
    store = ChunkStore(tmp_path)
    errors: list[BaseException] = []

    def writer(t: int) -> None:
        try:
            for i in range(6):
                start = 1 + 97 * (6 * t + i)
                piece = source[start : start + 2 * MiB + 3]
                store.put(pieces_hash([piece]), [piece])
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(t,)) for t in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(store._bounces) <= chunkstore.MAX_IDLE_BOUNCES
    for t in range(12):
        for i in range(6):
            start = 1 + 97 * (6 * t + i)
            piece = bytes(source[start : start + 2 * MiB + 3])
            assert store.get(pieces_hash([piece]), len(piece)) == piece


# ----- where O_DIRECT is refused -------------------------------------------------------------


def test_a_filesystem_refusing_o_direct_at_open_stores_buffered(tmp_path, source, monkeypatch):
    store = ChunkStore(tmp_path)
    flags_seen = spy_open(monkeypatch, refuse_direct=True)
    pieces = LAYOUTS["mixed"](source)
    data = joined(pieces)
    digest = pieces_hash(pieces)
    assert store.put(digest, pieces) == len(data)
    assert store.get(digest, len(data)) == data
    assert not store.direct_write_ok
    assert store.direct_ok  # reads are judged on their own
    # Remembered: the next chunk does not try O_DIRECT again.
    tried = direct_opens(flags_seen)
    other = [source[5 * MiB + 1 : 6 * MiB]]
    assert store.put(pieces_hash(other), other) == MiB - 1
    assert direct_opens(flags_seen) == tried
    assert store.get(pieces_hash(other), MiB - 1) == bytes(other[0])
    assert leftovers(store) == []


@pytest.mark.parametrize("layout", ["aligned pages", "unaligned", "mixed"])
def test_a_filesystem_refusing_o_direct_writes_stores_buffered(
    tmp_path, source, layout, monkeypatch
):
    """Opened with O_DIRECT, but the writes are refused (EINVAL): the file
    starts again, buffered, and O_DIRECT is not tried again."""
    store = ChunkStore(tmp_path)
    flags_seen = spy_open(monkeypatch)
    real_pwritev = os.pwritev

    def refusing(fd, views, pos):  # noqa: ANN001, ANN202
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_pwritev(fd, views, pos)

    monkeypatch.setattr(os, "pwritev", refusing)
    pieces = LAYOUTS[layout](source)
    data = joined(pieces)
    digest = pieces_hash(pieces)
    assert store.put(digest, pieces) == len(data)
    assert store.path_for(digest).read_bytes() == data
    assert store.get(digest, len(data)) == data
    assert leftovers(store) == []
    if direct_opens(flags_seen):  # this filesystem opens with O_DIRECT
        assert not store.direct_write_ok
        other = [source[7 * MiB : 8 * MiB]]
        assert store.put(pieces_hash(other), other) == MiB
        assert direct_opens(flags_seen) == 1


# ----- failures ------------------------------------------------------------------------------


def fail_after(monkeypatch: pytest.MonkeyPatch, name: str, calls: int) -> None:
    """os.<name> works ``calls`` times, then fails with ENOSPC."""
    real = getattr(os, name)
    count = {"n": 0}

    def failing(*args, **kw):  # noqa: ANN002, ANN003, ANN202
        count["n"] += 1
        if count["n"] > calls:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(*args, **kw)

    monkeypatch.setattr(os, name, failing)


@pytest.mark.parametrize(
    ("direct", "call", "calls"),
    [
        (True, "pwritev", 1),  # after the first piece went straight from memory
        (True, "pwritev", 0),
        (True, "fsync", 0),
        (True, "ftruncate", 0),
        (True, "rename", 0),
        (False, "writev", 0),
        (False, "fsync", 0),
    ],
)
def test_a_put_failing_midway_leaves_nothing(tmp_path, source, monkeypatch, direct, call, calls):
    store = ChunkStore(tmp_path)
    store.direct_write_ok = direct
    # Aligned pieces first (written straight from memory), then a bounced,
    # padded tail: every step of a put happens.
    pieces = [source[: 2 * MiB], source[4 * MiB : 5 * MiB], source[7 : 7 + 5 * MiB + 3]]
    digest = pieces_hash(pieces)
    with monkeypatch.context() as m:
        fail_after(m, call, calls)
        with pytest.raises(OSError) as info:
            store.put(digest, pieces)
        assert info.value.errno == errno.ENOSPC
    assert leftovers(store) == []
    assert not store.path_for(digest).exists()
    assert not store._storing  # the digest is free to be stored again
    assert store.direct_write_ok == direct  # ENOSPC is not a refusal of O_DIRECT
    # And once the store works again, the chunk is stored whole.
    data = joined(pieces)
    assert store.put(digest, pieces) == len(data)
    assert store.get(digest, len(data)) == data


# ----- one store per digest --------------------------------------------------------------------


def test_concurrent_puts_of_one_digest_store_it_once(tmp_path, source, monkeypatch):
    store = ChunkStore(tmp_path)
    real_fsync = os.fsync
    creates = {"n": 0}
    real_open = os.open

    def counting_open(path, flags, *args, **kw):  # noqa: ANN001, ANN002, ANN003, ANN202
        if flags & os.O_CREAT:
            creates["n"] += 1
        return real_open(path, flags, *args, **kw)

    def slow_fsync(fd):  # noqa: ANN001, ANN202
        time.sleep(0.05)  # the others arrive while the first is storing
        return real_fsync(fd)

    monkeypatch.setattr(os, "open", counting_open)
    monkeypatch.setattr(os, "fsync", slow_fsync)
    pieces = [source[11 : 3 * MiB]]
    digest = pieces_hash(pieces)
    results: list[int] = []
    barrier = threading.Barrier(6)

    def put() -> None:
        barrier.wait()
        results.append(store.put(digest, pieces))

    threads = [threading.Thread(target=put) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == [0] * 5 + [3 * MiB - 11]
    assert creates["n"] == 1
    assert not store._storing


def test_a_failed_put_lets_the_waiting_one_store(tmp_path, source, monkeypatch):
    store = ChunkStore(tmp_path)
    pieces = [source[: 2 * MiB + 5]]
    digest = pieces_hash(pieces)
    real_fsync = os.fsync
    first = threading.Event()
    calls = {"n": 0}

    def fsync(fd):  # noqa: ANN001, ANN202
        calls["n"] += 1
        if calls["n"] == 1:
            first.set()
            time.sleep(0.1)  # the second put arrives and waits
            raise OSError(errno.EIO, "Input/output error")
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    outcome: dict[str, object] = {}

    def one() -> None:
        try:
            outcome["one"] = store.put(digest, pieces)
        except OSError as exc:
            outcome["one"] = exc.errno

    def two() -> None:
        first.wait()
        outcome["two"] = store.put(digest, pieces)

    threads = [threading.Thread(target=one), threading.Thread(target=two)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert outcome == {"one": errno.EIO, "two": 2 * MiB + 5}
    assert store.get(digest, 2 * MiB + 5) == bytes(pieces[0])
    assert leftovers(store) == []
