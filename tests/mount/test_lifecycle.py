"""A file's lifecycle through real mounts: resume cycles, races with the
flusher, names that vanish, versions replaced elsewhere, crash recovery that
must not hang, FUSE service under a full cache, and `ckptfs check`.

Each test here exercises one defect found in the single-node foundation and
checks behaviour only (bytes, manifests, stat, exit codes), so it can run
against any version of the daemon.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import trio
from ckptfs.fs.store.backing import Backing
from ckptfs.fs.store.blocking import BackingIO
from ckptfs.fs.store.chunkstore import ChunkStore, chunk_hash
from ckptfs.fs.store.manifest import Chunk, Manifest, new_id, read_manifest
from ckptfs.fs.store.publish import Published
from countingfs import CountingMount, counting_mount
from data import rand
from manifests import write_store_manifest
from mirrors import durable, pending
from mounts import Mount
from tensors import assert_same, state_dict
from waits import wait_for

MiB = 1 << 20


def exported(m, name: str, dest: Path) -> bytes:  # noqa: ANN001 - a conftest Mount
    dest.mkdir(exist_ok=True)
    for p in dest.iterdir():
        p.unlink()
    m.cli("export", str(m.backing / name), str(dest / name))
    return (dest / name).read_bytes()


def test_resume_cycles_keep_the_checkpoint_durable(mounts, tmp_path):
    """save, umount; then three times: mount, load (plain and mmap), flush --wait, umount."""
    m = mounts()
    m.mount()
    sd = state_dict(1, layers=6, numel=512 * 512)
    torch.save(sd, m.mnt / "x.pt")
    m.umount()
    first = read_manifest(m.backing / "x.pt")
    assert first is not None and first.state == "durable"
    original = exported(m, "x.pt", tmp_path / "export")
    for _ in range(3):
        m.mount()
        assert_same(sd, torch.load(m.mnt / "x.pt"))
        assert_same(sd, torch.load(m.mnt / "x.pt", mmap=True))
        m.cli("flush", str(m.mnt), "--wait")
        m.umount()
        manifest = read_manifest(m.backing / "x.pt")
        assert manifest is not None and manifest.state == "durable", manifest
        assert (manifest.version, manifest.chunks) == (first.version, first.chunks)
        assert "all well" in m.cli("check", str(m.backing)).stdout
        assert exported(m, "x.pt", tmp_path / "export") == original


def test_a_write_racing_a_flush_under_backpressure_keeps_its_bytes(mounts):
    """Reopen a file whose flush is running (no O_TRUNC) and extend it while the
    cache is full of data that is not durable: the flush must not be taken as
    durable for the new bytes, and the page written before the wait must survive."""
    m = mounts()
    m.mount(cache_size="32MiB", env={"CKPTFS_FLUSH_BANDWIDTH": "4MiB"})
    # a.bin's flush ends first, while the writer below waits for memory that only
    # b.bin's (slower) flush would free.
    a = rand(8 * MiB, 2)
    (m.mnt / "a.bin").write_bytes(a)
    (m.mnt / "b.bin").write_bytes(rand(24 * MiB, 1))
    new = rand(MiB, 3)
    fd = os.open(m.mnt / "a.bin", os.O_RDWR)
    try:
        # Straddles the last page of a.bin (in RAM) and a new one (needs memory).
        os.pwrite(fd, new, 8 * MiB - 4096)
        os.fsync(fd)
    finally:
        os.close(fd)
    expected = a[: 8 * MiB - 4096] + new
    m.wait_durable(timeout=120)
    m.cli("evict", str(m.mnt))
    assert (m.mnt / "a.bin").read_bytes() == expected
    m.umount()
    m.mount()
    assert (m.mnt / "a.bin").read_bytes() == expected


def test_files_whose_names_vanish_from_the_backing_store_release_their_memory(mounts):
    """Another node deletes a file while it is written here: closing it must not
    leave its bytes in the cache forever (enough of them would block every write)."""
    m = mounts()
    m.mount(cache_size="32MiB")
    script = f"""
