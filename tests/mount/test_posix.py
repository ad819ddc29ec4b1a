"""POSIX semantics that training code relies on, on a real mount."""

from __future__ import annotations

import errno
import mmap
import os
import random
import shutil
import stat
import time
from pathlib import Path

import pytest
from ckptfs.fs.store.manifest import read_manifest


def test_create_overwrite_and_truncate(mounted):
    p = mounted.mnt / "f.bin"
    p.write_bytes(b"a" * 5000)
    p.write_bytes(b"short")  # O_TRUNC over an existing file
    assert p.read_bytes() == b"short"
    with open(p, "r+b") as f:
        f.seek(2)
        f.write(b"XY")
    assert p.read_bytes() == b"shXYt"
    os.truncate(p, 2)
    assert p.read_bytes() == b"sh"
    os.truncate(p, 3 << 20)  # extending reads zeros
    data = p.read_bytes()
    assert len(data) == 3 << 20 and data[:2] == b"sh" and data[2:] == bytes(len(data) - 2)
    with open(p, "r+b") as f:
        f.truncate(1)
        f.seek(10)
        f.write(b"z")  # a hole in the middle
    assert p.read_bytes() == b"s" + bytes(9) + b"z"
    assert p.stat().st_size == 11


def test_sparse_and_unaligned_writes(mounted):
    p = mounted.mnt / "sparse"
    expected = bytearray()
    with open(p, "wb") as f:
        for off, chunk in [(0, b"x" * 100), (3 << 20, b"y" * 5), ((1 << 20) - 3, b"z" * 10)]:
            f.seek(off)
            f.write(chunk)
            end = off + len(chunk)
            if len(expected) < end:
                expected.extend(bytes(end - len(expected)))
            expected[off:end] = chunk
    assert p.read_bytes() == bytes(expected)
    mounted.wait_durable()
    mounted.cli("evict", str(mounted.mnt))
    assert p.read_bytes() == bytes(expected)


def test_rename_over_existing_file_is_atomic_and_keeps_open_handle(mounted):
    old = mounted.mnt / "model.pt"
    old.write_bytes(b"old contents" * 1000)
    reader = open(old, "rb")
    tmp = mounted.mnt / "model.pt.tmp"
    tmp.write_bytes(b"new contents" * 1000)
    os.replace(tmp, old)
    assert old.read_bytes() == b"new contents" * 1000
    assert not tmp.exists()
    assert reader.read() == b"old contents" * 1000  # the replaced file lives on for its reader
    reader.close()
    mounted.wait_durable()
    m = read_manifest(mounted.backing / "model.pt")
    assert m is not None and m.state == "durable" and m.size == 12000


def test_unlink_of_open_file(mounted):
    p = mounted.mnt / "victim"
    with open(p, "wb") as w:
        w.write(b"1234" * 100_000)
        w.flush()
        r = open(p, "rb")
        os.unlink(p)
        assert not p.exists()
        w.write(b"more")
    assert r.read() == b"1234" * 100_000 + b"more"
    r.close()
    assert not (mounted.backing / "victim").exists()
    assert "victim" not in os.listdir(mounted.mnt)


def test_directories_and_readdir(mounted):
    base = mounted.mnt / "run" / "checkpoint-10"
    base.mkdir(parents=True)
    names = {f"shard-{i}.pt" for i in range(40)}
    for name in names:
        (base / name).write_bytes(name.encode())
    assert set(os.listdir(base)) == names
    assert set(os.listdir(mounted.mnt)) == {"run"}  # .ckptfs is hidden
    with pytest.raises(OSError) as exc:
        os.rmdir(base)
    assert exc.value.errno == errno.ENOTEMPTY
    os.rename(mounted.mnt / "run", mounted.mnt / "run2")
    assert (mounted.mnt / "run2" / "checkpoint-10" / "shard-3.pt").read_bytes() == b"shard-3.pt"
    shutil.rmtree(mounted.mnt / "run2")
    assert os.listdir(mounted.mnt) == []
    assert sorted(os.listdir(mounted.backing)) == [".ckptfs"]


