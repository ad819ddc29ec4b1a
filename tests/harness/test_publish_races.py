"""A flush's durable manifest and another node's rename onto the same name,
in the store (fs/store/publish.py): the flush checks what the name holds and
then writes, and another node's rename may land between the two (or while
the flushing node is stopped between them). Two Backing objects over one
directory stand for the two nodes; the rename is made in the flush's
``before`` hook, which runs after the check and before the write."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

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