import os
for i in range(8):
    with open({str(m.mnt)!r} + f"/gone{{i}}", "wb") as f:
        f.write(os.urandom(8 << 20))
        os.unlink({str(m.backing)!r} + f"/gone{{i}}")
"""
    # 64 MiB through a 32 MiB cache: blocks for ever if the first files leak. A
    # process blocked on a FUSE request cannot be killed; the mount's teardown
    # kills the daemon, which releases it.
    writer = subprocess.Popen([sys.executable, "-c", script])
    assert writer.wait(timeout=120) == 0
    s = m.stat()
    assert not [f for f in s["files"] if f["path"].startswith("gone")], s["files"]
    assert s["cache"]["dirty"] == 0
    (m.mnt / "after.bin").write_bytes(rand(24 * MiB, 4))
    assert (m.mnt / "after.bin").read_bytes() == rand(24 * MiB, 4)


def test_a_version_replaced_by_another_node_releases_the_old_one(mounts):
    m = mounts()
    m.mount(cache_size="64MiB")
    old = rand(16 * MiB, 5)
    (m.mnt / "x.bin").write_bytes(old)
    m.wait_durable()
    assert (m.mnt / "x.bin").read_bytes() == old  # its pages are in this node's RAM
    # Another node rewrites x.bin: same file, a new durable version.
    new = rand(4 * MiB, 6)
    _rewrite_elsewhere(m.backing, "x.bin", new)
    time.sleep(1.2)  # the kernel's attribute cache
    assert (m.mnt / "x.bin").read_bytes() == new
    m.cli("evict", str(m.mnt))
    assert m.stat()["cache"]["used"] == 0


def _rewrite_elsewhere(backing: Path, rel: str, data: bytes) -> None:
    """What another node's flush leaves: a new durable version of the same file."""
    manifest = read_manifest(backing / rel)
    assert manifest is not None
    ChunkStore(backing).put(chunk_hash(data), data)
    write_store_manifest(
        backing / rel,
        Manifest(
            manifest.file_id, new_id(), len(data), 0o644, time.time_ns(), "durable", ["other"],
            [Chunk(0, len(data), chunk_hash(data))],
        ),
    )  # fmt: skip


def test_open_sees_another_nodes_rewrite_once_its_recheck_window_passed(mounts):
    """An open re-reads the manifest (close-to-open), except right after a
    lookup or stat that just did (fuse.open_recheck, 0.05 s by default)."""
    strict, default = mounts("strict"), mounts("default")
    strict.mount(env={"CKPTFS_FUSE_OPEN_RECHECK": "0"})
    default.mount()
    v1, v2, v3 = rand(MiB, 30), rand(MiB, 31), rand(MiB, 32)
    (strict.mnt / "x.bin").write_bytes(v1)
    strict.wait_durable()
    for m in (strict, default):
        assert (m.mnt / "x.bin").read_bytes() == v1
        os.stat(m.mnt / "x.bin")  # the kernel now caches the name and size
    _rewrite_elsewhere(strict.backing, "x.bin", v2)
    # Same size: the kernel's cached attributes do not give it away.
    assert (strict.mnt / "x.bin").read_bytes() == v2  # at once, with no window
    time.sleep(0.1)
    assert (default.mnt / "x.bin").read_bytes() == v2  # once the window has passed
    _rewrite_elsewhere(strict.backing, "x.bin", v3)
    time.sleep(0.1)
    with open(default.mnt / "x.bin", "rb") as f:
        assert f.read() == v3


