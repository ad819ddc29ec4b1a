"""torch.distributed.checkpoint through the mount: FSDP2 (fully_shard) on 2
gloo ranks on CPU, ``dcp.save`` and ``dcp.async_save``, then loads with 2 ranks
and a resharded load with 1 rank, each on a new mount with an empty cache.

The ranks are real processes (tests/frameworks_util.py under
torch.distributed.run); every tensor of the model and optimizer state is
compared with torch.equal against the full state rank 0 kept at save time.
Once as root and once with every rank as an ordinary user.
"""

from __future__ import annotations

import pytest
from frameworks_util import (
    ORDINARY,
    assert_owned,
    backing_manifests,
    files_under,
    job_dir,
    scratch_dir,
    torchrun,
    umount_checked,
    worker,
)

DCP_FILES = [".metadata", "__0_0.distcp", "__1_0.distcp"]


@pytest.mark.parametrize("user", [None, ORDINARY], ids=["root", "user"])
def test_dcp_fsdp2_save_async_save_and_resharded_loads(shared_mounts, user):
    mounts = shared_mounts  # under a directory every user may traverse
    expect = [f"dcp/{d}/{f}" for d in ("async", "sync") for f in DCP_FILES]
    # ref: the expected full states, outside any mount
    with scratch_dir(user) as ref:
        a = mounts("a")
        a.mount()
        job_dir(a.mnt / "dcp", user)
        out = torchrun(2, "dcp-save", str(a.mnt / "dcp"), str(ref), user=user)
        assert "dcp-save ok rank 0" in out and "dcp-save ok rank 1" in out
        assert files_under(a.mnt) == sorted(expect)
        assert_owned(a.mnt, expect, user)
        umount_checked(a, expect)

        for name in ("b", "c"):
            m = mounts(name)  # same backing directory, new empty cache
            m.mount()
            out = torchrun(2, "dcp-load", str(m.mnt / "dcp"), str(ref), user=user)
            assert "dcp-load ok rank 0 world 2" in out and "dcp-load ok rank 1 world 2" in out
            out = worker("dcp-load", str(m.mnt / "dcp"), str(ref), user=user)  # resharded
            assert "dcp-load ok rank 0 world 1" in out
            umount_checked(m, expect)


@pytest.mark.parametrize("user", [None, ORDINARY], ids=["root", "user"])
def test_dcp_loads_after_its_daemon_died_before_the_checkpoint_was_durable(shared_mounts, user):
    """The node's daemon is killed while the ranks' files and ``.metadata``
    are only in its RAM cache (the flusher slowed to a crawl): the remount on
    that node (the same cache directory) recovers them from the cache's
    journal, still the user's, and 2 ranks, 1 rank, and then another node's
    new mount load it."""
    expect = [f"dcp/{d}/{f}" for d in ("async", "sync") for f in DCP_FILES]
    with scratch_dir(user) as ref:
        a = shared_mounts("a")
        a.mount(env={"CKPTFS_FLUSH_BANDWIDTH": "4KiB"})
        job_dir(a.mnt / "dcp", user)
        out = torchrun(2, "dcp-save", str(a.mnt / "dcp"), str(ref), user=user)
        assert "dcp-save ok rank 0" in out and "dcp-save ok rank 1" in out
        pending = [p for p, b in backing_manifests(a.backing).items() if b["state"] != "durable"]
        assert "dcp/async/.metadata" in pending, pending  # else the kill tests nothing
        a.kill()

        a.mount()
        a.allowed_log = ["recovered"]
        assert files_under(a.mnt) == sorted(expect)
        assert_owned(a.mnt, expect, user)
        out = torchrun(2, "dcp-load", str(a.mnt / "dcp"), str(ref), user=user)
        assert "dcp-load ok rank 0 world 2" in out and "dcp-load ok rank 1 world 2" in out
        out = worker("dcp-load", str(a.mnt / "dcp"), str(ref), user=user)
        assert "dcp-load ok rank 0 world 1" in out
        umount_checked(a, expect)

        b = shared_mounts("b")
        b.mount()
        out = torchrun(2, "dcp-load", str(b.mnt / "dcp"), str(ref), user=user)
        assert "dcp-load ok rank 0 world 2" in out and "dcp-load ok rank 1 world 2" in out
        umount_checked(b, expect)


def test_dcp_saves_over_the_checkpoint_it_resumed_from(mounts, tmp_path):
    """A resumed job saves again under the same checkpoint id: DCP rewrites
    every file of it in place (``.metadata`` and each rank's file), over files
    this mount read from the backing store after a cold remount. The next cold
    mount loads the second save's state, with 2 ranks and with 1."""
    first, second = tmp_path / "ref-first", tmp_path / "ref-second"
    first.mkdir()
    second.mkdir()
    expect = [f"dcp/{d}/{f}" for d in ("async", "sync") for f in DCP_FILES]
    a = mounts("a")
    a.mount()
    torchrun(2, "dcp-save", str(a.mnt / "dcp"), str(first))
    umount_checked(a, expect)

    b = mounts("b")
    b.mount()
    out = torchrun(2, "dcp-load", str(b.mnt / "dcp"), str(first))
    assert "dcp-load ok rank 0 world 2" in out and "dcp-load ok rank 1 world 2" in out
    out = torchrun(2, "dcp-save", str(b.mnt / "dcp"), str(second), "--seed", "1")
    assert "dcp-save ok rank 0" in out and "dcp-save ok rank 1" in out
    umount_checked(b, expect)

    c = mounts("c")
    c.mount()
    out = torchrun(2, "dcp-load", str(c.mnt / "dcp"), str(second))
    assert "dcp-load ok rank 0 world 2" in out and "dcp-load ok rank 1 world 2" in out
    out = worker("dcp-load", str(c.mnt / "dcp"), str(second))
    assert "dcp-load ok rank 0 world 1" in out
    umount_checked(c, expect)
