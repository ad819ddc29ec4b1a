"""A manifest file's records (fs/store/manifest.py): the first, written by a
publish, and those a flush appends; the last whole, sealed one is the manifest."""

from __future__ import annotations

import pytest
from ckptfs.fs.store.manifest import MAGIC, Chunk, Manifest, ManifestError

KEY = b"k" * 32
OWNER = (1000, 1000)


def pending() -> Manifest:
    return Manifest("f1", "v1", 10, 0o644, 1, "pending", ["n1", "n2"], seq=3)


def durable() -> Manifest:
    return Manifest("f1", "v1", 10, 0o644, 1, "durable", ["n1"], [Chunk(0, 10, "a" * 32)], seq=3)


def parse(data: bytes, key: bytes | None = KEY) -> Manifest:
    return Manifest.from_bytes(data, "m", key, OWNER)


def test_the_last_record_is_the_manifest():
    data = pending().to_bytes(KEY, OWNER) + durable().record(KEY, OWNER)
    assert data.startswith(MAGIC) and data.count(b"\n") == 3
    m = parse(data)
    assert m == durable() and m.sealed
    assert parse(pending().to_bytes(KEY, OWNER)) == pending()  # one record, as ever


def test_a_torn_append_leaves_the_record_before_it():
    whole = durable().record(KEY, OWNER)
    for cut in (1, len(whole) // 2, len(whole) - 2):
        m = parse(pending().to_bytes(KEY, OWNER) + whole[:cut])
        assert m == pending() and m.sealed, cut


def test_an_appended_record_without_the_seal_is_passed_over():
    """A file's owner can append to its manifest (from a login node's
    mount); with the store's key, only records ckptfs sealed count."""
    forged = durable().record()  # no key: no seal
    m = parse(pending().to_bytes(KEY, OWNER) + forged)
    assert m == pending() and m.sealed
    # A seal for another owner (a copy of someone else's record) is no seal.
    m = parse(pending().to_bytes(KEY, OWNER) + durable().record(KEY, (0, 0)))
    assert m == pending() and m.sealed
    # Without the key (offline tools that have none), the last record.
    assert parse(pending().to_bytes(KEY, OWNER) + forged, key=None) == durable()
    # Nothing sealed at all: the last record, unsealed (served as a plain file).
    m = parse(pending().to_bytes() + forged)
    assert m == durable() and not m.sealed


def test_a_manifest_with_no_whole_record_is_an_error():
    with pytest.raises(ManifestError, match="no record"):
        parse(MAGIC)
    with pytest.raises(ManifestError, match="malformed"):
        parse(MAGIC + b'{"file_id": "f1"')