def test_a_pending_version_rewritten_elsewhere_is_dropped_not_published(mounts):
    """Another node rewrites a file while this node still flushes its older
    version: the flush must not put the old version back, and must not stay
    owed (the unmount would wait for ever)."""
    m = mounts()
    m.mount(env={"CKPTFS_FLUSH_BANDWIDTH": "2MiB"})  # 3 chunks: about 4 s of flushing
    old, new = rand(12 * MiB, 40), rand(MiB, 41)
    (m.mnt / "x.bin").write_bytes(old)
    assert m.file_state("x.bin") in ("dirty", "flushing")
    _rewrite_elsewhere(m.backing, "x.bin", new)
    wait_for(lambda: "rewritten elsewhere" in m.log(), 60, "the flush to give up")
    assert read_manifest(m.backing / "x.bin").chunks == [Chunk(0, MiB, chunk_hash(new))]
    m.umount()  # nothing owed
    m.mount()
    assert (m.mnt / "x.bin").read_bytes() == new


def test_an_older_version_that_landed_over_a_newer_one_is_published_again(mounts):
    """Another node's durable V, checked just before this node published V'
    (whose close returned), lands over V': a check and a rename are one
    store call each but not atomic across nodes. This node's flush then
    finds the older V at the name: it must publish V' again (the newer
    content, by the versions' order), not drop it as rewritten elsewhere."""
    m = mounts()
    m.mount(env={"CKPTFS_FLUSH_BANDWIDTH": "2MiB"})  # 3 chunks: about 4 s of flushing
    older, newer = rand(MiB, 50), rand(12 * MiB, 51)
    (m.mnt / "x.bin").write_bytes(newer)
    assert m.file_state("x.bin") in ("dirty", "flushing")
    mine = read_manifest(m.backing / "x.bin")
    assert mine is not None and mine.seq > 0
    ChunkStore(m.backing).put(chunk_hash(older), older)
    write_store_manifest(
        m.backing / "x.bin",
        Manifest(
            mine.file_id, new_id(), len(older), 0o644, time.time_ns(), "durable", ["other"],
            [Chunk(0, len(older), chunk_hash(older))], seq=mine.seq - 1,
        ),
    )  # fmt: skip
    m.wait_durable()
    now = read_manifest(m.backing / "x.bin")
    assert now is not None and (now.version, now.state) == (mine.version, "durable")
    m.umount()
    m.mount()
    assert (m.mnt / "x.bin").read_bytes() == newer


@pytest.fixture
def failing_store(tmp_path: Path) -> Iterator[CountingMount]:
    """The backing directory of ``mounts`` (``tmp_path/backing``) through a
    stand-in store whose faults a test injects. Set up before ``mounts``,
    so it is unmounted after every daemon."""
    with counting_mount(tmp_path / "backing-real", tmp_path / "backing", faults=True) as store:
        yield store


def crash_with_a_pending_file(m: Mount, seed: int) -> bytes:
    """A file written and closed, still pending (a slow flush), then the
    daemon killed: its only copy is in the cache, listed by the journal."""
    m.mount(env={"CKPTFS_FLUSH_BANDWIDTH": "256KiB"})
    data = rand(8 * MiB, seed)
    (m.mnt / "x.bin").write_bytes(data)
    m.kill()
    assert read_manifest(m.backing / "x.bin").state == "pending"
    return data


def same(path: Path, data: bytes) -> bool:
    return hashlib.sha256(path.read_bytes()).digest() == hashlib.sha256(data).digest()


