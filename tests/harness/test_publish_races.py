"""A flush's durable manifest and another node's rename onto the same name,
in the store (fs/store/publish.py): the flush checks what the name holds and
then writes, and another node's rename may land between the two (or while
the flushing node is stopped between them). Two Backing objects over one
directory stand for the two nodes; the rename is made in the flush's
``before`` hook, which runs after the check and before the write."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import trio
from ckptfs.fs.store.backing import Backing
from ckptfs.fs.store.blocking import BackingIO
from ckptfs.fs.store.manifest import Chunk, Manifest, read_manifest
from ckptfs.fs.store.publish import Published

UID, GID = os.getuid(), os.getgid()


def pending(file_id: str, version: str, node: str, size: int = 10) -> Manifest:
    return Manifest(file_id, version, size, 0o644, 1, "pending", [node], seq=1)


def durable(file_id: str, version: str, node: str, size: int = 10) -> Manifest:
    chunk = Chunk(0, size, "0" * 32)
    return Manifest(file_id, version, size, 0o644, 1, "durable", [node], [chunk], seq=1)


async def flush_x1(node: Backing, rel: str, before: Callable[[], None]) -> Published:
    """Node ``node``'s flush of x1 at version vx, at ``rel``; ``before``
    runs after its check of the name and before its write."""
    return await node.replace_manifest(
        rel, durable("x1", "vx", "n1"), (UID, GID), file_id="x1", expect_version="vx",
        before=before,
    )  # fmt: skip


def stores(tmp_path: Path) -> tuple[Path, Backing, Backing]:
    root = tmp_path / "store"
    root.mkdir()
    return root, Backing(root, BackingIO(5)), Backing(root, BackingIO(5))


def test_a_rename_onto_the_name_between_a_flushs_check_and_write_is_not_undone(tmp_path):
    """n1 flushes X (pending at model.pt); n3 replaces model.pt with its own
    file Y (os.replace of a temporary name) just after n1's check. The name
    must keep Y, the newer file, and n1 learns that the name is gone. (The
    fault trials met it as NOT NEWEST: n1 stopped between its check and its
    write while n3 saved again.)"""
    root, n1, n3 = stores(tmp_path)

    async def main() -> None:
        await n1.create_manifest("model.pt", pending("x1", "vx", "n1"), UID, GID)
        await n3.create_manifest("model.pt.tmp", pending("y1", "vy", "n3"), UID, GID)

        def n3_replaces() -> None:
            os.rename(root / "model.pt.tmp", root / "model.pt")

        result = await flush_x1(n1, "model.pt", n3_replaces)
        assert result is Published.NAME_GONE
        m = read_manifest(root / "model.pt", key=n1.key)
        assert m is not None and (m.file_id, m.version, m.state) == ("y1", "vy", "pending")
        assert m.sealed

    trio.run(main)


def test_a_rename_of_the_file_itself_between_check_and_write_takes_the_durable_state_along(
    tmp_path,
):
    """The same window, but another node renames the file being flushed (a
    job's rank 0 renaming the checkpoint directory): the durable manifest is
    the file's wherever it went, and no manifest is left at the old name."""
    root, n1, n2 = stores(tmp_path)

    async def main() -> None:
        (root / "iter_1.tmp").mkdir()
        await n1.create_manifest("iter_1.tmp/shard.pt", pending("x1", "vx", "n1"), UID, GID)

        def n2_renames() -> None:
            os.rename(root / "iter_1.tmp", root / "iter_1")

        result = await flush_x1(n1, "iter_1.tmp/shard.pt", n2_renames)
        assert result is Published.DONE
        m = read_manifest(root / "iter_1" / "shard.pt", key=n1.key)
        assert m is not None and (m.file_id, m.state, m.sealed) == ("x1", "durable", True)
        assert m.chunks == durable("x1", "vx", "n1").chunks
        assert not (root / "iter_1.tmp").exists()

    trio.run(main)


def test_a_flush_of_a_version_no_longer_at_the_name_changes_nothing(tmp_path):
    """Without a race: the name holds a newer version of the same file
    (another close), or another file; the flush writes nothing."""
    root, n1, _ = stores(tmp_path)

    async def main() -> None:
        await n1.create_manifest("a.pt", pending("x1", "v2", "n2"), UID, GID)
        newer = pending("x1", "v2", "n2")
        newer.seq = 5
        await n1.replace_manifest("a.pt", newer, (UID, GID), file_id="x1")
        before = (root / "a.pt").read_bytes()
        flushed = durable("x1", "v1", "n1")
        result = await n1.replace_manifest(
            "a.pt", flushed, (UID, GID), file_id="x1", expect_version="v1"
        )
        assert result is Published.STALE
        assert (root / "a.pt").read_bytes() == before
        result = await n1.replace_manifest(
            "a.pt", durable("other", "v1", "n1"), (UID, GID), file_id="other", expect_version="v1"
        )
        assert result is Published.NAME_GONE
        assert (root / "a.pt").read_bytes() == before

    trio.run(main)


def test_a_flush_never_appends_through_a_symlink_or_to_a_users_forgery(tmp_path):
    """The name is user input (a login node's mount can put anything there):
    a symlink to a file outside the store, or a copy of the manifest that
    ckptfs did not seal. The flush writes to neither."""
    root, n1, _ = stores(tmp_path)
    outside = tmp_path / "outside.txt"
    outside.write_bytes(b"root's file\n")

    async def main() -> None:
        await n1.create_manifest("a.pt", pending("x1", "vx", "n1"), UID, GID)
        (root / "a.pt").unlink()
        (root / "a.pt").symlink_to(outside)
        assert await flush_x1(n1, "a.pt", lambda: None) is Published.NAME_GONE
        assert outside.read_bytes() == b"root's file\n"
        (root / "a.pt").unlink()
        (root / "a.pt").write_bytes(pending("x1", "vx", "n1").to_bytes())  # unsealed
        forged = (root / "a.pt").read_bytes()
        assert await flush_x1(n1, "a.pt", lambda: None) is Published.NAME_GONE
        assert (root / "a.pt").read_bytes() == forged

    trio.run(main)


def at(m: Manifest, seq: int) -> Manifest:
    m.seq = seq
    return m


def test_a_new_version_never_lands_over_a_newer_version_of_the_same_file(tmp_path):
    """Two nodes rewrite one file in place (an O_TRUNC open of another
    node's file keeps its id). The commit whose version is older than the
    one at the name (Manifest.order) is superseded; a newer one lands."""
    root, n1, n2 = stores(tmp_path)

    async def main() -> None:
        await n1.create_manifest("a.pt", at(pending("x1", "v1", "n1"), 100), UID, GID)
        at_name = (root / "a.pt").read_bytes()
        older = at(pending("x1", "v2", "n2"), 99)
        assert await n2.replace_manifest("a.pt", older, (UID, GID), file_id="x1") is (
            Published.STALE
        )
        assert (root / "a.pt").read_bytes() == at_name
        # One seq, two versions: the version id decides, the same on every node.
        tie = at(pending("x1", "v0", "n2"), 100)
        assert await n2.replace_manifest("a.pt", tie, (UID, GID), file_id="x1") is (Published.STALE)
        newer = at(pending("x1", "v3", "n2"), 101)
        assert await n2.replace_manifest("a.pt", newer, (UID, GID), file_id="x1") is (
            Published.DONE
        )
        m = read_manifest(root / "a.pt", key=n1.key)
        assert m is not None and (m.version, m.seq) == ("v3", 101)

    trio.run(main)


def test_a_flush_whose_manifest_file_is_replaced_after_its_check_looks_again(tmp_path):
    """The flush appends its durable record to the manifest file it checked,
    and another publish replaces that file meanwhile. What the name shows
    then decides, not the replace itself: this very version rewritten (its
    metadata, a buddy's takeover) or an older version of the file that
    landed over it gets the durable manifest; a newer one stays. Calling the
    name gone dropped the only version still owed a flush (bug 9 of
    docs/FAULT-TRIALS.md)."""
    root, n1, n2 = stores(tmp_path)

    def replaced_by(m: Manifest) -> Callable[[], None]:
        def replace() -> None:
            # A publish by another node: a new manifest file renamed onto the name.
            trio.run(n2.create_manifest, "a.pt.new", m, UID, GID)
            os.rename(root / "a.pt.new", root / "a.pt")

        return replace

    async def flush(before: Callable[[], None]) -> Published:
        return await n1.replace_manifest(
            "a.pt", at(durable("x1", "vx", "n1"), 50), (UID, GID), file_id="x1",
            expect_version="vx", before=before,
        )  # fmt: skip

    async def main() -> None:
        for replacement in (at(pending("x1", "vx", "n1"), 50), at(pending("x1", "vy", "n2"), 40)):
            await n1.create_manifest("a.pt", at(pending("x1", "vx", "n1"), 50), UID, GID)
            assert await flush(replaced_by(replacement)) is Published.DONE, replacement
            m = read_manifest(root / "a.pt", key=n1.key)
            assert m is not None and (m.version, m.state) == ("vx", "durable"), replacement
            os.unlink(root / "a.pt")
        await n1.create_manifest("a.pt", at(pending("x1", "vx", "n1"), 50), UID, GID)
        assert await flush(replaced_by(at(pending("x1", "vz", "n2"), 60))) is Published.STALE
        m = read_manifest(root / "a.pt", key=n1.key)
        assert m is not None and (m.version, m.state) == ("vz", "pending")

    trio.run(main)


def test_a_rename_whose_record_cannot_be_written_fails_and_moves_nothing(tmp_path):
    """A directory rename that moves other nodes' pending files is recorded
    first, so that their flushes follow it. A record that cannot be written
    (the store failing: fault trials, seed 2026, trial 124) fails the rename
    rather than lose those files to a flush that cannot find them."""
    root, n1, _ = stores(tmp_path)
    renamed = root / ".ckptfs" / "renamed"

    async def main() -> None:
        (root / "iter_1.tmp").mkdir()
        await n1.create_manifest("iter_1.tmp/shard_0.pt", pending("x1", "vx", "n2"), UID, GID)
        await n1.rename("iter_1.tmp", "iter_0", record_as="n1")  # recorded: fine
        os.rename(root / "iter_0", root / "iter_1.tmp")
        records = sorted(os.listdir(renamed))
        subprocess.run(["chattr", "+i", str(renamed)], check=True)
        try:
            with pytest.raises(OSError) as failed:
                await n1.rename("iter_1.tmp", "iter_1", record_as="n1")
        finally:
            subprocess.run(["chattr", "-i", str(renamed)], check=True)
        assert "record" in str(failed.value)
        assert (root / "iter_1.tmp" / "shard_0.pt").exists() and not (root / "iter_1").exists()
        assert sorted(os.listdir(renamed)) == records

    trio.run(main)
