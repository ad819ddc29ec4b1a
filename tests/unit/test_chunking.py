"""Model-aware chunking: tiling, cut positions, and deduplication across saves."""

from __future__ import annotations

import io
import json
import struct
import zipfile

import pytest
from ckptfs.fs.store.chunking import SMALL_PIECE, plan_chunks
from ckptfs.fs.store.chunkstore import chunk_hash
from data import safetensors_bytes
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tensors import state_dict

torch = pytest.importorskip("torch")

KiB = 1 << 10
MiB = 1 << 20


class Recorder:
    """A ``read_at`` over bytes that counts what was read."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.calls = 0
        self.bytes_read = 0

    def __call__(self, offset: int, length: int) -> bytes:
        self.calls += 1
        self.bytes_read += length
        return self.data[offset : offset + length]


def plan(data: bytes, chunk_size: int) -> tuple[str, list[tuple[int, int]]]:
    kind, ranges = plan_chunks(Recorder(data), len(data), chunk_size)
    assert_tiles(ranges, len(data))
    return kind, ranges


def assert_tiles(ranges: list[tuple[int, int]], size: int) -> None:
    expected = 0
    for off, length in ranges:
        assert off == expected, f"gap or overlap at {expected}: next range starts at {off}"
        assert length > 0
        expected += length
    assert expected == size


def cuts(ranges: list[tuple[int, int]]) -> set[int]:
    return {off for off, _ in ranges} | {off + n for off, n in ranges}


def saved(obj: object) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def zip_data_spans(data: bytes) -> dict[str, tuple[int, int]]:
    """Where each entry's data lies, per the stdlib zipfile and the local headers."""
    spans = {}
    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        for info in zf.infolist():
            name_len, extra_len = struct.unpack_from("<HH", data, info.header_offset + 26)
            start = info.header_offset + 30 + name_len + extra_len
            spans[info.filename] = (start, start + info.compress_size)
    return spans


def new_bytes(old: bytes, new: bytes, chunk_size: int) -> int:
    """Bytes of ``new`` whose chunks are not among ``old``'s chunks."""
    _, old_ranges = plan(old, chunk_size)
    _, new_ranges = plan(new, chunk_size)
    known = {chunk_hash(old[o : o + n]) for o, n in old_ranges}
    return sum(n for o, n in new_ranges if chunk_hash(new[o : o + n]) not in known)


# --- torch.save archives ----------------------------------------------------


def test_torch_archive_is_cut_at_entry_boundaries() -> None:
    data = saved(state_dict(0, layers=3, numel=40_000))
    kind, ranges = plan(data, 4 * MiB)
    assert kind == "torch-zip"
    spans = zip_data_spans(data)
    big = [s for s in spans.values() if s[1] - s[0] >= SMALL_PIECE]
    assert len(big) == 3
    for start, end in big:
        assert (start, end - start) in ranges, "a large tensor is one chunk of its own"
    assert max(n for _, n in ranges) <= 4 * MiB


def test_large_torch_entries_split_from_their_data_start() -> None:
    chunk = 1 * MiB
    data = saved(state_dict(1, layers=3, numel=700_000))  # 2.8 MB per tensor, ~8.4 MB file
    assert len(data) > 8 * MiB
    recorder = Recorder(data)
    kind, ranges = plan_chunks(recorder, len(data), chunk)
    assert_tiles(ranges, len(data))
    assert kind == "torch-zip"
    found = cuts(ranges)
    for name, (start, end) in zip_data_spans(data).items():
        if end - start < SMALL_PIECE:
            continue
        expected = set(range(start, end, chunk)) | {end}
        assert expected <= found, name
        inner = [c for c in found if start < c < end]
        assert sorted(inner) == sorted(expected - {start, end}), name
    # Only headers and directories were read, not the tensors.
    assert recorder.bytes_read < 512 * KiB
    assert recorder.calls < 20