def test_a_crashed_daemons_file_is_kept_while_the_store_hangs_and_flushed_once_it_answers(
    failing_store, mounts
):
    """The store hangs on reads when a crashed daemon's successor mounts:
    its recovery gives up on the manifest after the backing timeout, off
    the loop, and the mount comes up; the file is kept (neither adopted nor
    thrown away), and once the store answers a flush --wait makes it
    durable, whole."""
    m = mounts()
    data = crash_with_a_pending_file(m, 7)
    m.allowed_log = ["did not answer within", "health", "unconfirmed", "backing store is down"]
    failing_store.inject("stall-files")
    start = time.monotonic()
    m.mount(env={"CKPTFS_BACKING_TIMEOUT": "2"})
    assert time.monotonic() - start < 30
    s = m.stat()
    assert s["cache"]["unconfirmed"] == 1 and s["cache"]["used"] >= 8 * MiB
    assert "1 file kept from before a crash" in m.cli("stat", str(m.mnt)).stdout
    failing_store.inject("ok")
    # flush --wait has the store asked again at once, then waits for the flush.
    m.wait_durable()
    assert m.stat()["cache"]["unconfirmed"] == 0
    assert read_manifest(m.backing / "x.bin").state == "durable"
    assert "recovered x.bin (8388608 bytes) once the store answered" in m.log()
    m.umount()
    m.mount()
    assert same(m.mnt / "x.bin", data)


def test_a_crashed_daemons_file_the_store_failed_to_read_is_adopted_at_its_open(
    failing_store, mounts
):
    """EIO on the manifest at mount keeps the file; the first open that
    reads the manifest, once the store answers, adopts it there and then:
    the reader gets the bytes from the cache, not a "lost" error."""
    m = mounts()
    data = crash_with_a_pending_file(m, 9)
    m.allowed_log = ["unconfirmed", "health", "Input/output error"]
    failing_store.inject("eio-files")
    m.mount()
    assert m.stat()["cache"]["unconfirmed"] == 1
    failing_store.inject("ok")
    assert same(m.mnt / "x.bin", data)
    assert m.stat()["cache"]["unconfirmed"] == 0
    assert "recovered x.bin (8388608 bytes) from the cache at its open" in m.log()
    m.wait_durable()
    m.umount()
    m.mount()
    assert same(m.mnt / "x.bin", data)


def test_a_kept_file_renamed_once_the_store_answers_is_flushed_at_its_new_name(
    failing_store, mounts
):
    """The job renames a kept file (a torch.save's temporary name put in
    place) after the store answers and before the daemon looks again: no
    record of another node's rename leads there, so the kept record must
    follow the rename, or its next look finds nothing and lets it go."""
    m = mounts()
    data = crash_with_a_pending_file(m, 13)
    m.allowed_log = ["unconfirmed", "health", "Input/output error"]
    failing_store.inject("eio-files")
    m.mount()
    # Two looks failed: the next is 8 s away.
    wait_for(lambda: m.log().count("x.bin still unconfirmed") >= 2, 30, "two failed looks")
    failing_store.inject("ok")
    os.rename(m.mnt / "x.bin", m.mnt / "y.bin")
    assert m.stat()["cache"]["unconfirmed"] == 1  # not adopted by the rename
    m.wait_durable()
    assert read_manifest(m.backing / "y.bin").state == "durable"
    assert not (m.backing / "x.bin").exists()
    m.umount()
    m.mount()
    assert same(m.mnt / "y.bin", data)


def test_a_kept_file_replaced_while_the_store_failed_is_let_go(failing_store, mounts):
    """While the store failed, another node removed the file: once the store
    answers, the kept version is found gone and its RAM goes back."""
    m = mounts()
    crash_with_a_pending_file(m, 11)
    m.allowed_log = ["unconfirmed", "health", "Input/output error"]
    failing_store.inject("eio-files")
    m.mount()
    assert m.stat()["cache"]["unconfirmed"] == 1
    (failing_store.real / "x.bin").unlink()
    failing_store.inject("ok")
    wait_for(lambda: m.stat()["cache"]["unconfirmed"] == 0, 90, "the record found stale")
    wait_for(lambda: m.stat()["cache"]["used"] < 8 * MiB, 10, "its slots released")
    assert not (m.mnt / "x.bin").exists()
    m.umount()


def _writes(path: Path, data: bytes) -> bool:
    try:
        path.write_bytes(data)
    except OSError:
        return False
    return True


