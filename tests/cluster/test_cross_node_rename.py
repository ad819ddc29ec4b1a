"""Renames done on one node of files another node is still flushing.

A multi-node job's ranks write their shards into a temporary directory and
rank 0, on whichever node it runs, renames the directory into place; or a
file saved on one node is moved into place from another. The writer's
flusher publishes at the path it knows: it found no name there, took the
file for removed and dropped its only copies (fs/store/renamelog.py). Real
daemons, one backing directory, random data compared whole.
"""

from __future__ import annotations

import os
from pathlib import Path

from ckptfs.fs.store.manifest import read_manifest
from clusters import PEER_LOGS, cluster
from waits import wait_for

MiB = 1 << 20
SLOW = {"CKPTFS_FLUSH_BANDWIDTH": "256KiB", "CKPTFS_CHUNK_SIZE": "256KiB"}


def durable_at(backing: Path, rel: str, holders: list[str]) -> None:
    m = read_manifest(backing / rel)
    assert m is not None and m.state == "durable" and m.holders == holders, (rel, m)


def cold_reads(mounts, name: str, files: dict[str, bytes]) -> None:
    """Mount with an empty cache, read every file whole, unmount; twice."""
    for i in range(2):
        c = mounts(f"{name}{i}")
        c.mount()
        for rel, data in files.items():
            assert (c.mnt / rel).read_bytes() == data, rel
        c.umount()


def writer_and_renamer(mounts, tmp_path: Path):
    """n1, whose flush is slow (its files stay pending), and n2."""
    nodes = cluster(mounts, tmp_path, ["n1", "n2"], {"n1": SLOW, "n2": {}})
    for n in nodes.values():
        n.allowed_log += PEER_LOGS
    return nodes["n1"], nodes["n2"]


def test_a_checkpoint_directory_renamed_on_another_node_is_made_durable_where_it_is(
    mounts, tmp_path
):
    """Ranks on n1 and n2 write their shards into iter_100.tmp; rank 0, on
    n2, renames it to iter_100 and writes the tracker file while n1's shard
    is still flushing. n1 makes its shard durable at the new path."""
    n1, n2 = writer_and_renamer(mounts, tmp_path)
    (n2.mnt / "iter_100.tmp").mkdir()
    files = {
        "iter_100/shard0.pt": os.urandom(2 * MiB + 11),
        "iter_100/shard1.pt": os.urandom(MiB + 5),
    }
    (n1.mnt / "iter_100.tmp" / "shard0.pt").write_bytes(files["iter_100/shard0.pt"])
    (n2.mnt / "iter_100.tmp" / "shard1.pt").write_bytes(files["iter_100/shard1.pt"])
    assert read_manifest(n1.backing / "iter_100.tmp" / "shard0.pt").state == "pending"
    os.rename(n2.mnt / "iter_100.tmp", n2.mnt / "iter_100")
    (n2.mnt / "latest_checkpointed_iteration.txt").write_text("100")
    files["latest_checkpointed_iteration.txt"] = b"100"
    # Read back on the renaming node while n1 still holds the only copies.
    assert (n2.mnt / "iter_100" / "shard0.pt").read_bytes() == files["iter_100/shard0.pt"]
    n1.wait_durable(60)
    n2.wait_durable(60)
    durable_at(n1.backing, "iter_100/shard0.pt", ["n1"])
    durable_at(n1.backing, "iter_100/shard1.pt", ["n2"])
    assert not (n1.backing / "iter_100.tmp").exists()
    log = n1.log()
    assert "renamed to iter_100/shard0.pt on another node: published there" in log, log
    assert "no longer names this file" not in log, log
    for n in (n1, n2):
        n.umount()
    cold_reads(mounts, "c", files)


def test_a_file_moved_into_place_on_another_node_then_its_writer_dead_is_taken_over_there(
    mounts, tmp_path
):
    """n1 saves model.pt.tmp; n2 moves it over the durable model.pt; n1 dies
    before its flush. n2, its buddy, takes it over and publishes it fenced
    at model.pt, where the rename put it."""
    nodes = cluster(mounts, tmp_path, ["n1", "n2"], {"n1": SLOW, "n2": SLOW})
    n1, n2 = nodes["n1"], nodes["n2"]
    n2.allowed_log += PEER_LOGS + ["is dead", "taking over"]
    (n2.mnt / "model.pt").write_bytes(os.urandom(MiB))
    n2.wait_durable(60)
    new = os.urandom(3 * MiB + 17)
    (n1.mnt / "model.pt.tmp").write_bytes(new)
    os.replace(n2.mnt / "model.pt.tmp", n2.mnt / "model.pt")
    n1.kill()
    wait_for(lambda: "taking over model.pt.tmp" in n2.log(), 30, "n2 takes it over")
    n2.umount()
    durable_at(n2.backing, "model.pt", ["n2"])
    log = n2.log()
    assert "renamed to model.pt on another node" in log and "no longer names" not in log, log
    cold_reads(mounts, "c", {"model.pt": new})


