"""The arena: stores through the mapping only where no page fault can fail."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
from ckptfs.fs.content.arena import Arena

SLOT = 64 << 10


def file_bytes(arena: Arena, slot: int) -> bytes:
    return os.pread(arena.fd, SLOT, slot * SLOT)


def test_a_slot_is_stored_into_through_the_mapping_once_it_has_no_holes(tmp_path):
    arena = Arena(tmp_path / "arena", 4 * SLOT, SLOT)
    try:
        a, b = os.urandom(SLOT // 2), os.urandom(SLOT // 2)
        arena.write(0, 0, a)
        assert not arena.backed(0)  # half of it is still a hole
        arena.write(0, SLOT // 2, b)
        assert arena.backed(0) and file_bytes(arena, 0) == a + b
        arena.write(1, SLOT // 2, b)  # filled to its end, but a hole before
        assert not arena.backed(1)
        # Through the mapping now: the file sees the bytes (one shared page set).
        c = os.urandom(SLOT)
        arena.write(0, 0, c)
        assert file_bytes(arena, 0) == c
        arena.copy(0, 2, SLOT // 4)  # into a hole: by pwrite
        assert file_bytes(arena, 2)[: SLOT // 4] == c[: SLOT // 4] and not arena.backed(2)
        arena.zero(0, 10, 20)
        assert file_bytes(arena, 0) == c[:10] + bytes(10) + c[20:]
    finally:
        arena.close()


def test_back_zero_fills_only_a_slot_with_holes(tmp_path):
    arena = Arena(tmp_path / "arena", 4 * SLOT, SLOT)
    try:
        data = os.urandom(SLOT)
        arena.write(0, 0, data)  # no hole: backed, and back() leaves it be
        arena.back(0)
        assert file_bytes(arena, 0) == data
        arena.write(1, 0, data[:100])
        arena.back(1)  # a hole after 100 bytes: the whole slot is zero-filled
        assert arena.backed(1) and file_bytes(arena, 1) == bytes(SLOT)
        arena.write(1, 5, b"x")  # through the mapping now
        assert file_bytes(arena, 1)[:7] == bytes(5) + b"x" + bytes(1)
    finally:
        arena.close()


def test_prefault_backs_and_maps_every_slot_of_a_batch(tmp_path):
    arena = Arena(tmp_path / "arena", 4 * SLOT, SLOT)
    try:
        arena.write(3, 0, os.urandom(100))  # partly written already
        batch = arena.take_prefault_batch(4)
        assert arena.prefault(batch) == 4 * SLOT
        arena.return_prefault_batch(batch)
        assert all(arena.backed(s) for s in range(4))
        batch = arena.take_prefault_batch(4)
        assert arena.prefault(batch) == 0  # backed now: nothing zero-filled again
        arena.return_prefault_batch(batch)
        data = os.urandom(SLOT)
        arena.write(1, 0, data)
        assert file_bytes(arena, 1) == data
    finally:
        arena.close()


FULL_TMPFS = textwrap.dedent(
    """
    import errno, os, sys
    from pathlib import Path
    from ckptfs.fs.content.arena import Arena
    SLOT = 256 << 10
    arena = Arena(Path(sys.argv[1]) / "arena", 8 * SLOT, SLOT)
    batch = arena.take_prefault_batch(8)
    try:
        arena.prefault(batch)
        raise SystemExit("pre-faulting 2 MiB into a 1 MiB tmpfs did not fail")
    except OSError as exc:
        assert exc.errno == errno.ENOSPC, exc
    backed = [s for s in batch if arena.backed(s)]
    holes = [s for s in batch if not arena.backed(s)]
    assert backed and holes, (backed, holes)
    arena.write(backed[0], 0, os.urandom(SLOT))  # through the mapping
    for slot in holes:  # a store into a hole here would be a SIGBUS
        try:
            arena.write(slot, 0, os.urandom(SLOT))
        except OSError as exc:
            assert exc.errno == errno.ENOSPC, exc
        else:
            raise SystemExit(f"a full write into hole slot {slot} of a full tmpfs passed")
        try:
            arena.copy(backed[0], slot, SLOT)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC, exc
        # Before its views are handed to a peer transfer or a bounce copy.
        try:
            arena.back(slot)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC, exc
        else:
            raise SystemExit(f"backing hole slot {slot} of a full tmpfs passed")
        assert not arena.backed(slot)
    print("ok")
    """
)


@pytest.mark.skipif(os.geteuid() != 0, reason="mounts a small tmpfs")
def test_a_full_tmpfs_fails_a_write_with_enospc_and_never_kills_the_daemon(tmp_path):
    root = tmp_path / "small"
    root.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(root)], check=True)
    try:
        # In a child: a SIGBUS would end it with a signal, not this test run.
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
        run = subprocess.run(
            [sys.executable, "-c", FULL_TMPFS, str(root)],
            capture_output=True,
            text=True,
            timeout=60,
            env=env,
        )
        assert run.returncode == 0 and run.stdout.strip() == "ok", (run.returncode, run.stderr)
    finally:
        subprocess.run(["umount", "-l", str(root)], check=False)
