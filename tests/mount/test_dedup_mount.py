"""Deduplication, retention, export, gc and check end to end, through a real mount."""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch
from ckptfs.fs.store.chunkstore import ChunkStore
from ckptfs.fs.store.manifest import read_manifest
from data import safetensors_bytes
from waits import wait_for


def store_bytes(backing: Path) -> int:
    root = ChunkStore(backing).root
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def frozen_model(seed: int) -> dict[str, torch.Tensor]:
    """~36 MiB: nine frozen 4 MiB matrices and one trainable one."""
    g = torch.Generator().manual_seed(0)
    sd = {f"frozen.{i}.weight": torch.randn(1024, 1024, generator=g) for i in range(9)}
    sd["head.weight"] = torch.randn(1024, 1024, generator=torch.Generator().manual_seed(seed))
    return sd


def test_frozen_model_second_checkpoint_adds_little(mounted):
    m = mounted
    (m.mnt / "checkpoint-1").mkdir()
    torch.save(frozen_model(1), m.mnt / "checkpoint-1" / "model.pt")
    m.wait_durable()
    before = store_bytes(m.backing)
    second = frozen_model(2)
    second["step"] = torch.tensor(2)  # an added key: the pickled header changes length
    (m.mnt / "checkpoint-2").mkdir()
    torch.save(second, m.mnt / "checkpoint-2" / "model.pt")
    m.wait_durable()
    size = (m.mnt / "checkpoint-2" / "model.pt").stat().st_size
    added = store_bytes(m.backing) - before
    print(f"second checkpoint: {size} bytes, added to the store: {added} ({added / size:.1%})")
    assert added <= 0.15 * size
    assert read_manifest(m.backing / "checkpoint-2" / "model.pt").chunking == "torch-zip"
    loaded = torch.load(m.mnt / "checkpoint-2" / "model.pt")
    assert all(torch.equal(loaded[k], second[k]) for k in second)


def test_same_state_dict_under_two_names_is_stored_once(mounted):
    m = mounted
    sd = frozen_model(3)
    torch.save(sd, m.mnt / "model.pt")
    m.wait_durable()
    before = store_bytes(m.backing)
    torch.save(sd, m.mnt / "model_copy.pt")  # its zip entries get another name prefix
    m.wait_durable()
    added = store_bytes(m.backing) - before
    size = (m.mnt / "model_copy.pt").stat().st_size
    print(f"copy under a second name: {size} bytes, added {added}")
    assert added <= 0.01 * size


def test_safetensors_with_one_changed_tensor_uploads_about_that_tensor(mounted):
    m = mounted
    tensors = {f"t{i}": os.urandom(3 << 20) for i in range(8)}
    (m.mnt / "a.safetensors").write_bytes(safetensors_bytes(tensors))
    m.wait_durable()
    before = store_bytes(m.backing)
    tensors["t5"] = os.urandom(3 << 20)
    (m.mnt / "b.safetensors").write_bytes(safetensors_bytes(tensors))
    m.wait_durable()
    added = store_bytes(m.backing) - before
    print(f"one changed 3 MiB tensor: added {added}")
    assert (3 << 20) <= added <= (3 << 20) + (256 << 10)
    assert read_manifest(m.backing / "b.safetensors").chunking == "safetensors"


def test_retention_keeps_last_n_and_audits_each_deletion(mounts, tmp_path):
    m = mounts()
    audit = tmp_path / "audit.log"
    config = tmp_path / "c.yaml"
    config.write_text(f"retention: {{keep_last: 2, pattern: 'checkpoint-*', audit_log: {audit}}}\n")
    m.mount("--config", str(config))
    (m.mnt / "run").mkdir()
    (m.mnt / "run" / "notes.txt").write_text("not a checkpoint directory")
    for step in (100, 200, 300, 400):
        d = m.mnt / "run" / f"checkpoint-{step}"
        d.mkdir()
        torch.save({"w": torch.full((1000,), float(step))}, d / "model.pt")
        (d / "trainer_state.json").write_text(f'{{"step": {step}}}')
        m.wait_durable()
    wait_for(lambda: len(os.listdir(m.backing / "run")) <= 3, 30, "retention's deletions")
    assert sorted(os.listdir(m.backing / "run")) == [
        "checkpoint-300",
        "checkpoint-400",
        "notes.txt",
    ]
    assert sorted(os.listdir(m.mnt / "run")) == ["checkpoint-300", "checkpoint-400", "notes.txt"]
    lines = [ln for ln in audit.read_text().splitlines() if "\tdeleted\t" in ln]
    assert len(lines) == 2
    assert any("checkpoint-100" in ln for ln in lines) and any(
        "checkpoint-200" in ln for ln in lines
    )
    assert "retention deleted" in m.log()


def test_export_gc_check_cli(mounts, tmp_path):
    m = mounts()
    m.mount()
    sd = frozen_model(4)
    (m.mnt / "ck").mkdir()
    torch.save(sd, m.mnt / "ck" / "model.pt")
    (m.mnt / "ck" / "config.json").write_text('{"layers": 10}')
    m.wait_durable()
    # export through a mount path, byte-identical
    out = tmp_path / "exported"
    m.cli("export", str(m.mnt / "ck"), str(out))
    assert (out / "model.pt").read_bytes() == (m.mnt / "ck" / "model.pt").read_bytes()
    loaded = torch.load(out / "model.pt")
    assert all(torch.equal(loaded[k], sd[k]) for k in sd)
    assert (out / "config.json").read_text() == '{"layers": 10}'
    assert "all well" in m.cli("check", str(m.mnt)).stdout

    # an orphan chunk past the grace period is collected; referenced ones never
    store = ChunkStore(m.backing)
    orphan = b"nobody references me" * 1000
    from ckptfs.fs.store.chunkstore import chunk_hash

    store.put(chunk_hash(orphan), orphan)
    old = time.time() - 7200
    os.utime(store.path_for(chunk_hash(orphan)), (old, old))
    report = m.cli("gc", str(m.backing)).stdout  # a report unless --delete
    assert "would remove 1 chunk" in report and store.exists(chunk_hash(orphan))
    assert "run with --delete" in report
    assert "removed 1 chunk" in m.cli("gc", str(m.mnt), "--delete").stdout
    assert not store.exists(chunk_hash(orphan))
    manifest = read_manifest(m.backing / "ck" / "model.pt")
    assert all(store.exists(c.hash) for c in manifest.chunks)
    assert (m.mnt / "ck" / "model.pt").read_bytes() == (out / "model.pt").read_bytes()

    # damage: check names the file and fails; export refuses
    victim = store.path_for(manifest.chunks[-1].hash)
    os.chmod(victim, 0o644)
    with open(victim, "r+b") as f:
        f.write(b"\0\1\2\3")
    proc = m.cli("check", str(m.mnt), check=False)
    assert proc.returncode == 1 and "ck/model.pt" in proc.stdout and "1 damaged" in proc.stdout
    proc = m.cli(
        "export", str(m.backing / "ck" / "model.pt"), str(tmp_path / "bad.pt"), check=False
    )
    assert proc.returncode == 1 and not (tmp_path / "bad.pt").exists()
    os.unlink(store.path_for(manifest.chunks[0].hash))
    proc = m.cli("check", str(m.backing), check=False)
    assert proc.returncode == 1 and "missing" in proc.stdout