def test_a_writer_restarted_after_its_directory_was_renamed_elsewhere_recovers_it(mounts, tmp_path):
    """No peers: m1 dies with a file pending in a directory, which m2 (on
    the same backing directory) renames while m1 is down. m1's mount
    recovers the file from its cache at the path the rename put it."""
    m1, m2 = mounts("m1"), mounts("m2")
    m1.mount("--node", "m1", env=SLOW)
    m2.mount("--node", "m2")
    (m1.mnt / "step.tmp").mkdir()
    data = os.urandom(2 * MiB + 3)
    (m1.mnt / "step.tmp" / "state.pt").write_bytes(data)
    m1.kill()
    os.rename(m2.mnt / "step.tmp", m2.mnt / "step")
    m1.mount("--node", "m1")
    m1.allowed_log = ["recovered"]
    assert "recovered step/state.pt" in m1.log(), m1.log()
    m1.wait_durable(60)
    durable_at(m1.backing, "step/state.pt", ["m1"])
    for m in (m1, m2):
        m.umount()
    cold_reads(mounts, "c", {"step/state.pt": data})


def test_a_file_still_being_written_when_its_directory_is_renamed_elsewhere_keeps_its_writes(
    mounts, tmp_path
):
    """n1 is still writing a shard (its create published it, empty) when
    rank 0 on n2 renames the directory: n1's close publishes it where the
    directory is now, whole, as a local filesystem keeps writes through an
    open file whose directory was renamed."""
    n1, n2 = writer_and_renamer(mounts, tmp_path)
    (n1.mnt / "ckpt.tmp").mkdir()
    data = os.urandom(3 * MiB + 1)
    with open(n1.mnt / "ckpt.tmp" / "shard0.pt", "wb") as f:
        f.write(data[:MiB])
        f.flush()
        os.rename(n2.mnt / "ckpt.tmp", n2.mnt / "ckpt")
        f.write(data[MiB:])
    assert (n2.mnt / "ckpt" / "shard0.pt").read_bytes() == data
    n1.wait_durable(60)
    durable_at(n1.backing, "ckpt/shard0.pt", ["n1"])
    for n in (n1, n2):
        n.umount()
    cold_reads(mounts, "c", {"ckpt/shard0.pt": data})


def test_renamed_twice_elsewhere_then_once_by_its_writer_it_is_durable_at_the_last_name(
    mounts, tmp_path
):
    """n2 renames the directory n1's shard is in twice (tmp, staging,
    final); then the job on n1 renames the shard itself, through n1's mount,
    whose file still has the first path. n1's flush finds it at the end of
    all three (the last rename moves n1's file although n1 never saw the
    first two: it followed the records to the name that rename left)."""
    n1, n2 = writer_and_renamer(mounts, tmp_path)
    (n1.mnt / "tmp").mkdir()
    data = os.urandom(2 * MiB + 9)
    (n1.mnt / "tmp" / "x.pt").write_bytes(data)
    os.rename(n2.mnt / "tmp", n2.mnt / "staging")
    os.rename(n2.mnt / "staging", n2.mnt / "final")
    os.rename(n1.mnt / "final" / "x.pt", n1.mnt / "final" / "model.pt")
    assert {f["path"] for f in n1.stat()["files"]} >= {"final/model.pt"}
    n1.wait_durable(60)
    durable_at(n1.backing, "final/model.pt", ["n1"])
    assert sorted(os.listdir(n1.backing / "final")) == ["model.pt"]
    for n in (n1, n2):
        n.umount()
    cold_reads(mounts, "c", {"final/model.pt": data})


def test_a_node_that_renamed_other_nodes_files_and_crashed_recovers_none_of_them(mounts, tmp_path):
    """Rank 0 on n2 reads the shards n1 wrote (pending there), renames their
    directory, and n2's daemon dies. n2's journal must not name n1's files:
    its recovery adopted them, with no bytes, and flushed zeros as durable."""
    n1, n2 = writer_and_renamer(mounts, tmp_path)
    for n in (n1, n2):
        n.allowed_log += ["is dead", "taking over", "recovered"]
    (n1.mnt / "it.tmp").mkdir()
    data = os.urandom(2 * MiB + 21)
    (n1.mnt / "it.tmp" / "shard0.pt").write_bytes(data)
    assert (n2.mnt / "it.tmp" / "shard0.pt").read_bytes() == data
    os.rename(n2.mnt / "it.tmp", n2.mnt / "it")
    n2.kill()
    n2.mount("--config", str(next(tmp_path.glob("cluster-*.yaml"))), "--node", "n2")
    assert "recovered it/shard0.pt" not in n2.log(), n2.log()
    n1.wait_durable(60)
    durable_at(n1.backing, "it/shard0.pt", ["n1"])
    assert (n2.mnt / "it" / "shard0.pt").read_bytes() == data
    for n in (n1, n2):
        n.umount()
    cold_reads(mounts, "c", {"it/shard0.pt": data})
