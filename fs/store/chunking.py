"""Where a file is cut into chunks.

``plan_chunks`` returns contiguous ``(offset, length)`` ranges covering the
file. It reads the file only through ``read_at`` (blocking; called from a
worker thread), so it works on the RAM cache and on plain files alike, and it
reads only headers and directories, never the tensor data.

Chunking is model-aware so that deduplication survives the bytes before a
tensor moving (a key added to a state dict, a longer pickle):

- ``torch-zip``: a ``torch.save`` archive (or any other zip). Every entry of at
  least ``min(SMALL_PIECE, chunk_size)`` bytes starts and ends a chunk, and is
  cut every ``chunk_size`` bytes counted from the entry's data start, so its
  chunks do not depend on where the entry sits in the file. A zip that has no
  ``data.pkl`` entry is reported as ``zip``.
- ``safetensors``: the same, with the 8-byte length + JSON header as its own
  piece and each tensor's ``data_offsets`` as the entries.
- ``fixed``: ``chunk_size`` steps from offset 0; also the fallback for
  anything that does not parse.

The bytes between large entries (zip local headers, data descriptors, small
entries such as ``data.pkl`` or a LayerNorm weight, the central directory) are
packed into chunks of at most ``chunk_size`` at their own boundaries, so a
checkpoint with thousands of tiny tensors does not become thousands of tiny
chunk files in the backing store.
"""

from __future__ import annotations

import bisect
import json
import struct
from collections.abc import Callable
from dataclasses import dataclass
from itertools import pairwise

ReadAt = Callable[[int, int], bytes]

# Entries smaller than this are packed together with their neighbours rather
# than cut out on their own: below this, a chunk file costs more (a create, an
# fsync and a directory fsync on NFS) than deduplicating it saves.
SMALL_PIECE = 64 << 10
# Upper bounds on metadata we are willing to read; beyond them the file is
# treated as not parseable (fixed chunking) rather than read at length.
MAX_ZIP_DIRECTORY = 256 << 20
MAX_SAFETENSORS_HEADER = 100 << 20  # the limit the safetensors format itself sets
# Headers are read through a window this large, so the thousands of local
# headers of a big archive cost few ``read_at`` calls.
READ_WINDOW = 64 << 10


class _Malformed(ValueError):
    """The file is not the format it looked like; the caller falls back to fixed."""


# What parsing arbitrary bytes can raise (struct on short buffers, json on deep
# nesting, int() on odd JSON values). I/O errors from ``read_at`` are not here:
# they propagate, as for any other read of the file.
_PARSE_ERRORS = (
    _Malformed,
    struct.error,
    ValueError,
    TypeError,
    KeyError,
    IndexError,
    OverflowError,
    RecursionError,
)


@dataclass(frozen=True)
class _Region:
    start: int
    end: int


def fixed_chunks(start: int, end: int, chunk_size: int) -> list[tuple[int, int]]:
    return [(off, min(chunk_size, end - off)) for off in range(start, end, chunk_size)]


def plan_chunks(read_at: ReadAt, size: int, chunk_size: int) -> tuple[str, list[tuple[int, int]]]:
    """Return ``(kind, ranges)``; kind names the chunking used, for the manifest."""
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    reader = _Reader(read_at, size)
    for parse in (_parse_zip, _parse_safetensors):
        try:
            parsed = parse(reader)
        except _PARSE_ERRORS:
            # Not the format it looked like. Fixed chunking is always correct;
            # refusing to chunk would leave the file never durable.
            continue
        if parsed is not None:
            kind, entries, cuts = parsed
            return kind, _tile(size, entries, cuts, chunk_size)
    return "fixed", fixed_chunks(0, size, chunk_size)


class _Reader:
    """Bounds-checked reads through ``read_at`` with a small read-ahead window."""

    def __init__(self, read_at: ReadAt, size: int) -> None:
        self.read_at = read_at
        self.size = size
        self._buf = b""
        self._buf_off = 0

    def read(self, offset: int, length: int, ahead: int = READ_WINDOW) -> bytes:
        """``length`` bytes at ``offset``; on a miss, read ``ahead`` bytes into the window."""
        if offset < 0 or length < 0 or offset + length > self.size:
            raise _Malformed(f"read of {length} bytes at {offset} is outside the file")
        rel = offset - self._buf_off
        if 0 <= rel and rel + length <= len(self._buf):
            return self._buf[rel : rel + length]
        want = max(length, min(ahead, self.size - offset))
        data = bytes(self.read_at(offset, want))
        if len(data) < length:
            raise _Malformed(f"short read at {offset}")
        self._buf, self._buf_off = data, offset
        return data[:length]


