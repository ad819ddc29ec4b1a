"""The FUSE kernel protocol's layouts, checked field by field against
linux/fuse.h (7.38): a wrong offset would be a kernel that reads garbage."""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass

import pytest
from ckptfs.fs.fuse import abi as abi


@dataclass
class A:
    ino: int = 7
    mode: int = stat.S_IFREG | 0o640
    nlink: int = 1
    uid: int = 1000
    gid: int = 100
    size: int = 5 * 4096 + 3
    blksize: int = 4096
    atime_ns: int = 1_700_000_000_123_456_789
    mtime_ns: int = 1_700_000_001_000_000_001
    ctime_ns: int = 1_700_000_002_999_999_999


def test_the_sizes_are_the_kernels() -> None:
    sizes = {
        "IN_HEADER": 40,
        "OUT_HEADER": 16,
        "ATTR": 88,
        "ENTRY_OUT": 128,
        "ATTR_OUT": 104,
        "OPEN_OUT": 16,
        "INIT_OUT": 64,
        "OPEN_IN": 8,
        "CREATE_IN": 16,
        "MKNOD_IN": 16,
        "MKDIR_IN": 8,
        "RENAME_IN": 8,
        "RENAME2_IN": 16,
        "READ_IN": 40,
        "WRITE_IN": 40,
        "WRITE_OUT": 8,
        "RELEASE_IN": 24,
        "FLUSH_IN": 24,
        "FSYNC_IN": 16,
        "BATCH_FORGET_IN": 8,
        "FORGET_ONE": 16,
        "SETATTR_IN": 88,
        "KSTATFS": 80,
        "DIRENT": 24,
    }
    assert {name: getattr(abi, name).size for name in sizes} == sizes


def test_attributes_land_in_the_kernels_fields() -> None:
    a = A()
    out = abi.entry_out(a, 1.5)
    nodeid, generation, entry_valid, attr_valid, entry_nsec, attr_nsec = abi.ENTRY_OUT.unpack_from(
        out
    )[:6]
    assert (nodeid, generation, entry_valid, attr_valid) == (7, 0, 1, 1)
    assert entry_nsec == attr_nsec == 500_000_000
    fields = abi.ATTR.unpack_from(out, 40)
    ino, size, blocks, atime, mtime, ctime, atns, mtns, ctns, mode, nlink, uid, gid, rdev = fields[
        :14
    ]
    assert (ino, size, blocks) == (7, a.size, 41)  # 512-byte blocks, rounded up
    assert (atime, atns) == divmod(a.atime_ns, 10**9)
    assert (mtime, mtns) == divmod(a.mtime_ns, 10**9)
    assert (ctime, ctns) == divmod(a.ctime_ns, 10**9)
    assert (mode, nlink, uid, gid, rdev) == (a.mode, 1, 1000, 100, 0)
    assert fields[14] == 4096  # blksize
    assert abi.attr_out(a, 1.0)[16:] == out[40:]
    assert abi.ATTR_OUT.unpack_from(abi.attr_out(a, 1.0))[:3] == (1, 0, 0)


def test_a_directory_entry_is_padded_to_eight_bytes() -> None:
    a = A()
    for name in (b"x", b"abcdefgh", b"a" * 255):
        rec = abi.dirent_plus(name, a, 42, 1.0)
        assert len(rec) % 8 == 0
        ino, off, namelen, kind = abi.DIRENT.unpack_from(rec, abi.ENTRY_OUT.size)
        assert (ino, off, namelen, kind) == (7, 42, len(name), stat.S_IFREG >> 12)
        start = abi.ENTRY_OUT.size + abi.DIRENT.size
        assert rec[start : start + len(name)] == name
        assert set(rec[start + len(name) :]) <= {0}


def test_names_are_split_at_their_nul() -> None:
    body = memoryview(b"old\0new name\0")
    assert abi.names(body, 2) == [b"old", b"new name"]
    assert abi.names(body, 1) == [b"old"]
    with pytest.raises(ValueError):
        abi.names(memoryview(b"unterminated"), 1)


def test_statfs_fields() -> None:
    st = os.statvfs("/")
    blocks, bfree, bavail, files, ffree, bsize, namelen, frsize = abi.KSTATFS.unpack_from(
        abi.statfs_out(st)
    )[:8]
    assert (blocks, bfree, bavail, files, ffree) == (
        st.f_blocks,
        st.f_bfree,
        st.f_bavail,
        st.f_files,
        st.f_ffree,
    )
    assert (bsize, namelen, frsize) == (st.f_bsize, st.f_namemax, st.f_frsize)