def test_legacy_torch_format_is_fixed() -> None:
    buf = io.BytesIO()
    torch.save({"w": torch.randn(1000)}, buf, _use_new_zipfile_serialization=False)
    data = buf.getvalue()
    kind, ranges = plan(data, 1024)
    assert kind == "fixed"
    assert ranges == [(o, min(1024, len(data) - o)) for o in range(0, len(data), 1024)]


def test_zip_without_pickle_is_plain_zip() -> None:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr("a.bin", bytes(range(256)) * 512)
        zf.writestr("b.txt", "hello")
    kind, _ = plan(buf.getvalue(), 64 * KiB)
    assert kind == "zip"


def test_zip64_records_and_extra_fields(monkeypatch: pytest.MonkeyPatch) -> None:
    # Writing a >4 GiB archive is too slow for a unit test; lowering the
    # stdlib's limits makes it write every zip64 structure for small files.
    monkeypatch.setattr(zipfile, "ZIP64_LIMIT", 0)
    monkeypatch.setattr(zipfile, "ZIP_FILECOUNT_LIMIT", 0)
    blobs = {f"archive/data/{i}": bytes([i]) * (100 * KiB + i) for i in range(5)}
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_STORED) as zf:
        zf.writestr("archive/data.pkl", b"pickle")
        for name, blob in blobs.items():
            zf.writestr(name, blob)
    data = buf.getvalue()
    assert b"PK\x06\x06" in data and b"PK\x06\x07" in data
    kind, ranges = plan(data, 64 * KiB)
    assert kind == "torch-zip"
    found = cuts(ranges)
    for name, (start, end) in zip_data_spans(data).items():
        if name in blobs:
            assert data[start:end] == blobs[name]
            assert {start, start + 64 * KiB, end} <= found, name


def test_truncated_or_damaged_archives_fall_back_to_fixed() -> None:
    data = saved(state_dict(2, layers=2, numel=20_000))
    kind, _ = plan(data[:-30], 64 * KiB)
    assert kind == "fixed"
    cd = data.rfind(b"PK\x01\x02")
    damaged = data[:cd] + b"XXXX" + data[cd + 4 :]
    kind, _ = plan(damaged, 64 * KiB)
    assert kind == "fixed"


# --- safetensors ------------------------------------------------------------


def test_safetensors_cut_at_header_and_tensors() -> None:
    tensors = {
        "embed": bytes(range(256)) * 1200,  # 300 KiB: split at 128 KiB steps
        "norm": b"\x01" * 100,
        "head": b"\x02" * (90 * KiB),
    }
    data = safetensors_bytes(tensors, {"format": "pt"})
    chunk = 128 * KiB
    kind, ranges = plan(data, chunk)
    assert kind == "safetensors"
    data_start = 8 + struct.unpack_from("<Q", data)[0]
    found = cuts(ranges)
    assert data_start in found
    embed_end = data_start + len(tensors["embed"])
    assert set(range(data_start, embed_end, chunk)) | {embed_end} <= found
    head_start = len(data) - len(tensors["head"])
    assert (head_start, len(tensors["head"])) in ranges


def test_safetensors_with_bad_offsets_is_fixed() -> None:
    header = json.dumps({"t": {"dtype": "U8", "shape": [4], "data_offsets": [0, 10**9]}}).encode()
    data = struct.pack("<Q", len(header)) + header + b"abcd"
    assert plan(data, 64 * KiB)[0] == "fixed"
    header = b'{"t": 5}'
    assert plan(struct.pack("<Q", len(header)) + header, 64 * KiB)[0] == "fixed"


def test_empty_file() -> None:
    assert plan_chunks(Recorder(b""), 0, 64 * KiB) == ("fixed", [])


# --- any bytes tile the file --------------------------------------------------


@given(data=st.binary(max_size=4096), chunk_size=st.integers(1, 5000))
def test_arbitrary_bytes_tile(data: bytes, chunk_size: int) -> None:
    plan(data, chunk_size)


