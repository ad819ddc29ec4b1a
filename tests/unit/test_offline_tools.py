"""Offline tools on a backing directory: export, gc, check and retention."""

from __future__ import annotations

import io
import os
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from ckptfs.fs.store.chunking import plan_chunks
from ckptfs.fs.store.chunkstore import CKPTFS_DIR, ChunkStore, chunk_hash
from ckptfs.fs.store.manifest import MAGIC, Chunk, Manifest, new_id, read_manifest, tmp_name_for
from ckptfs.fs.store.retention import apply_retention
from ckptfs.tools.offline import gc as gc_module
from ckptfs.tools.offline.check import check
from ckptfs.tools.offline.export import export
from ckptfs.tools.offline.gc import collect_garbage
from manifests import write_store_manifest

torch = pytest.importorskip("torch")

KiB = 1 << 10
CHUNK = 64 * KiB
HOUR = 3600.0


def torch_bytes(seed: int, numel: int = 40_000) -> bytes:
    gen = torch.Generator().manual_seed(seed)
    buf = io.BytesIO()
    torch.save({"w": torch.randn(numel, generator=gen), "b": torch.randn(8, generator=gen)}, buf)
    return buf.getvalue()


def store_file(backing: Path, rel: str, data: bytes, *, state: str = "durable") -> Manifest:
    """Write ``data`` the way the flusher does: chunks first, then the manifest."""
    store = ChunkStore(backing)
    kind, ranges = plan_chunks(lambda off, n: data[off : off + n], len(data), CHUNK)
    chunks = []
    if state == "durable":
        for off, n in ranges:
            piece = data[off : off + n]
            digest = chunk_hash(piece)
            store.put(digest, piece)
            chunks.append(Chunk(off, n, digest))
    manifest = Manifest(
        file_id=new_id(),
        version=new_id(),
        size=len(data),
        mode=0o100640,
        mtime_ns=1_700_000_000_123_456_789,
        state=state,
        holders=["n1"],
        chunks=chunks,
        chunking=kind,
    )
    path = backing / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    write_store_manifest(path, manifest, backing, sync=False)
    return manifest


def chunk_files(backing: Path) -> set[Path]:
    return {p for p in (backing / CKPTFS_DIR / "chunks").rglob("*") if p.is_file()}


def age(paths: object, seconds: float) -> None:
    when = time.time() - seconds
    for p in paths:  # type: ignore[attr-defined]
        os.utime(p, (when, when), follow_symlinks=False)


def corrupt(path: Path) -> None:
    os.chmod(path, 0o644)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.fixture
def backing(tmp_path: Path) -> Path:
    root = tmp_path / "backing"
    (root / CKPTFS_DIR / "chunks").mkdir(parents=True)
    return root


# --- gc -----------------------------------------------------------------------


def test_gc_removes_old_orphans_and_never_referenced_chunks(backing: Path) -> None:
    keep = torch_bytes(1)
    store_file(backing, "ckpt/keep.pt", keep)
    referenced = chunk_files(backing)
    store_file(backing, "ckpt/drop.pt", torch_bytes(2))
    (backing / "ckpt/drop.pt").unlink()  # its chunks are now garbage
    orphans = chunk_files(backing) - referenced
    assert orphans
    age(chunk_files(backing), 2 * HOUR)
    orphan_bytes = sum(p.stat().st_size for p in orphans)

    result = collect_garbage(backing, grace_seconds=HOUR)

    assert result.refused is None
    assert set(result.removed) == orphans and result.freed_bytes == orphan_bytes
    assert chunk_files(backing) == referenced
    assert check(backing).ok
    out = backing.parent / "out.pt"
    assert export(backing / "ckpt/keep.pt", out).ok
    assert out.read_bytes() == keep


def test_gc_keeps_young_orphans_and_dry_run_deletes_nothing(backing: Path) -> None:
    store_file(backing, "a.pt", torch_bytes(3))
    (backing / "a.pt").unlink()
    orphans = chunk_files(backing)

    young = collect_garbage(backing, grace_seconds=HOUR)
    assert young.removed == [] and young.kept_young == len(orphans)

    age(orphans, 2 * HOUR)
    dry = collect_garbage(backing, grace_seconds=HOUR, dry_run=True)
    assert set(dry.removed) == orphans and dry.freed_bytes > 0
    assert chunk_files(backing) == orphans


