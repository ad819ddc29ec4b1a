"""Close-to-open through real mounts: every read-only open whose manifest
check is due (``fuse.open_recheck``; 0: every open) reads the manifest, and
a new version written through another mount of the same backing directory
is what the next open reads, whole."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import pytest


def _opens(path: str, n: int) -> bytes:
    """``n`` opens of ``path`` (each read whole) by another process; the last bytes."""
    script = (
        "import sys\n"
        "for _ in range(int(sys.argv[2])):\n"
        "    with open(sys.argv[1], 'rb') as f:\n"
        "        data = f.read()\n"
        "sys.stdout.buffer.write(data)\n"
    )
    return subprocess.run(
        [sys.executable, "-c", script, path, str(n)], check=True, capture_output=True, timeout=60
    ).stdout


def test_each_open_reads_the_version_another_mount_wrote_last(mounts: Any) -> None:
    env = {"CKPTFS_FUSE_OPEN_RECHECK": "0"}
    a, b = mounts("a"), mounts("b")
    a.mount(env=env)
    b.mount(env=env)
    first, second = os.urandom(3 * 4096 + 11), os.urandom(2 * 4096 + 5)
    (a.mnt / "ckpt.pt").write_bytes(first)
    a.cli("flush", str(a.mnt), "--wait")
    assert _opens(str(b.mnt / "ckpt.pt"), 20) == first
    (a.mnt / "ckpt.pt.tmp").write_bytes(second)
    os.replace(a.mnt / "ckpt.pt.tmp", a.mnt / "ckpt.pt")
    a.cli("flush", str(a.mnt), "--wait")
    assert _opens(str(b.mnt / "ckpt.pt"), 1) == second
    assert _opens(str(b.mnt / "ckpt.pt"), 5) == second
    assert os.stat(b.mnt / "ckpt.pt").st_size == len(second)
    b.umount()
    a.umount()


def test_a_torch_checkpoint_loads_whole_with_every_open_checked(mounts: Any) -> None:
    torch = pytest.importorskip("torch")
    m = mounts("t")
    m.mount(env={"CKPTFS_FUSE_OPEN_RECHECK": "0"})
    gen = torch.Generator().manual_seed(5)
    sd = {f"w{i}": torch.randn(4096 + i, generator=gen) for i in range(8)}
    torch.save(sd, m.mnt / "model.pt.tmp")
    os.replace(m.mnt / "model.pt.tmp", m.mnt / "model.pt")
    for flushed in (False, True):
        if flushed:
            m.cli("flush", str(m.mnt), "--wait")
        for _ in range(3):
            got = torch.load(m.mnt / "model.pt", mmap=True, weights_only=True)
            assert got.keys() == sd.keys()
            assert all(torch.equal(got[k], sd[k]) for k in sd)
            del got
    m.umount()