def test_stat_sizes_mtimes_chmod_utime(mounted):
    p = mounted.mnt / "x"
    before = time.time()
    p.write_bytes(b"q" * 12345)
    st = p.stat()
    assert st.st_size == 12345 and stat.S_ISREG(st.st_mode)
    assert before - 2 <= st.st_mtime <= time.time() + 2
    os.chmod(p, 0o600)
    assert stat.S_IMODE(p.stat().st_mode) == 0o600
    os.utime(p, (1_600_000_000, 1_600_000_000))
    assert int(p.stat().st_mtime) == 1_600_000_000
    mounted.wait_durable()
    mounted.umount()
    mounted.mount()
    st = p.stat()
    assert (st.st_size, stat.S_IMODE(st.st_mode), int(st.st_mtime)) == (12345, 0o600, 1_600_000_000)


def test_symlink_fsync_statfs(mounted):
    target = mounted.mnt / "t.bin"
    target.write_bytes(b"data")
    link = mounted.mnt / "latest"
    os.symlink("t.bin", link)
    assert os.readlink(link) == "t.bin"
    assert link.read_bytes() == b"data"
    fd = os.open(mounted.mnt / "synced", os.O_WRONLY | os.O_CREAT)
    os.write(fd, b"fsynced")
    os.fsync(fd)
    m = read_manifest(mounted.backing / "synced")
    assert m is not None and m.size == 7  # fsync published the manifest
    os.close(fd)
    sv = os.statvfs(mounted.mnt)
    assert sv.f_bsize > 0 and sv.f_blocks > 0


def test_plain_backing_files_are_served_read_through(mounts):
    m = mounts()
    (m.backing / "old").mkdir(parents=True)
    (m.backing / "old" / "config.json").write_text('{"a": 1}')
    blob = os.urandom(3 << 20)
    (m.backing / "old" / "weights.safetensors").write_bytes(blob)
    m.mount()
    assert (m.mnt / "old" / "config.json").read_text() == '{"a": 1}'
    assert (m.mnt / "old" / "weights.safetensors").read_bytes() == blob
    assert (m.mnt / "old" / "weights.safetensors").stat().st_size == len(blob)
    # Writing to a plain file makes it a ckptfs file; its bytes are kept.
    with open(m.mnt / "old" / "config.json", "r+") as f:
        f.seek(0, 2)
        f.write("\n")
    assert (m.mnt / "old" / "config.json").read_text() == '{"a": 1}\n'
    assert read_manifest(m.backing / "old" / "config.json") is not None


def test_hard_links_are_refused(mounted):
    (mounted.mnt / "a").write_bytes(b"x")
    with pytest.raises(OSError) as exc:
        os.link(mounted.mnt / "a", mounted.mnt / "b")
    assert exc.value.errno == errno.EPERM


