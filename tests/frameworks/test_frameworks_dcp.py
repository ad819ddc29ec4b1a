"""torch.distributed.checkpoint through the mount: FSDP2 (fully_shard) on 2
gloo ranks on CPU, ``dcp.save`` and ``dcp.async_save``, then loads with 2 ranks
and a resharded load with 1 rank, each on a new mount with an empty cache.

The ranks are real processes (tests/support/frameworks_util.py): under
torch.distributed.run in the first test, started directly as a cluster's
launcher starts them (``frameworks_util.ranks``) in the others. Every
tensor of the model and optimizer state is compared with torch.equal
against the full state rank 0 kept at save time.
Once as root and once with every rank as an ordinary user.
"""

from __future__ import annotations

import pytest
from clusters import PEER_LOGS, cluster
from frameworks_util import (
    ORDINARY,
    assert_owned,
    backing_manifests,
    files_under,
    job_dir,
    ranks,
    scratch_dir,
    torchrun,
    umount_checked,
    worker,
)
from waits import wait_for

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
        stored = umount_checked(a, expect)

        b = mounts("b")  # same backing directory, new empty cache
        b.mount()
        out = torchrun(2, "dcp-load", str(b.mnt / "dcp"), str(ref), user=user)
        assert "dcp-load ok rank 0 world 2" in out and "dcp-load ok rank 1 world 2" in out
        out = worker("dcp-load", str(b.mnt / "dcp"), str(ref), user=user)  # resharded
        assert "dcp-load ok rank 0 world 1" in out
        # The loads changed nothing in the backing directory: every later
        # mount loads what this one did (a second mount's loads checked it).
        assert umount_checked(b, expect) == stored


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
        out = ranks(2, "dcp-save", str(a.mnt / "dcp"), str(ref), user=user)
        assert "dcp-save ok rank 0" in out and "dcp-save ok rank 1" in out
        pending = [p for p, b in backing_manifests(a.backing).items() if b["state"] != "durable"]
        assert "dcp/async/.metadata" in pending, pending  # else the kill tests nothing
        a.kill()

        a.mount()
        a.allowed_log = ["recovered"]
        assert files_under(a.mnt) == sorted(expect)
        assert_owned(a.mnt, expect, user)
        out = ranks(2, "dcp-load", str(a.mnt / "dcp"), str(ref), user=user)
        assert "dcp-load ok rank 0 world 2" in out and "dcp-load ok rank 1 world 2" in out
        out = worker("dcp-load", str(a.mnt / "dcp"), str(ref), user=user)
        assert "dcp-load ok rank 0 world 1" in out
        umount_checked(a, expect)

        b = shared_mounts("b")
        b.mount()
        out = ranks(2, "dcp-load", str(b.mnt / "dcp"), str(ref), user=user)
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
    ranks(2, "dcp-save", str(a.mnt / "dcp"), str(first))
    umount_checked(a, expect)

    b = mounts("b")
    b.mount()
    out = ranks(2, "dcp-load", str(b.mnt / "dcp"), str(first))
    assert "dcp-load ok rank 0 world 2" in out and "dcp-load ok rank 1 world 2" in out
    out = ranks(2, "dcp-save", str(b.mnt / "dcp"), str(second), "--seed", "1")
    assert "dcp-save ok rank 0" in out and "dcp-save ok rank 1" in out
    umount_checked(b, expect)

    c = mounts("c")
    c.mount()
    out = ranks(2, "dcp-load", str(c.mnt / "dcp"), str(second))
    assert "dcp-load ok rank 0 world 2" in out and "dcp-load ok rank 1 world 2" in out
    out = worker("dcp-load", str(c.mnt / "dcp"), str(second))
    assert "dcp-load ok rank 0 world 1" in out
    umount_checked(c, expect)


def test_dcp_across_two_nodes_restarts_with_the_ranks_swapped_and_after_a_node_died(
    mounts, tmp_path
):
    """Two nodes (each its own daemon, mount and cache, one backing directory),
    each other's buddy; rank r saves through node r's mount (the same path on
    real nodes, two here) while nothing becomes durable (the flusher slowed).
    The restart runs each rank on the other node, so every file it reads was
    written on the other one; then n1 dies, n2 takes its files over, loads
    alone, and after n2's unmount a new mount loads it cold."""
    slow = {"CKPTFS_FLUSH_BANDWIDTH": "4KiB"}
    nodes = cluster(mounts, tmp_path, ["n1", "n2"], {"n1": slow, "n2": slow})
    n1, n2 = nodes["n1"], nodes["n2"]
    for m in (n1, n2):
        m.allowed_log += PEER_LOGS + ["is dead", "taking over", "is not mirrored"]
    ref = tmp_path / "ref"
    ref.mkdir()
    expect = [f"dcp/{d}/{f}" for d in ("async", "sync") for f in DCP_FILES]

    def through(*order: str) -> str:
        return ",".join(str(nodes[n].mnt / "dcp") for n in order)

    out = ranks(2, "dcp-save", through("n1", "n2"), str(ref))
    assert "dcp-save ok rank 0" in out and "dcp-save ok rank 1" in out
    pending = [p for p, b in backing_manifests(n1.backing).items() if b["state"] != "durable"]
    assert "dcp/async/.metadata" in pending and "dcp/async/__1_0.distcp" in pending, pending
    out = ranks(2, "dcp-load", through("n2", "n1"), str(ref))
    assert "dcp-load ok rank 0 world 2" in out and "dcp-load ok rank 1 world 2" in out

    n1.kill()
    wait_for(lambda: "taking over" in n2.log(), 30, "n2 takes n1's files over")
    out = worker("dcp-load", str(n2.mnt / "dcp"), str(ref))
    assert "dcp-load ok rank 0 world 1" in out
    umount_checked(n2, expect)

    c = mounts("c")
    c.mount()
    out = ranks(2, "dcp-load", str(c.mnt / "dcp"), str(ref))
    assert "dcp-load ok rank 0 world 2" in out and "dcp-load ok rank 1 world 2" in out
    umount_checked(c, expect)