def test_ls_and_stat_answer_while_32_writers_wait_for_space(mounts):
    m = mounts()
    m.mount(cache_size="32MiB")
    chunks = m.backing / ".ckptfs" / "chunks"
    # Nothing can be flushed or spilled: the writers wait for space until this is undone.
    subprocess.run(["chattr", "+i", str(chunks)], check=True)
    m.allowed_log = ["failed", "backpressure", "waited"]
    blobs = [rand(3 * MiB, 100 + i) for i in range(32)]
    errors: list[BaseException] = []

    def writer(i: int) -> None:
        try:
            (m.mnt / f"w{i:02d}.bin").write_bytes(blobs[i])
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(i,), daemon=True) for i in range(32)]
    try:
        for t in threads:
            t.start()
        wait_for(lambda: m.stat()["cache"]["waiting_writers"] >= 20, 60, "writers waiting")
        for _ in range(5):
            for argv in (["ls", "-ln", str(m.mnt)], ["stat", str(m.mnt / "w00.bin")]):
                # In a child: a request the daemon never answers blocks its caller for good.
                start = time.monotonic()
                probe = subprocess.Popen(argv, stdout=subprocess.DEVNULL)
                try:
                    probe.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    raise AssertionError(f"{argv[0]} did not answer within 5s") from None
                elapsed = time.monotonic() - start
                assert probe.returncode == 0 and elapsed < 1.0, f"{argv[0]}: {elapsed:.2f}s"
            time.sleep(0.2)
    finally:
        subprocess.run(["chattr", "-i", str(chunks)], check=True)
    for t in threads:
        t.join(240)
    assert not errors, errors
    for i in range(32):
        assert hashlib.sha256((m.mnt / f"w{i:02d}.bin").read_bytes()).digest() == (
            hashlib.sha256(blobs[i]).digest()
        )


def test_check_reports_pending_files_and_fails_for_those_no_daemon_holds(mounts):
    m = mounts()
    m.mount(env={"CKPTFS_FLUSH_BANDWIDTH": "512KiB"})
    (m.mnt / "held.bin").write_bytes(rand(8 * MiB, 8))
    out = m.cli("check", str(m.backing)).stdout
    assert "held.bin: pending" in out and "held by the running daemon" in out, out
    with open(m.mnt / "writing.bin", "wb") as f:  # being written: its create's manifest
        f.write(rand(MiB, 9))
        f.flush()
        out = m.cli("check", str(m.backing)).stdout
        assert "writing.bin: pending" in out and "held by the running daemon" in out, out
    # Naming this node, which never had its bytes (its writer's daemon died).
    write_store_manifest(
        m.backing / "ghost.pt",
        Manifest("g" * 16, "w" * 16, 1000, 0o644, 0, "pending", [m.stat()["node"]]),
    )
    proc = m.cli("check", str(m.backing), check=False)
    assert proc.returncode == 1, proc.stdout
    assert "ghost.pt: pending" in proc.stdout and "does not hold its bytes" in proc.stdout
    # Naming this node and one that does not serve the backing directory
    # here (the writer on another machine, its buddy here without the
    # bytes): the holder not asked may have them, so a warning, not "lost".
    write_store_manifest(
        m.backing / "ghost.pt",
        Manifest("g" * 16, "w" * 16, 1000, 0o644, 0, "pending", ["n-far", m.stat()["node"]]),
    )
    proc = m.cli("check", str(m.backing), check=False)
    assert proc.returncode == 0, proc.stdout
    assert "ckptfs: warning: " in proc.stdout and "n-far do not serve" in proc.stdout
    assert "ghost.pt" in proc.stdout and "lost" not in proc.stdout, proc.stdout
    (m.backing / "ghost.pt").unlink()
    write_store_manifest(
        m.backing / "orphan.pt",
        Manifest("f" * 16, "v" * 16, 1000, 0o644, 0, "pending", ["gone-node"]),
    )
    proc = m.cli("check", str(m.backing), check=False)
    assert proc.returncode == 1, proc.stdout
    assert "orphan.pt: pending" in proc.stdout and "holders gone-node" in proc.stdout
    assert "no running daemon" in proc.stdout
    (m.backing / "orphan.pt").unlink()
    # Empty (a writer killed between its create and its close; it reads
    # empty everywhere): nothing to lose, whether its holder runs or not.
    for holders in ([m.stat()["node"]], ["gone-node"]):
        write_store_manifest(
            m.backing / "empty.pt",
            Manifest("e" * 16, "v" * 16, 0, 0o644, 0, "pending", holders),
        )
        proc = m.cli("check", str(m.backing), check=False)
        assert proc.returncode == 0, proc.stdout
        assert "empty.pt: pending, 0 bytes" in proc.stdout, proc.stdout
        assert "empty, nothing to lose" in proc.stdout, proc.stdout
    assert (m.mnt / "empty.pt").read_bytes() == b""
    (m.backing / "empty.pt").unlink()
    m.kill()  # held.bin's only holder is gone
    proc = m.cli("check", str(m.backing), check=False)
    assert proc.returncode == 1 and "held.bin" in proc.stdout, proc.stdout