def _tile(
    size: int, entries: list[_Region], cuts: set[int], chunk_size: int
) -> list[tuple[int, int]]:
    """Cut [0, size) into ranges: large entries on their own, the rest packed.

    ``entries`` are sorted, non-overlapping data regions; ``cuts`` are further
    offsets where a packed chunk may end (header and small-entry boundaries).
    """
    small = min(SMALL_PIECE, chunk_size)
    large = [e for e in entries if e.end - e.start >= small]
    starts = [e.start for e in large]

    def inside_large(offset: int) -> bool:
        i = bisect.bisect_right(starts, offset) - 1
        return i >= 0 and large[i].start < offset < large[i].end

    bounds = {0, size} | {c for c in cuts if 0 < c < size and not inside_large(c)}
    for e in large:
        bounds.update((e.start, e.end))
    large_starts = set(starts)
    points = sorted(bounds)
    ranges: list[tuple[int, int]] = []
    run_start = run_end = 0  # the packed run being built, [run_start, run_end)

    def flush_run() -> None:
        nonlocal run_start
        if run_end > run_start:
            ranges.append((run_start, run_end - run_start))
        run_start = run_end

    for start, end in pairwise(points):
        if start in large_starts or end - start >= chunk_size:
            # A large entry, or a header too big to pack: cut from its own start.
            flush_run()
            ranges.extend(fixed_chunks(start, end, chunk_size))
            run_start = run_end = end
        else:
            if end - run_start > chunk_size:
                flush_run()
            run_end = end
    flush_run()
    return ranges


# --- zip (torch.save) -------------------------------------------------------

_EOCD = struct.Struct("<IHHHHIIH")  # end of central directory
_EOCD_SIG = 0x06054B50
_ZIP64_LOCATOR = struct.Struct("<IIQI")
_ZIP64_LOCATOR_SIG = 0x07064B50
_ZIP64_EOCD = struct.Struct("<IQHHIIQQQQ")
_ZIP64_EOCD_SIG = 0x06064B50
_CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")
_CENTRAL_SIG = 0x02014B50
_LOCAL = struct.Struct("<IHHHHHIIIHH")
_LOCAL_SIG = 0x04034B50
_MAX_COMMENT = 0xFFFF


@dataclass
class _ZipEntry:
    name: str
    header_offset: int
    compressed_size: int


def _parse_zip(r: _Reader) -> tuple[str, list[_Region], set[int]] | None:
    if r.size < _EOCD.size:
        return None
    # One read of the tail brings in the end records and, for all but huge
    # archives, the whole central directory.
    r.read(max(0, r.size - READ_WINDOW), min(r.size, READ_WINDOW))
    eocd_off = _find_eocd(r)
    if eocd_off is None:
        return None
    count, cd_size, cd_off = _directory_location(r, eocd_off)
    if cd_off + cd_size > r.size or cd_size > MAX_ZIP_DIRECTORY:
        raise _Malformed("central directory outside the file")
    entries = _central_directory(r.read(cd_off, cd_size), count)
    entries.sort(key=lambda e: e.header_offset)
    regions: list[_Region] = []
    cuts = {cd_off}
    prev_end = 0
    header_ends = [e.header_offset + _LOCAL.size for e in entries]
    last = 0  # the furthest local header that fits one window from the current one
    for i, e in enumerate(entries):
        if e.header_offset < prev_end:
            raise _Malformed(f"zip entry {e.name!r} overlaps the previous one")
        # Read ahead through the following local headers that are near, and
        # no further: the window must not drag a large tensor's data in.
        last = max(last, i)
        while last + 1 < len(entries) and header_ends[last + 1] - e.header_offset <= READ_WINDOW:
            last += 1
        start = _data_start(r, e, header_ends[last] - e.header_offset)
        end = start + e.compressed_size
        if end > cd_off:
            raise _Malformed(f"zip entry {e.name!r} runs into the central directory")
        regions.append(_Region(start, end))
        cuts.update((e.header_offset, start, end))
        prev_end = end
    torch = any(e.name == "data.pkl" or e.name.endswith("/data.pkl") for e in entries)
    return ("torch-zip" if torch else "zip"), regions, cuts


def _find_eocd(r: _Reader) -> int | None:
    # torch writes no archive comment, so the record is almost always the last
    # 22 bytes; otherwise search the tail a comment can occupy.
    last = r.size - _EOCD.size
    if struct.unpack("<I", r.read(last, 4))[0] == _EOCD_SIG:
        return last
    tail_start = max(0, last - _MAX_COMMENT)
    tail = r.read(tail_start, r.size - tail_start)
    pos = tail.rfind(b"PK\x05\x06")
    while pos >= 0:
        comment_len = struct.unpack_from("<H", tail, pos + 20)[0] if pos + 22 <= len(tail) else -1
        if pos + _EOCD.size + comment_len == len(tail):
            return tail_start + pos
        pos = tail.rfind(b"PK\x05\x06", 0, pos)
    return None


