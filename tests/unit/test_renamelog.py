"""The rename log (fs/store/renamelog.py): which renames are recorded, and how a
flusher that finds its file's name gone follows the records to it."""

from __future__ import annotations

import errno
import json
import os
import time
from pathlib import Path

import pytest
from ckptfs.fs.store import renamelog
from ckptfs.fs.store.manifest import Manifest
from ckptfs.fs.store.renamelog import RENAMED_DIR, RenameLog, needs_record, write_record
from ckptfs.fs.store.storedirs import StoreDirs
from manifests import write_store_manifest


def pending(file_id: str, holders: list[str]) -> Manifest:
    return Manifest(file_id, "v" + file_id, 10, 0o644, 1, "pending", holders)


def test_recorded_are_directories_and_other_nodes_pending_files():
    assert needs_record("dir", None, "n2")
    assert needs_record("file", pending("a", ["n1", "n2"]), "n2")  # n1's file, renamed on n2
    assert not needs_record("file", pending("a", ["n2", "n1"]), "n2")  # its own: it repaths
    assert not needs_record("file", pending("a", []), "n2")  # nobody flushes it
    durable = Manifest("a", "v", 10, 0o644, 1, "durable", ["n1"])
    assert not needs_record("file", durable, "n2")
    assert not needs_record("plain", None, "n2") and not needs_record("symlink", None, "n2")


def rename(root: StoreDirs, old: str, new: str, node: str = "n2") -> None:
    write_record(root, old, new, node)
    os.rename(old, new, src_dir_fd=root.root_fd, dst_dir_fd=root.root_fd)


def test_a_flusher_follows_directory_and_file_renames_to_its_file(tmp_path: Path):
    root = StoreDirs(tmp_path)
    try:
        (tmp_path / "ckpt.tmp").mkdir()
        write_store_manifest(
            tmp_path / "ckpt.tmp" / "shard0.pt.tmp",
            pending("f1", ["n1"]),
            backing=tmp_path,
        )
        write_store_manifest(
            tmp_path / "ckpt.tmp" / "shard1.pt",
            pending("f2", ["n1"]),
            backing=tmp_path,
        )
        log = RenameLog()
        assert log.follow(root, "ckpt.tmp/shard1.pt", "f2") is None  # nothing renamed yet
        rename(root, "ckpt.tmp/shard0.pt.tmp", "ckpt.tmp/shard0.pt")
        time.sleep(0.001)
        rename(root, "ckpt.tmp", "ckpt")
        assert log.follow(root, "ckpt.tmp/shard0.pt.tmp", "f1") == "ckpt/shard0.pt"
        assert log.follow(root, "ckpt.tmp/shard1.pt", "f2") == "ckpt/shard1.pt"
        # Another file where the renames lead: not ours, not followed there.
        assert log.follow(root, "ckpt.tmp/shard1.pt", "f9") is None
        # A later save reuses the temporary directory's name, and it is
        # renamed over the last one (the older records match its path too).
        os.rename(tmp_path / "ckpt", tmp_path / "old")
        (tmp_path / "ckpt.tmp").mkdir()
        write_store_manifest(
            tmp_path / "ckpt.tmp" / "shard1.pt",
            pending("f3", ["n1"]),
            backing=tmp_path,
        )
        rename(root, "ckpt.tmp", "ckpt")
        rename(root, "ckpt/shard1.pt", "ckpt/model.pt")
        assert log.follow(root, "ckpt.tmp/shard1.pt", "f3") == "ckpt/model.pt"
        # Records are read once each; one that cannot be parsed is ignored.
        (tmp_path / RENAMED_DIR / "00000000000000000001-n3-x").write_text("{not json")
        assert log.follow(root, "ckpt.tmp/shard1.pt", "f3") == "ckpt/model.pt"
        assert [p.name for p in (tmp_path / RENAMED_DIR).iterdir() if p.name.startswith(".")] == []
    finally:
        root.close()


def test_records_older_than_the_ttl_are_removed_by_the_next_writer(tmp_path: Path, monkeypatch):
    root = StoreDirs(tmp_path)
    try:
        (tmp_path / "a").mkdir()
        write_record(root, "a", "b", "n1")
        (old,) = os.listdir(tmp_path / RENAMED_DIR)
        monkeypatch.setattr(renamelog, "RECORD_TTL", 0.0)
        time.sleep(0.01)
        write_record(root, "b", "c", "n2")
        (young,) = os.listdir(tmp_path / RENAMED_DIR)
        assert young != old and "-n2-" in young
    finally:
        root.close()