_ARCHIVE = saved({"a": torch.arange(3000), "b": torch.ones(20), "c": torch.zeros(5000)})


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(
    flips=st.lists(st.tuples(st.integers(0, len(_ARCHIVE) - 1), st.integers(0, 255)), max_size=8),
    tail_bias=st.booleans(),
    chunk_size=st.integers(1, 70_000),
)
def test_mutated_archives_tile(
    flips: list[tuple[int, int]], tail_bias: bool, chunk_size: int
) -> None:
    data = bytearray(_ARCHIVE)
    for pos, value in flips:
        # Most of the interesting structure is in the central directory at the end.
        if tail_bias:
            pos = len(data) - 1 - pos % 1200
        data[pos] = value
    plan(bytes(data), chunk_size)


@given(
    header=st.recursive(
        st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner),
        max_leaves=10,
    ),
    body=st.binary(max_size=300),
    chunk_size=st.integers(1, 500),
)
def test_arbitrary_safetensors_headers_tile(header: object, body: bytes, chunk_size: int) -> None:
    raw = json.dumps(header).encode()
    plan(struct.pack("<Q", len(raw)) + raw + body, chunk_size)


# --- deduplication --------------------------------------------------------------


def test_added_key_keeps_tensor_chunks() -> None:
    chunk = 1 * MiB
    old = state_dict(3, layers=10)
    new = {"step": torch.tensor(1000), "extra.bias": torch.randn(32)}  # pickle grows, data moves
    new.update(old)
    new["layer7.weight"] = torch.randn(192 * 1024)  # ~1/10 of the bytes changed
    a, b = saved(old), saved(new)
    assert sum(t.nbytes for t in old.values()) > 0.9 * len(a)
    fresh = new_bytes(a, b, chunk)
    assert fresh <= 0.15 * len(b), f"{fresh} of {len(b)} bytes are new"


def test_same_state_dict_twice_has_identical_tensor_chunks() -> None:
    chunk = 256 * KiB
    sd = state_dict(4)
    a, b = saved(sd), saved(sd)

    def tensor_chunks(data: bytes) -> set[str]:
        _, ranges = plan(data, chunk)
        spans = [s for s in zip_data_spans(data).values() if s[1] - s[0] >= SMALL_PIECE]
        return {
            chunk_hash(data[o : o + n])
            for o, n in ranges
            if any(s <= o and o + n <= e for s, e in spans)
        }

    assert tensor_chunks(a) == tensor_chunks(b)
    assert len(tensor_chunks(a)) >= 8
    assert new_bytes(a, b, chunk) < 64 * KiB


def test_safetensors_one_changed_tensor() -> None:
    tensors = {f"t{i}": bytes([i]) * (200 * KiB + i) for i in range(10)}
    a = safetensors_bytes(tensors)
    tensors["t4"] = bytes([99]) * len(tensors["t4"])
    b = safetensors_bytes(tensors)
    fresh = new_bytes(a, b, 128 * KiB)
    header = 8 + struct.unpack_from("<Q", b)[0]
    assert len(tensors["t4"]) <= fresh <= len(tensors["t4"]) + header


def test_safetensors_empty_tensor_next_to_a_large_one() -> None:
    # Writers give an empty tensor the same offset as the tensor after it.
    big = b"\x07" * (100 * KiB)
    header = {
        "big": {"dtype": "U8", "shape": [len(big)], "data_offsets": [0, len(big)]},
        "empty": {"dtype": "U8", "shape": [0], "data_offsets": [0, 0]},
    }
    raw = json.dumps(header).encode()
    data = struct.pack("<Q", len(raw)) + raw + big
    kind, ranges = plan(data, 64 * KiB)
    assert kind == "safetensors"
    assert (8 + len(raw), 64 * KiB) in ranges