def test_gc_removes_stale_temp_files_only(backing: Path) -> None:
    store_file(backing, "a.pt", torch_bytes(4))
    some = next(iter(chunk_files(backing)))
    stale = some.with_name(f"{some.name}.tmp.dead")
    fresh = some.with_name(f"{some.name}.tmp.busy")
    foreign = some.with_name("README")
    for p in (stale, fresh, foreign):
        p.write_bytes(b"partial")
    age([stale, foreign, *chunk_files(backing)], 2 * HOUR)
    age([fresh], 0)

    result = collect_garbage(backing, grace_seconds=HOUR)

    assert result.removed == [stale]
    assert fresh.exists() and foreign.exists() and some.exists()


def test_gc_refuses_when_a_manifest_is_unreadable(backing: Path) -> None:
    store_file(backing, "a.pt", torch_bytes(5))
    (backing / "a.pt").unlink()
    (backing / "broken.pt").write_bytes(MAGIC + b"{not json")
    before = chunk_files(backing)
    age(before, 2 * HOUR)

    result = collect_garbage(backing, grace_seconds=HOUR)

    assert result.refused is not None and "broken.pt" in result.refused
    assert result.removed == [] and chunk_files(backing) == before


def test_gc_counts_chunks_named_by_temporary_manifests(backing: Path) -> None:
    manifest = store_file(backing, "a.pt", torch_bytes(6))
    # A manifest caught between write and rename still protects its chunks.
    os.rename(backing / "a.pt", tmp_name_for(backing / "a.pt"))
    age(chunk_files(backing), 2 * HOUR)
    result = collect_garbage(backing, grace_seconds=HOUR)
    assert result.removed == []
    assert result.referenced == len({c.hash for c in manifest.chunks})


def test_gc_pending_manifest_holds_back_chunks_of_a_running_flush(backing: Path) -> None:
    # The flush of a pending file stores chunks its manifest does not name yet.
    store_file(backing, "flushing.pt", torch_bytes(7), state="pending")
    age([backing / "flushing.pt"], 3 * HOUR)
    store_file(backing, "tmp.pt", torch_bytes(8))
    (backing / "tmp.pt").unlink()
    in_flight = chunk_files(backing)
    age(in_flight, 2 * HOUR)  # stored after the pending manifest was written

    result = collect_garbage(backing, grace_seconds=0.5 * HOUR)

    assert result.removed == [] and chunk_files(backing) == in_flight
    assert result.pending == [backing / "flushing.pt"]


def test_gc_puts_back_a_chunk_reused_while_being_removed(backing: Path) -> None:
    store_file(backing, "a.pt", b"x" * 1000)
    (chunk,) = chunk_files(backing)
    # Eligible at scan time, but a writer refreshed it before the removal.
    assert not gc_module._remove(chunk, cutoff=time.time() - HOUR)
    assert chunk.exists() and len(chunk_files(backing)) == 1


# --- export -------------------------------------------------------------------


def test_export_tree_round_trips(backing: Path, tmp_path: Path) -> None:
    model, optim = torch_bytes(10, numel=100_000), torch_bytes(11)
    store_file(backing, "ckpt/model.pt", model)
    store_file(backing, "ckpt/sub/optim.pt", optim)
    store_file(backing, "ckpt/empty.bin", b"")
    (backing / "ckpt/config.json").write_text('{"lr": 0.1}')
    os.symlink("model.pt", backing / "ckpt/latest.pt")
    tmp_name_for(backing / "ckpt/model.pt").write_bytes(MAGIC + b"half")
    (backing / "ckpt" / CKPTFS_DIR).mkdir()

    out = tmp_path / "out"
    result = export(backing / "ckpt", out)

    assert result.ok, result.problems
    assert (out / "model.pt").read_bytes() == model
    assert (out / "sub/optim.pt").read_bytes() == optim
    assert (out / "empty.bin").read_bytes() == b""
    assert (out / "config.json").read_text() == '{"lr": 0.1}'
    assert os.readlink(out / "latest.pt") == "model.pt"
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "empty.bin",
        "latest.pt",
        "model.pt",
        "sub",
    ]
    st = os.stat(out / "model.pt")
    assert st.st_mtime_ns == 1_700_000_000_123_456_789 and st.st_mode & 0o777 == 0o640
    assert result.bytes == len(model) + len(optim) + len('{"lr": 0.1}')
    loaded = torch.load(out / "model.pt", weights_only=True)
    assert loaded["w"].numel() == 100_000