def test_check_does_not_call_a_file_saved_again_during_the_check_lost(mounts, monkeypatch, capsys):
    """The check reads the manifests first and asks the daemon afterwards:
    a save of a new version in between makes the daemon answer "not held"
    for the version read. That is a file that changed, not a lost one."""
    m = mounts()
    # Several chunks: the first goes out at once, whatever the cap (one
    # chunk of 3 MiB was often durable before the check read its manifest).
    m.mount(env={"CKPTFS_FLUSH_BANDWIDTH": "512KiB", "CKPTFS_CHUNK_SIZE": "256KiB"})
    (m.mnt / "last.pt").write_bytes(rand(3 * MiB, 11))
    monkeypatch.setenv("CKPTFS_RUN_DIR", str(m.run_dir))
    from ckptfs.tools.offline import cli as offline_cli

    real = offline_cli.request

    def saved_again_first(mountpoint, req):
        if req.get("op") == "holds":
            (m.mnt / "last.pt").write_bytes(rand(3 * MiB, 12))
        return real(mountpoint, req)

    monkeypatch.setattr(offline_cli, "request", saved_again_first)
    rc = offline_cli.cmd_check(SimpleNamespace(path=str(m.backing), quick=True))
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "last.pt: pending" in out and "changed during the check (another version now)" in out
    assert "lost" not in out and "error" not in out, out
    # Checked again: the new version is held.
    monkeypatch.setattr(offline_cli, "request", real)
    assert offline_cli.cmd_check(SimpleNamespace(path=str(m.backing), quick=True)) == 0
    assert "held by the running daemon" in capsys.readouterr().out
    m.kill()  # an unmount would wait out the capped flush (6 s) for nothing checked here


def test_a_pending_version_survives_a_crash_during_its_rewrite(mounts):
    """torch.save to the same name again while the previous save is not durable
    yet, and the daemon dies mid-rewrite: the previous version is still there."""
    m = mounts()
    m.mount(env={"CKPTFS_FLUSH_BANDWIDTH": "1MiB"})
    v1 = rand(6 * MiB, 9)
    (m.mnt / "last.pt").write_bytes(v1)  # closed, not durable yet
    f = open(m.mnt / "last.pt", "wb")  # the next save truncates it
    f.write(rand(2 * MiB, 10))
    f.flush()
    m.kill()
    try:
        f.close()
    except OSError:
        pass
    m.mount()
    m.allowed_log = ["recovered"]
    assert (m.mnt / "last.pt").read_bytes() == v1
    m.wait_durable()
    assert read_manifest(m.backing / "last.pt").state == "durable"


