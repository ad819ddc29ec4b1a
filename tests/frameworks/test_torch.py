"""torch.save / torch.load through the mount, from RAM and from the backing store."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import torch
from ckptfs.fs.store.chunkstore import ChunkStore
from ckptfs.fs.store.manifest import read_manifest
from tensors import assert_same, state_dict_of


@pytest.mark.parametrize("size", [1 << 20, 64 << 20])
def test_roundtrip_small(mounted, size):
    sd = state_dict_of(size)
    path = mounted.mnt / "ckpt" / "model.pt"
    path.parent.mkdir()
    torch.save(sd, path)
    assert_same(sd, torch.load(path))
    assert_same(sd, torch.load(path, mmap=True))


def test_roundtrip_1gib_warm_and_from_backing(mounts):
    m = mounts()
    m.mount(cache_size="2GiB")
    sd = state_dict_of(1 << 30, seed=1)
    assert sum(t.numel() * t.element_size() for t in sd.values()) > 0.9 * (1 << 30)
    path = m.mnt / "checkpoint-1" / "model.pt"
    path.parent.mkdir()
    torch.save(sd, path)
    assert_same(sd, torch.load(path, mmap=True))
    m.umount()  # flushes everything
    manifest = read_manifest(m.backing / "checkpoint-1" / "model.pt")
    assert manifest is not None and manifest.state == "durable"
    store = ChunkStore(m.backing)
    assert all(store.path_for(c.hash).exists() for c in manifest.chunks)
    # A new daemon with an empty cache reads everything from the backing store.
    m.mount(cache_size="256MiB")
    assert m.stat()["cache"]["dirty"] == 0
    assert_same(sd, torch.load(path))
    assert_same(sd, torch.load(path, mmap=True))


def test_remount_with_empty_cache_reads_everything_back(mounts):
    m = mounts()
    m.mount()
    saved = {}
    for step in (10, 20, 30):
        d = m.mnt / f"checkpoint-{step}"
        d.mkdir()
        saved[step] = state_dict_of(8 << 20, seed=step)
        torch.save(saved[step], d / "model.pt")
        (d / "trainer_state.json").write_text(f'{{"step": {step}}}')
    m.umount()
    m.mount()
    for step, sd in saved.items():
        d = m.mnt / f"checkpoint-{step}"
        assert_same(sd, torch.load(d / "model.pt", mmap=True))
        assert (d / "trainer_state.json").read_text() == f'{{"step": {step}}}'


def test_umount_flushes_everything(mounts):
    m = mounts()
    # A slow backing store: the flush is still running when umount is asked.
    m.mount(env={"CKPTFS_FLUSH_BANDWIDTH": "20MiB"})
    blob = os.urandom(40 << 20)
    (m.mnt / "a.bin").write_bytes(blob)
    assert m.file_state("a.bin") in ("dirty", "flushing")
    m.umount()
    manifest = read_manifest(m.backing / "a.bin")
    assert manifest is not None and manifest.state == "durable" and manifest.size == len(blob)
    store = ChunkStore(m.backing)
    data = b"".join(store.get(c.hash, c.length) for c in manifest.chunks)
    assert data == blob


def test_corrupted_chunk_gives_eio_and_names_file_and_chunk(mounts):
    m = mounts()
    m.mount()
    blob = os.urandom(12 << 20)
    (m.mnt / "w.bin").write_bytes(blob)
    m.umount()
    manifest = read_manifest(m.backing / "w.bin")
    assert manifest is not None
    victim = manifest.chunks[1]
    chunk_path = ChunkStore(m.backing).path_for(victim.hash)
    os.chmod(chunk_path, 0o644)
    with open(chunk_path, "r+b") as f:
        f.seek(100)
        f.write(b"\xff" * 8)
    m.mount()
    m.allowed_log = ["does not match its hash"]
    with open(m.mnt / "w.bin", "rb") as f:
        assert f.read(victim.offset) == blob[: victim.offset]  # intact chunk is fine
        with pytest.raises(OSError) as exc:
            f.read(victim.length)
    assert exc.value.errno == errno.EIO
    log = m.log()
    assert "w.bin" in log and victim.hash in log and "does not match its hash" in log


def test_durability_backing_close_returns_durable(mounts):
    m = mounts()
    m.mount("--durability", "backing")
    sd = state_dict_of(4 << 20)
    torch.save(sd, m.mnt / "m.pt")
    manifest = read_manifest(m.backing / "m.pt")
    assert manifest is not None and manifest.state == "durable"


def test_durability_local_close_returns_before_durable(mounts):
    m = mounts()
    m.mount(env={"CKPTFS_FLUSH_BANDWIDTH": "10MiB"})
    (m.mnt / "slow.bin").write_bytes(os.urandom(30 << 20))
    manifest = read_manifest(m.backing / "slow.bin")
    assert manifest is not None and manifest.state == "pending" and manifest.holders
    assert m.file_state("slow.bin") in ("dirty", "flushing")
    m.wait_durable()
    assert read_manifest(m.backing / "slow.bin").state == "durable"


def test_write_larger_than_cache_completes_with_backpressure(mounts):
    m = mounts()
    m.mount(cache_size="32MiB")
    blob = os.urandom(150 << 20)
    path = m.mnt / "huge.bin"
    with open(path, "wb") as f:
        for off in range(0, len(blob), 1 << 20):
            f.write(blob[off : off + (1 << 20)])
    s = m.stat()
    assert s["cache"]["backpressure_events"] > 0
    assert s["cache"]["capacity"] == 32 << 20
    assert path.read_bytes() == blob
    m.wait_durable()
    m.umount()
    m.mount(cache_size="32MiB")
    assert Path(path).read_bytes() == blob
    m.allowed_log = ["backpressure"]


def test_daemon_crash_keeps_closed_files_in_tmpfs(mounts):
    m = mounts()
    # Flushing is throttled so the file is still dirty when the daemon dies.
    m.mount(env={"CKPTFS_FLUSH_BANDWIDTH": "1MiB"})
    blob = os.urandom(24 << 20)
    (m.mnt / "survivor.bin").write_bytes(blob)
    assert read_manifest(m.backing / "survivor.bin").state == "pending"
    m.kill()
    m.mount()
    m.wait_durable()
    assert read_manifest(m.backing / "survivor.bin").state == "durable"
    assert (m.mnt / "survivor.bin").read_bytes() == blob
    m.allowed_log = ["recovered"]