def test_export_single_file_into_directory(backing: Path, tmp_path: Path) -> None:
    data = torch_bytes(12)
    store_file(backing, "model.pt", data)
    result = export(backing / "model.pt", tmp_path)
    assert result.ok and result.files == [tmp_path / "model.pt"]
    assert (tmp_path / "model.pt").read_bytes() == data


@pytest.mark.parametrize("damage", ["corrupt", "missing"])
def test_export_refuses_a_damaged_chunk(backing: Path, tmp_path: Path, damage: str) -> None:
    manifest = store_file(backing, "model.pt", torch_bytes(13))
    bad = manifest.chunks[len(manifest.chunks) // 2].hash
    path = ChunkStore(backing).path_for(bad)
    corrupt(path) if damage == "corrupt" else path.unlink()
    out = tmp_path / "out"
    out.mkdir()

    result = export(backing / "model.pt", out / "model.pt")

    assert not result.ok
    (problem,) = result.problems
    assert problem.path == backing / "model.pt" and problem.chunk == bad
    text = str(problem)
    assert "model.pt" in text and bad in text
    assert ("missing" if damage == "missing" else "does not match") in text
    assert list(out.iterdir()) == []  # no partial file, no temporary left behind


def test_export_refuses_pending_and_keeps_going(backing: Path, tmp_path: Path) -> None:
    store_file(backing, "ckpt/a.pt", torch_bytes(14), state="pending")
    store_file(backing, "ckpt/b.pt", torch_bytes(15))
    result = export(backing / "ckpt", tmp_path / "out")
    assert [p.path.name for p in result.problems] == ["a.pt"]
    assert "not durable" in result.problems[0].problem
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["b.pt"]


def test_export_refuses_nonsense_arguments(backing: Path, tmp_path: Path) -> None:
    store_file(backing, "ckpt/a.pt", b"abc")
    with pytest.raises(ValueError, match="inside the source"):
        export(backing / "ckpt", backing / "ckpt" / "copy")
    with pytest.raises(ValueError, match="chunk store"):
        export(backing / CKPTFS_DIR / "chunks", tmp_path / "out")
    with pytest.raises(FileNotFoundError):
        export(backing / "nope", tmp_path / "out")


# --- check --------------------------------------------------------------------


def test_check_names_files_with_missing_and_corrupted_chunks(backing: Path) -> None:
    shared = torch_bytes(20)
    a = store_file(backing, "run/a.pt", shared)
    store_file(backing, "run/b.pt", shared)  # same bytes: the same chunks
    c = store_file(backing, "run/c.pt", torch_bytes(21))
    store_file(backing, "run/pending.pt", torch_bytes(22), state="pending")
    (backing / "run/plain.json").write_text("{}")
    store = ChunkStore(backing)
    # Tensor data, not headers (the archives' first chunks are identical).
    a_only = [ch.hash for ch in a.chunks if ch.hash not in {x.hash for x in c.chunks}]
    c_only = [ch.hash for ch in c.chunks if ch.hash not in {x.hash for x in a.chunks}]
    missing, damaged = a_only[0], c_only[-1]
    store.path_for(missing).unlink()
    corrupt(store.path_for(damaged))

    result = check(backing)

    assert not result.ok
    assert result.manifests == 4 and result.plain == 1
    assert [p.path for p in result.pending] == [backing / "run/pending.pt"]
    found = {(p.path.name, p.chunk) for p in result.problems}
    assert found == {("a.pt", missing), ("b.pt", missing), ("c.pt", damaged)}
    assert result.damaged_files == [
        backing / "run/a.pt",
        backing / "run/b.pt",
        backing / "run/c.pt",
    ]
    assert result.chunks == len({ch.hash for ch in a.chunks + c.chunks})

    quick = check(backing, Path("run/c.pt"), verify_data=False)
    assert quick.ok and quick.manifests == 1  # same size: only reading the data finds it


def test_check_reports_unreadable_manifest(backing: Path) -> None:
    (backing / "bad.pt").write_bytes(MAGIC + b'{"size": 1}')
    result = check(backing)
    (problem,) = result.problems
    assert problem.path == backing / "bad.pt" and "manifest" in problem.problem


def test_check_path_must_be_inside_backing(backing: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not inside"):
        check(backing, tmp_path / "elsewhere")


# --- retention ----------------------------------------------------------------


def make_checkpoints(backing: Path, steps: list[int], prefix: str = "checkpoint-") -> list[Path]:
    dirs = []
    for step in steps:
        store_file(backing, f"run/{prefix}{step}/model.pt", f"step {step}".encode())
        store_file(backing, f"run/{prefix}{step}/sub/optim.pt", f"optim {step}".encode())
        dirs.append(backing / "run" / f"{prefix}{step}")
    return dirs


def audit_lines(path: Path) -> list[list[str]]:
    return [line.split("\t") for line in path.read_text().splitlines()]


def test_retention_keeps_the_newest_n_in_numeric_order(backing: Path, tmp_path: Path) -> None:
    dirs = make_checkpoints(backing, [100, 20, 5, 1000, 300])
    (backing / "run/other").mkdir()
    log = tmp_path / "audit.log"

    deleted = apply_retention(backing / "run", "checkpoint-*", 2, log)

    by_step = {int(d.name.split("-")[1]): d for d in dirs}
    assert sorted(deleted) == sorted([by_step[5], by_step[20], by_step[100]])
    remaining = sorted(p.name for p in (backing / "run").iterdir())
    assert remaining == ["checkpoint-1000", "checkpoint-300", "other"]
    lines = audit_lines(log)
    assert len(lines) == 3
    for when, action, path, reason in lines:
        datetime.fromisoformat(when)
        assert action == "deleted" and Path(path) in deleted and "checkpoint-1000" in reason
    assert apply_retention(backing / "run", "checkpoint-*", 2, log) == []


def test_retention_never_deletes_a_directory_with_a_plain_file(
    backing: Path, tmp_path: Path
) -> None:
    dirs = make_checkpoints(backing, [1, 2, 3, 4], prefix="global_step")
    (dirs[0] / "sub" / "notes.txt").write_text("written around ckptfs")
    log = tmp_path / "audit.log"

    deleted = apply_retention(backing / "run", "global_step*", 1, log)

    assert deleted == [dirs[1], dirs[2]]
    assert dirs[0].exists()
    actions = [(line[1], Path(line[2])) for line in audit_lines(log)]
    assert ("kept", dirs[0]) in actions
    assert [a for a in actions if a[0] == "deleted"] == [("deleted", dirs[1]), ("deleted", dirs[2])]
    assert "notes.txt" in audit_lines(log)[0][3]


def test_retention_waits_for_the_newest_to_be_durable(backing: Path, tmp_path: Path) -> None:
    dirs = make_checkpoints(backing, [1, 2, 3], prefix="iter_")
    log = tmp_path / "audit.log"
    store_file(backing, "run/iter_3/late.pt", b"not yet", state="pending")
    assert apply_retention(backing / "run", "iter_*", 1, log) == []
    assert all(d.exists() for d in dirs) and not log.exists()

    (backing / "run/iter_4").mkdir()  # a save that has only just started
    assert apply_retention(backing / "run", "iter_*", 1, log) == []

    seen: list[Path] = []

    def daemon_says_durable(path: Path) -> bool:
        seen.append(path)
        return True

    deleted = apply_retention(backing / "run", "iter_*", 2, log, is_durable=daemon_says_durable)
    assert seen == [backing / "run/iter_4"] and deleted == dirs[:2]


def test_retention_falls_back_to_mtime(backing: Path, tmp_path: Path) -> None:
    names = ["best", "latest", "final"]
    for i, name in enumerate(names):
        store_file(backing, f"run/ckpt-{name}/model.pt", name.encode())
        age([backing / f"run/ckpt-{name}"], 100 - i)  # best oldest, final newest
    deleted = apply_retention(backing / "run", "ckpt-*", 1, tmp_path / "audit.log")
    assert deleted == [backing / "run/ckpt-best", backing / "run/ckpt-latest"]


def test_retention_needs_keep_last_of_at_least_one(backing: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="keep_last"):
        apply_retention(backing, "*", 0, tmp_path / "audit.log")


# --- docs/FORMAT.md -------------------------------------------------------------
def format_doc_reassemble() -> Any:
    """The ``reassemble`` function of docs/FORMAT.md's script, run as printed."""
    text = (Path(__file__).parents[2] / "docs" / "FORMAT.md").read_text()
    script = text.split("```python\n")[-1].split("```")[0]
    namespace: dict[str, object] = {"__name__": "format_doc"}
    exec(compile(script, "FORMAT.md", "exec"), namespace)
    return namespace["reassemble"]


def test_format_doc_script_reassembles(backing: Path, tmp_path: Path) -> None:
    reassemble = format_doc_reassemble()
    data = torch_bytes(30, numel=100_000)
    store_file(backing, "model.pt", data)
    out = tmp_path / "model.pt"
    reassemble(str(backing), str(backing / "model.pt"), str(out))
    assert out.read_bytes() == data


def test_format_doc_script_reassembles_a_sparse_file_with_its_times(
    backing: Path, tmp_path: Path
) -> None:
    reassemble = format_doc_reassemble()
    store = ChunkStore(backing)
    head, middle = os.urandom(5000), os.urandom(7000)
    chunks = []
    for off, piece in ((0, head), (1 << 20, middle)):  # a gap between, and one after
        digest = chunk_hash(piece)
        store.put(digest, piece)
        chunks.append(Chunk(off, len(piece), digest))
    size = (3 << 20) + 17
    manifest = Manifest(
        new_id(), new_id(), size, 0o100600, 1_600_000_000_000_000_007, "durable", ["n1"],
        chunks, "fixed", atime_ns=1_500_000_000_000_000_003,
    )  # fmt: skip
    write_store_manifest(backing / "sparse.bin", manifest, backing, sync=False)
    out = tmp_path / "sparse.bin"
    reassemble(str(backing), str(backing / "sparse.bin"), str(out))
    expected = bytearray(size)
    expected[: len(head)] = head
    expected[1 << 20 : (1 << 20) + len(middle)] = middle
    st = os.stat(out)  # before reading it (relatime would move atime)
    assert (st.st_atime_ns, st.st_mtime_ns) == (manifest.atime_ns, manifest.mtime_ns)
    assert out.read_bytes() == bytes(expected)


def test_format_doc_script_reads_the_last_record_of_a_flushed_manifest(
    backing: Path, tmp_path: Path
) -> None:
    """A manifest its flush appended to (docs/FORMAT.md): a pending record,
    the durable one, and a record a crash cut short after them."""
    reassemble = format_doc_reassemble()
    data = torch_bytes(31, numel=50_000)
    store_file(backing, "model.pt", data)
    path = backing / "model.pt"
    durable = read_manifest(path)
    assert durable is not None and durable.state == "durable"
    pending = Manifest(
        durable.file_id, durable.version, durable.size, durable.mode, durable.mtime_ns,
        "pending", ["n1"],
    )  # fmt: skip
    torn = durable.record()[:40]
    path.write_bytes(pending.to_bytes() + durable.record() + torn)
    assert read_manifest(path) == durable
    out = tmp_path / "model.pt"
    reassemble(str(backing), str(path), str(out))
    assert out.read_bytes() == data
