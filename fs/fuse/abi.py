"""The FUSE kernel protocol (``linux/fuse.h``, 7.38): opcodes, flags and the
layouts of the messages ckptfs reads from and writes to ``/dev/fuse``.

Only encoding and decoding live here; no I/O and no state. Every layout is a
little-endian :class:`struct.Struct` with the kernel's field order, so that
each request body and reply is one ``unpack_from`` or ``pack``.
"""

from __future__ import annotations

import enum
import os
import struct
from typing import Protocol

KERNEL_MAJOR = 7
KERNEL_MINOR = 38  # what we speak; the kernel may speak more (we then reply 38)
ROOT_ID = 1
MIN_READ_BUFFER = 8192
MAX_WRITE = 1 << 20  # bytes per WRITE request (256 pages, this kernel's max_pages_limit)
BUFFER_SIZE = MAX_WRITE + 0x1000  # a request: its header and body


class Op(enum.IntEnum):
    LOOKUP = 1
    FORGET = 2
    GETATTR = 3
    SETATTR = 4
    READLINK = 5
    SYMLINK = 6
    MKNOD = 8
    MKDIR = 9
    UNLINK = 10
    RMDIR = 11
    RENAME = 12
    LINK = 13
    OPEN = 14
    READ = 15
    WRITE = 16
    STATFS = 17
    RELEASE = 18
    FSYNC = 20
    SETXATTR = 21
    GETXATTR = 22
    LISTXATTR = 23
    REMOVEXATTR = 24
    FLUSH = 25
    INIT = 26
    OPENDIR = 27
    READDIR = 28
    RELEASEDIR = 29
    FSYNCDIR = 30
    GETLK = 31
    SETLK = 32
    SETLKW = 33
    ACCESS = 34
    CREATE = 35
    INTERRUPT = 36
    BMAP = 37
    DESTROY = 38
    IOCTL = 39
    POLL = 40
    NOTIFY_REPLY = 41
    BATCH_FORGET = 42
    FALLOCATE = 43
    READDIRPLUS = 44
    RENAME2 = 45
    LSEEK = 46
    COPY_FILE_RANGE = 47
    SETUPMAPPING = 48
    REMOVEMAPPING = 49
    SYNCFS = 50
    TMPFILE = 51
    STATX = 52


# INIT flags (fuse_init_in.flags / fuse_init_out.flags)
ASYNC_READ = 1 << 0
ATOMIC_O_TRUNC = 1 << 3
BIG_WRITES = 1 << 5
HAS_IOCTL_DIR = 1 << 11
AUTO_INVAL_DATA = 1 << 12
DO_READDIRPLUS = 1 << 13
ASYNC_DIO = 1 << 15
WRITEBACK_CACHE = 1 << 16
PARALLEL_DIROPS = 1 << 18
HANDLE_KILLPRIV = 1 << 19
MAX_PAGES = 1 << 22

# fuse_open_out.open_flags
FOPEN_DIRECT_IO = 1 << 0
FOPEN_KEEP_CACHE = 1 << 1
FOPEN_NOFLUSH = 1 << 5

# fuse_setattr_in.valid
FATTR_MODE = 1 << 0
FATTR_UID = 1 << 1
FATTR_GID = 1 << 2
FATTR_SIZE = 1 << 3
FATTR_ATIME = 1 << 4
FATTR_MTIME = 1 << 5
FATTR_ATIME_NOW = 1 << 7
FATTR_MTIME_NOW = 1 << 8