def test_concurrent_readers(mounted):
    import threading

    blob = os.urandom(20 << 20)
    p = mounted.mnt / "shared"
    p.write_bytes(blob)
    mounted.wait_durable()
    mounted.cli("evict", str(mounted.mnt))
    results: list[bool] = []

    def read() -> None:
        results.append(Path(p).read_bytes() == blob)

    threads = [threading.Thread(target=read) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results == [True] * 6


def test_large_directory_listing_is_complete_and_stable(mounted):
    d = mounted.mnt / "many"
    d.mkdir()
    names = {f"rank-{i:05d}.pt" for i in range(1500)}  # more than one readdir buffer
    for name in names:
        (mounted.backing / "many" / name).write_bytes(b"")  # plain files, made fast
    assert set(os.listdir(d)) == names
    assert set(os.listdir(d)) == names
    assert all((d / n).stat().st_size == 0 for n in list(names)[:50])


def test_block_size_is_large_while_written_and_small_for_readers(mounted):
    """st_blksize sizes Python's and stdio's buffers: a file being written gets
    1 MiB writes (one FUSE request each), a file being read gets a local disk's
    4 KiB, so that small reads after a seek do not refill 1 MiB."""
    p = mounted.mnt / "blk.bin"
    payload = os.urandom(3 << 20)
    with open(p, "wb") as f:  # create
        assert os.fstat(f.fileno()).st_blksize == 1 << 20
        f.write(payload)
    assert p.stat().st_blksize == 4096
    with open(p, "rb") as f:
        assert os.fstat(f.fileno()).st_blksize == 4096
        assert f.read() == payload
    assert p.stat().st_blksize == 4096  # the kernel caches these attributes
    with open(p, "wb") as f:  # O_TRUNC over the existing file: the kernel asks again
        assert os.fstat(f.fileno()).st_blksize == 1 << 20
        f.write(payload[::-1])
    assert p.read_bytes() == payload[::-1]
    assert p.stat().st_blksize == 4096


def test_the_mount_root_takes_chmod_chown_and_utime(mounted):
    """An operator opens the mount to a job's users with chmod on its root
    (the backing directory's root): it used to fail with ENOENT."""
    root = mounted.mnt
    os.chmod(root, 0o1777)
    assert stat.S_IMODE(os.stat(root).st_mode) == 0o1777
    assert stat.S_IMODE(os.stat(mounted.backing).st_mode) == 0o1777
    os.chown(root, 65534, 65534)
    assert (os.stat(root).st_uid, os.stat(root).st_gid) == (65534, 65534)
    os.utime(root, ns=(1_000_000_000, 2_000_000_000))
    assert os.stat(root).st_mtime_ns == 2_000_000_000
    os.chown(root, 0, 0)
    os.chmod(root, 0o755)
    assert stat.S_IMODE(os.stat(root).st_mode) == 0o755


def test_times_before_1970_and_far_ahead(mounted):
    """tar of old archives and `touch -d 1960-01-01` set times before the
    epoch: negative seconds, which the FUSE protocol carries as signed. A
    stat, a listing and a remount keep them, on files, directories and the
    backing directory alike."""
    d = mounted.mnt / "old"
    d.mkdir()
    f = d / "weights.pt"
    f.write_bytes(os.urandom(5000))
    times = {
        f: (-315_619_200_123_456_789, -1),  # 1960-01-01 and the last ns of 1969
        d: (-86_400_000_000_000, -999_999_999),
        mounted.mnt / "future": (32_503_680_000_000_000_000, 4_102_444_800_000_000_001),
    }
    (mounted.mnt / "future").write_bytes(b"x")
    # Durable first: the flusher's manifest rewrite would move the directory's
    # mtime (see README, Limits).
    mounted.wait_durable()
    for path, ns in times.items():
        os.utime(path, ns=ns)
    for path, (atime, mtime) in times.items():
        st = os.stat(path)
        assert (st.st_atime_ns, st.st_mtime_ns) == (atime, mtime), path
    assert sorted(os.listdir(d)) == ["weights.pt"]
    assert [e.stat().st_mtime_ns for e in os.scandir(mounted.mnt) if e.name == "old"] == [
        -999_999_999
    ]
    mounted.umount()
    mounted.mount()
    for path, (_, mtime) in times.items():
        assert os.stat(path).st_mtime_ns == mtime, path
    assert os.stat(mounted.backing / "old").st_mtime_ns == -999_999_999


def test_o_direct_writes_and_reads_read_back_whole_after_a_cold_remount(mounts):
    """O_DIRECT I/O (DeepSpeed's FastPersist and aio loaders use it) sends
    its own requests (no ASYNC_DIO): write-only and read-write writers,
    4 MiB aligned writes and an unaligned one, read back buffered and
    O_DIRECT, then again from a cold cache after a remount."""
    m = mounts()
    m.mount()
    rng = random.Random(13)
    files = {
        "w": rng.randbytes(37 << 20),
        "rw": rng.randbytes(21 << 20),
        "odd": rng.randbytes(1000003),
    }
    buf = mmap.mmap(-1, 4 << 20)  # page-aligned, as O_DIRECT callers use
    for name, data in files.items():
        mode = os.O_RDWR if name == "rw" else os.O_WRONLY
        fd = os.open(m.mnt / name, mode | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
        try:
            pos = 0
            while pos < len(data):
                n = min(len(buf), len(data) - pos)
                buf[:n] = data[pos : pos + n]
                pos += os.writev(fd, [memoryview(buf)[:n]])
        finally:
            os.close(fd)

    def direct_read(path: Path) -> bytes:
        out = bytearray()
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        try:
            while (k := os.readv(fd, [buf])) > 0:
                out += buf[:k]
        finally:
            os.close(fd)
        return bytes(out)

    for name, data in files.items():
        assert (m.mnt / name).read_bytes() == data
        assert direct_read(m.mnt / name) == data
    m.wait_durable()
    m.umount()
    shutil.rmtree(m.cache_dir)
    m.mount()
    for name, data in files.items():
        assert direct_read(m.mnt / name) == data
        assert (m.mnt / name).read_bytes() == data


def test_a_directory_mtime_moves_with_its_names_not_with_the_flush(mounts):
    """HF Trainer rotates out the checkpoint directory with the oldest mtime.
    A directory's times are its backing directory's, where each manifest
    rewrite (the close's, the flusher's, a chmod's) is a temporary file
    renamed over the name: a flush finishing after the next checkpoint's save
    made the older directory look the newest, and the rotation deleted the
    newer one. Only a change of its names moves a directory's mtime now."""
    m = mounts()
    m.mount(env={"CKPTFS_FLUSH_BANDWIDTH": "256KiB", "CKPTFS_CHUNK_SIZE": "256KiB"})
    times = {"checkpoint-4": 1_700_000_000_000_000_000, "checkpoint-6": 1_700_000_010_000_000_000}
    for name, t in times.items():
        (m.mnt / name).mkdir()
        (m.mnt / name / "model.pt").write_bytes(os.urandom((1 << 20) + 1))
        os.utime(m.mnt / name, ns=(t, t))
    assert m.file_state("checkpoint-6/model.pt") != "durable"  # else the flush is not tested
    older = m.mnt / "checkpoint-4" / "model.pt"
    os.chmod(older, 0o600)
    with open(older, "r+b") as f:  # a rewrite in place: a new version, flushed again
        f.write(b"x")
    m.wait_durable(120)
    assert m.file_state("checkpoint-4/model.pt") == "durable"
    for name, t in times.items():
        assert os.stat(m.backing / name).st_mtime_ns == t, name
        assert os.stat(m.mnt / name).st_mtime_ns == t, name
    (m.mnt / "checkpoint-6" / "extra.json").write_bytes(b"{}")  # a new name: it moves
    assert os.stat(m.mnt / "checkpoint-6").st_mtime_ns > times["checkpoint-6"]
    os.unlink(m.mnt / "checkpoint-4" / "model.pt")
    assert os.stat(m.mnt / "checkpoint-4").st_mtime_ns > times["checkpoint-4"]


def test_concurrent_manifest_rewrites_in_one_directory_keep_its_mtime(tmp_path):
    """The flusher's workers publish several files of one checkpoint at once
    (after a crash's recovery, all of them): each one's temporary file looked
    to the others like another process's change, so none put the times back
    (the HF crash-case test in CI kept a recovered older checkpoint)."""
    import threading

    from ckptfs.fs.store.manifest import Manifest, new_id, write_manifest

    d = tmp_path / "checkpoint-4"
    d.mkdir()
    manifests = [
        Manifest(
            file_id=new_id(),
            version=new_id(),
            size=0,
            mode=0o100644,
            mtime_ns=0,
            state="pending",
            holders=["n1"],
            chunks=[],
            chunking="fixed",
        )
        for _ in range(6)
    ]
    for i, m in enumerate(manifests):
        write_manifest(d / f"shard{i}.pt", m, sync=False)
    t = 1_700_000_000_000_000_000
    os.utime(d, ns=(t, t))
    errors: list[BaseException] = []

    def rewrite(i: int) -> None:
        try:
            for _ in range(30):
                write_manifest(d / f"shard{i}.pt", manifests[i], keep_dir_times=True)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=rewrite, args=(i,)) for i in range(len(manifests))]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert not errors and not any(th.is_alive() for th in threads)
    assert os.stat(d).st_mtime_ns == t
    assert sorted(os.listdir(d)) == [f"shard{i}.pt" for i in range(len(manifests))]
