"""Regression tests: lost files, renames before a crash, long names, store failures.

(A rewrite interrupted by a crash: tests/mount/test_lifecycle.py.)
"""

from __future__ import annotations

import errno
import os
import subprocess

import pytest
from ckptfs.fs.store.manifest import Manifest, read_manifest
from manifests import write_store_manifest
from waits import wait_for


def test_lost_file_reads_eio_and_refuses_partial_rewrites(mounts):
    m = mounts()
    m.backing.mkdir(parents=True, exist_ok=True)
    # A file another node closed but never flushed, and that node is gone.
    write_store_manifest(
        m.backing / "orphan.pt",
        Manifest("f" * 16, "v" * 16, 1000, 0o644, 0, "pending", ["gone-node"]),
        m.backing,
    )
    m.mount()
    m.allowed_log = ["is lost", "bytes lost", "its bytes are lost"]
    with pytest.raises(OSError) as exc:
        (m.mnt / "orphan.pt").read_bytes()
    assert exc.value.errno == errno.EIO
    with pytest.raises(OSError) as exc:
        open(m.mnt / "orphan.pt", "r+b").close()  # would keep lost (zero) bytes
    assert exc.value.errno == errno.EIO
    assert [x["path"] for x in m.stat()["lost"]] == ["orphan.pt"]
    (m.mnt / "orphan.pt").write_bytes(b"fresh")  # a full rewrite is fine
    assert (m.mnt / "orphan.pt").read_bytes() == b"fresh"
    m.wait_durable()
    assert m.stat()["lost"] == []


def test_rename_after_close_then_crash_keeps_the_file(mounts):
    m = mounts()
    m.mount(env={"CKPTFS_FLUSH_BANDWIDTH": "1MiB"})
    blob = os.urandom(6 << 20)
    (m.mnt / "model.pt.tmp").write_bytes(blob)
    os.replace(m.mnt / "model.pt.tmp", m.mnt / "model.pt")
    assert read_manifest(m.backing / "model.pt").state == "pending"
    m.kill()
    m.mount()
    m.allowed_log = ["recovered"]
    assert (m.mnt / "model.pt").read_bytes() == blob
    m.wait_durable()
    assert read_manifest(m.backing / "model.pt").state == "durable"


def test_names_up_to_name_max(mounted):
    name = "n" * 255
    (mounted.mnt / name).write_bytes(b"long")
    assert (mounted.mnt / name).read_bytes() == b"long"
    mounted.wait_durable()
    assert read_manifest(mounted.backing / name).state == "durable"


def test_backing_store_failure_during_flush_is_retried_not_fatal(mounts):
    m = mounts()
    m.mount()
    chunks = m.backing / ".ckptfs" / "chunks"
    # Immutable: even root cannot create the chunk's subdirectories now.
    subprocess.run(["chattr", "+i", str(chunks)], check=True)
    try:
        blob = os.urandom(3 << 20)
        (m.mnt / "x.bin").write_bytes(blob)  # close succeeds: bytes are in RAM
        wait_for(lambda: "flush of x.bin failed, will retry" in m.log(), 20, "a failed flush")
        assert m.file_state("x.bin") == "dirty"
        assert (m.mnt / "x.bin").read_bytes() == blob  # the daemon is alive and serving
    finally:
        subprocess.run(["chattr", "-i", str(chunks)], check=True)
    m.wait_durable(timeout=90)
    assert read_manifest(m.backing / "x.bin").state == "durable"
    m.allowed_log = ["flush of x.bin failed, will retry"]
