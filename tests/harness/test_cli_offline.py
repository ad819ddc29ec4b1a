"""The CLI outside a mount: `ckptfs --version`, and `gc`, which reports unless
told to delete (an operator who runs it to look loses nothing)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

from ckptfs.fs.store.chunkstore import ChunkStore, chunk_hash


def ckptfs(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ckptfs", *args], capture_output=True, text=True, timeout=60
    )


def test_version_is_the_installed_packages() -> None:
    done = ckptfs("--version")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"ckptfs {metadata.version('ckptfs')}"


def test_gc_reports_by_default_and_deletes_only_when_told(tmp_path: Path) -> None:
    backing = tmp_path / "backing"
    backing.mkdir()
    store = ChunkStore(backing)
    orphan = os.urandom(5000)
    digest = chunk_hash(orphan)
    store.put(digest, orphan)
    old = time.time() - 7200
    os.utime(store.path_for(digest), (old, old))
    young = os.urandom(3000)
    store.put(chunk_hash(young), young)  # within the grace period: kept either way

    report = ckptfs("gc", str(backing))
    assert report.returncode == 0, report.stderr
    assert f"would remove {store.path_for(digest)}" in report.stdout
    assert "would remove 1 chunk file(s), 5000 bytes" in report.stdout
    assert "run with --delete" in report.stdout
    assert store.exists(digest) and store.exists(chunk_hash(young))

    done = ckptfs("gc", str(backing), "--delete")
    assert done.returncode == 0, done.stderr
    assert "removed 1 chunk file(s), 5000 bytes" in done.stdout
    assert not store.exists(digest) and store.exists(chunk_hash(young))