def anon_rss(pid: int) -> int:
    """Private memory of a process: what it holds outside the (shared) arena."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon")


def test_chunks_read_back_are_held_in_the_cache_budget_not_the_heap(mounts):
    m = mounts()
    m.mount(cache_size="512MiB", env={"CKPTFS_CHUNK_SIZE": "64MiB"})
    digests = []
    for i in range(6):
        data = rand(64 * MiB, 20 + i)
        digests.append(hashlib.sha256(data).digest())
        (m.mnt / f"big{i}.bin").write_bytes(data)
        del data
    m.wait_durable()
    m.cli("evict", str(m.mnt))
    for i in range(6):  # cold: every 64 MiB chunk is read from the backing store
        assert hashlib.sha256((m.mnt / f"big{i}.bin").read_bytes()).digest() == digests[i]
    assert m.pid is not None
    assert anon_rss(m.pid) < 160 * MiB, anon_rss(m.pid) >> 20


@pytest.mark.parametrize("grows", [True, False], ids=["larger", "smaller"])
def test_a_read_right_after_a_rewrite_elsewhere_is_of_one_whole_version(mounts, grows):
    """Node b stats a file (the kernel keeps its attributes for a second),
    node a rewrites it in place with another size, and b opens and reads it
    within that second: the open loads the new version, and the read must
    return it whole, not cut or padded to the old size (bytes no version had)."""
    a, b = mounts("a"), mounts("b")
    for m in (a, b):
        m.mount(env={"CKPTFS_DURABILITY": "backing"})  # a's close: durable, so b reads it
    small, large = rand(300_000, 60), rand(900_000, 61)
    old, new = (small, large) if grows else (large, small)
    for attempt in range(5):
        (a.mnt / "f.bin").write_bytes(old)
        time.sleep(0.1)  # past fuse.open_recheck of b's last look
        assert (b.mnt / "f.bin").read_bytes() == old
        os.stat(b.mnt / "f.bin")  # b's kernel caches the old size from here
        cached = time.monotonic()
        with open(a.mnt / "f.bin", "r+b") as f:  # the same file, a new version
            f.truncate(0)
            f.write(new)
        time.sleep(0.1)  # past fuse.open_recheck: b's open looks at the manifest
        got = (b.mnt / "f.bin").read_bytes()
        if time.monotonic() - cached < 0.8:  # within the kernel's attribute timeout
            assert got == new, f"attempt {attempt}: {len(got)} bytes read, {len(new)} written"
            assert os.stat(b.mnt / "f.bin").st_size == len(new)


def test_a_takeover_that_cannot_read_back_the_manifest_it_moved_aside_puts_it_back(
    failing_store,
):
    """The fenced publish of a takeover moves the name's manifest aside to
    check it: an EIO reading it back must leave it at its name (it was
    deleted with the aside name, and with it a closed file whose writer and
    buddy then both dropped their copies: fault trials, restart_store_eio)."""
    root = failing_store.mountpoint
    (root / "d").mkdir()
    write_store_manifest(root / "d" / "a.pt", pending("f1", "v1", ["n1", "n2"]), backing=root)

    async def main() -> None:
        b = Backing(root, BackingIO(5))
        try:
            failing_store.inject("eio-files")
            with pytest.raises(OSError):
                await b.takeover_manifest("d/a.pt", durable("f1", "v1"), file_id="f1",
                                          expect_version="v1")  # fmt: skip
            failing_store.inject("ok")
            m = read_manifest(root / "d" / "a.pt")
            assert (m.file_id, m.version, m.state) == ("f1", "v1", "pending")
            assert os.listdir(root / "d") == ["a.pt"]  # nothing left aside
            r = await b.takeover_manifest("d/a.pt", durable("f1", "v1"), file_id="f1",
                                          expect_version="v1")  # fmt: skip
            assert r is Published.DONE
            assert read_manifest(root / "d" / "a.pt").state == "durable"
        finally:
            b.close()

    trio.run(main)