def _directory_location(r: _Reader, eocd_off: int) -> tuple[int, int, int]:
    """Return (entry count, central directory size, central directory offset)."""
    _, disk, cd_disk, _, count, cd_size, cd_off, _ = _EOCD.unpack(r.read(eocd_off, _EOCD.size))
    loc_off = eocd_off - _ZIP64_LOCATOR.size
    if loc_off >= 0:
        sig, _, z64_off, _ = _ZIP64_LOCATOR.unpack(r.read(loc_off, _ZIP64_LOCATOR.size))
        if sig == _ZIP64_LOCATOR_SIG:
            rec = _ZIP64_EOCD.unpack(r.read(z64_off, _ZIP64_EOCD.size))
            if rec[0] != _ZIP64_EOCD_SIG:
                raise _Malformed("zip64 locator points at no zip64 record")
            disk, cd_disk, count, cd_size, cd_off = rec[4], rec[5], rec[7], rec[8], rec[9]
    if disk != 0 or cd_disk != 0:
        raise _Malformed("multi-disk zip")
    return count, cd_size, cd_off


def _central_directory(cd: bytes, count: int) -> list[_ZipEntry]:
    entries = []
    pos = 0
    for _ in range(count):
        if pos + _CENTRAL.size > len(cd):
            raise _Malformed("central directory is truncated")
        fields = _CENTRAL.unpack_from(cd, pos)
        if fields[0] != _CENTRAL_SIG:
            raise _Malformed(f"bad central directory signature at {pos}")
        csize, usize = fields[8], fields[9]
        name_len, extra_len, comment_len = fields[10], fields[11], fields[12]
        disk, header_offset = fields[13], fields[16]
        name_start = pos + _CENTRAL.size
        extra_start = name_start + name_len
        pos = extra_start + extra_len + comment_len
        if pos > len(cd):
            raise _Malformed("central directory entry is truncated")
        name = cd[name_start:extra_start].decode("utf-8", "replace")
        csize, header_offset = _apply_zip64_extra(
            cd[extra_start : extra_start + extra_len], usize, csize, header_offset, disk
        )
        entries.append(_ZipEntry(name, header_offset, csize))
    return entries


def _apply_zip64_extra(
    extra: bytes, usize: int, csize: int, header_offset: int, disk: int
) -> tuple[int, int]:
    """Replace 0xFFFFFFFF fields by their values in the zip64 extra field."""
    pos = 0
    while pos + 4 <= len(extra):
        tag, length = struct.unpack_from("<HH", extra, pos)
        body = extra[pos + 4 : pos + 4 + length]
        pos += 4 + length
        if tag != 0x0001:
            continue
        # Present in this order, each only when its 32-bit field overflowed.
        values = iter(struct.unpack_from(f"<{len(body) // 8}Q", body))
        try:
            if usize == 0xFFFFFFFF:
                next(values)
            if csize == 0xFFFFFFFF:
                csize = next(values)
            if header_offset == 0xFFFFFFFF:
                header_offset = next(values)
        except StopIteration:
            raise _Malformed("zip64 extra field is too short") from None
        return csize, header_offset
    if 0xFFFFFFFF in (csize, header_offset):
        raise _Malformed("zip64 sizes without a zip64 extra field")
    return csize, header_offset


def _data_start(r: _Reader, e: _ZipEntry, ahead: int) -> int:
    # The local header's extra field differs from the central one (torch pads
    # it to align tensor data), so only the local header says where data starts.
    fields = _LOCAL.unpack(r.read(e.header_offset, _LOCAL.size, ahead))
    if fields[0] != _LOCAL_SIG:
        raise _Malformed(f"zip entry {e.name!r} has no local header at {e.header_offset}")
    return e.header_offset + _LOCAL.size + fields[9] + fields[10]


# --- safetensors -------------------------------------------------------------


def _parse_safetensors(r: _Reader) -> tuple[str, list[_Region], set[int]] | None:
    if r.size < 10:
        return None
    (header_len,) = struct.unpack("<Q", r.read(0, 8))
    if header_len > MAX_SAFETENSORS_HEADER or 8 + header_len > r.size:
        return None
    if r.read(8, 1) != b"{":
        return None
    try:
        header = json.loads(r.read(8, header_len))
    except (ValueError, UnicodeDecodeError):
        raise _Malformed("safetensors header is not JSON") from None
    if not isinstance(header, dict):
        raise _Malformed("safetensors header is not an object")
    data_start = 8 + header_len
    regions = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, end = (int(x) for x in info["data_offsets"])
        except (TypeError, KeyError, ValueError):
            raise _Malformed(f"tensor {name!r} has no valid data_offsets") from None
        if not 0 <= begin <= end or data_start + end > r.size:
            raise _Malformed(f"tensor {name!r} lies outside the file")
        regions.append(_Region(data_start + begin, data_start + end))
    regions.sort(key=lambda g: (g.start, g.end))
    for a, b in pairwise(regions):
        if b.start < a.end:
            raise _Malformed("safetensors tensors overlap")
    cuts = {data_start} | {g.start for g in regions} | {g.end for g in regions}
    return "safetensors", regions, cuts