def test_the_follow_needs_no_order_and_ignores_records_of_renames_that_failed(tmp_path: Path):
    """Record names start with the writing node's clock: n2's clock ahead of
    n3's puts n2's (earlier) rename after n3's (later) one. A record whose
    rename then failed (ENOTEMPTY) names a move that never happened."""
    root = StoreDirs(tmp_path)
    try:
        d = tmp_path / RENAMED_DIR
        d.mkdir(parents=True)

        def record(at_ns: int, node: str, old: str, new: str) -> None:
            (d / f"{at_ns:020d}-{node}-x").write_text(json.dumps({"old": old, "new": new}))

        (tmp_path / "done").mkdir()
        write_store_manifest(tmp_path / "done" / "x.pt", pending("f1", ["n1"]), backing=tmp_path)
        record(2_000, "n2", "tmp", "final")  # first, by a clock 2 s ahead
        record(1_000, "n3", "final", "done")  # then, by a clock behind
        record(500, "n4", "tmp", "nowhere")  # a rename that failed
        log = RenameLog()
        assert log.follow(root, "tmp/x.pt", "f1") == "done/x.pt"
    finally:
        root.close()


def test_concurrent_readers_each_see_every_record(tmp_path: Path):
    """Store threads read the records at once (several flushes finding
    their names gone after one directory rename), and a writer prunes them
    meanwhile. Each must see every record: a listing of the directory's one
    shared descriptor reads from an offset the others move, and a record
    missed is a pending file dropped as removed (the fault trials' bug 3)."""
    import threading

    root = StoreDirs(tmp_path)
    try:
        for i in range(1200):
            write_record(root, f"run/iter_{i:04d}.tmp", f"run/iter_{i:04d}", "n1")
        seen: list[int] = []
        lock = threading.Lock()

        def read() -> None:
            log = RenameLog()  # each its own parse cache: each lists the directory
            for _ in range(10):
                n = len(log.records(root))
                with lock:
                    seen.append(n)

        def prune() -> None:
            for _ in range(10):
                renamelog._prune(root, time.time_ns())

        threads = [threading.Thread(target=read) for _ in range(6)]
        threads.append(threading.Thread(target=prune))
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert len(seen) == 60 and set(seen) == {1200}, sorted(set(seen))
    finally:
        root.close()


def test_a_store_error_at_a_renamed_path_is_raised_not_taken_for_nothing_there(
    tmp_path, monkeypatch
):
    """The store fails (EIO) while a flush follows a rename: the error
    reaches the flush, which tries again, instead of "moved to nowhere",
    which drops the file (fault trials, seed 77, trial 3)."""
    dirs = StoreDirs(tmp_path)
    write_record(dirs, "a.tmp", "a", "n1")

    def failing(*args, **kwargs):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(renamelog, "read_manifest", failing)
    with pytest.raises(OSError) as raised:
        RenameLog().follow(dirs, "a.tmp/shard.pt", "x1")
    assert raised.value.errno == errno.EIO


def test_a_rename_record_that_cannot_be_read_fails_the_follow(tmp_path, monkeypatch):
    """The store fails (EIO) reading a rename record: without that record
    the rename that moved the file may be unknown, and a flush that took
    its file for gone would drop it (fault trials, seed 1205, trial 56).
    The follow raises, for the flush to try again; a record removed since
    the listing is just not there."""
    dirs = StoreDirs(tmp_path)
    (tmp_path / "d.tmp").mkdir()
    write_store_manifest(tmp_path / "d.tmp" / "s.pt", pending("f1", ["n1"]), backing=tmp_path)
    rename(dirs, "d.tmp", "d")
    real_read = renamelog._read
    failing = {"errno": errno.EIO}

    def read(dfd, name):
        if failing["errno"] is not None:
            raise OSError(failing["errno"], os.strerror(failing["errno"]))
        return real_read(dfd, name)

    monkeypatch.setattr(renamelog, "_read", read)
    log = RenameLog()
    with pytest.raises(OSError) as raised:
        log.follow(dirs, "d.tmp/s.pt", "f1")
    assert raised.value.errno == errno.EIO
    failing["errno"] = errno.ENOENT  # removed between the listing and the read
    assert log.follow(dirs, "d.tmp/s.pt", "f1") is None
    failing["errno"] = None  # the store answers again: the record leads to the file
    assert log.follow(dirs, "d.tmp/s.pt", "f1") == "d/s.pt"