IN_HEADER = struct.Struct("<IIQQIIIHH")  # len opcode unique nodeid uid gid pid extlen pad
OUT_HEADER = struct.Struct("<IiQ")  # len error unique
# Times are signed seconds (the kernel reads the u64 fields as s64): a file
# may be dated before 1970 (tar of old archives, touch -d 1960-01-01).
ATTR = struct.Struct("<QQQqqqIIIIIIIIII")  # fuse_attr
ENTRY_OUT = struct.Struct("<QQQQII" + ATTR.format[1:])  # fuse_entry_out
ATTR_OUT = struct.Struct("<QII" + ATTR.format[1:])  # fuse_attr_out
OPEN_OUT = struct.Struct("<QIi")  # fh open_flags backing_id
INIT_IN = struct.Struct("<IIII")  # major minor max_readahead flags (+ flags2, unused)
INIT_OUT = struct.Struct("<IIIIHHIIHHIIH22x")  # 64 bytes
OPEN_IN = struct.Struct("<II")  # flags open_flags
CREATE_IN = struct.Struct("<IIII")  # flags mode umask open_flags
MKNOD_IN = struct.Struct("<IIII")  # mode rdev umask padding
MKDIR_IN = struct.Struct("<II")  # mode umask
RENAME_IN = struct.Struct("<Q")  # newdir
RENAME2_IN = struct.Struct("<QII")  # newdir flags padding
LINK_IN = struct.Struct("<Q")  # oldnodeid
READ_IN = struct.Struct("<QQIIQII")  # fh offset size read_flags lock_owner flags padding
WRITE_IN = struct.Struct("<QQIIQII")  # fh offset size write_flags lock_owner flags padding
WRITE_OUT = struct.Struct("<II")
RELEASE_IN = struct.Struct("<QIIQ")  # fh flags release_flags lock_owner
FLUSH_IN = struct.Struct("<QIIQ")  # fh unused padding lock_owner
FSYNC_IN = struct.Struct("<QII")  # fh fsync_flags padding
INTERRUPT_IN = struct.Struct("<Q")  # unique of the interrupted request
FORGET_IN = struct.Struct("<Q")  # nlookup
BATCH_FORGET_IN = struct.Struct("<II")  # count dummy
FORGET_ONE = struct.Struct("<QQ")  # nodeid nlookup
SETATTR_IN = struct.Struct("<IIQQQqqqIIIIIIII")  # fuse_setattr_in (signed times)
KSTATFS = struct.Struct("<QQQQQIIII24x")  # fuse_kstatfs
DIRENT = struct.Struct("<QQII")  # ino off namelen type (then the name)
# A notification is an out header with unique 0 and its code in the error field.
NOTIFY_INVAL_INODE = 2
NOTIFY_INVAL_INODE_OUT = struct.Struct("<Qqq")  # nodeid offset (-1: attributes only) length
NOTIFY_STORE = 4
NOTIFY_STORE_OUT = struct.Struct("<QQII")  # nodeid offset size padding (then the bytes)
assert (IN_HEADER.size, OUT_HEADER.size, ATTR.size) == (40, 16, 88)
assert (ENTRY_OUT.size, ATTR_OUT.size, INIT_OUT.size, SETATTR_IN.size) == (128, 104, 64, 88)
assert (READ_IN.size, WRITE_IN.size, KSTATFS.size) == (40, 40, 80)


class Attributes(Protocol):
    """What a reply says of an inode (the kernel's struct fuse_attr)."""

    @property
    def ino(self) -> int: ...
    @property
    def mode(self) -> int: ...
    @property
    def nlink(self) -> int: ...
    @property
    def uid(self) -> int: ...
    @property
    def gid(self) -> int: ...
    @property
    def size(self) -> int: ...
    @property
    def blksize(self) -> int: ...
    @property
    def atime_ns(self) -> int: ...
    @property
    def mtime_ns(self) -> int: ...
    @property
    def ctime_ns(self) -> int: ...


def _attr_fields(a: Attributes) -> tuple[int, ...]:
    return (
        a.ino,
        a.size,
        -(-a.size // 512),
        a.atime_ns // 1_000_000_000,
        a.mtime_ns // 1_000_000_000,
        a.ctime_ns // 1_000_000_000,
        a.atime_ns % 1_000_000_000,
        a.mtime_ns % 1_000_000_000,
        a.ctime_ns % 1_000_000_000,
        a.mode,
        a.nlink,
        a.uid,
        a.gid,
        0,  # rdev
        a.blksize,
        0,  # flags
    )


def _valid(seconds: float) -> tuple[int, int]:
    whole = int(seconds)
    return whole, int((seconds - whole) * 1e9)


def entry_out(a: Attributes, timeout: float) -> bytes:
    sec, nsec = _valid(timeout)
    return ENTRY_OUT.pack(a.ino, 0, sec, sec, nsec, nsec, *_attr_fields(a))


def attr_out(a: Attributes, timeout: float) -> bytes:
    sec, nsec = _valid(timeout)
    return ATTR_OUT.pack(sec, nsec, 0, *_attr_fields(a))


def open_out(fh: int, flags: int) -> bytes:
    return OPEN_OUT.pack(fh, flags, 0)


def dirent_plus_size(name: bytes) -> int:
    """The bytes :func:`dirent_plus` takes for ``name``."""
    size = ENTRY_OUT.size + DIRENT.size + len(name)
    return size + (-size % 8)


def dirent_plus(name: bytes, a: Attributes, offset: int, timeout: float) -> bytes:
    """One fuse_direntplus, padded to 8 bytes."""
    head = entry_out(a, timeout) + DIRENT.pack(a.ino, offset, len(name), (a.mode >> 12) & 0o17)
    record = head + name
    return record + b"\0" * (-len(record) % 8)


def names(body: memoryview | bytes, count: int) -> list[bytes]:
    """The first ``count`` NUL-terminated names of a request body."""
    raw = bytes(body)
    out: list[bytes] = []
    start = 0
    for _ in range(count):
        end = raw.index(b"\0", start)
        out.append(raw[start:end])
        start = end + 1
    return out


def statfs_out(st: os.statvfs_result) -> bytes:
    return KSTATFS.pack(
        st.f_blocks,
        st.f_bfree,
        st.f_bavail,
        st.f_files,
        st.f_ffree,
        st.f_bsize,
        st.f_namemax,
        st.f_frsize,
        0,
    )
