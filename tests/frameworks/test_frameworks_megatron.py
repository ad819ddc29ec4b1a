"""The Megatron-LM checkpoint pattern on one node, through the mount.

4 ranks each write ``iter_0000010/mp_rank_0X/model_optim_rng.pt`` (racing to
create the directories), then after a barrier rank 0 writes
``latest_checkpointed_iteration.txt``. A restart with 2 ranks reads the
tracker, loads every shard (each new rank the two old tensor-parallel shards
it merges) and compares every tensor with torch.equal. Once as root and once
with every rank as an ordinary user.
"""

from __future__ import annotations

import pytest
from frameworks_util import (
    MEGATRON_TRACKER,
    ORDINARY,
    assert_owned,
    files_under,
    job_dir,
    ranks,
    torchrun,
    umount_checked,
)

SAVE_RANKS, LOAD_RANKS = 4, 2


@pytest.mark.parametrize("user", [None, ORDINARY], ids=["root", "user"])
def test_megatron_rank_files_then_restart_with_fewer_ranks(shared_mounts, user):
    mounts = shared_mounts  # under a directory every user may traverse
    shards = [f"iter_0000010/mp_rank_{r:02d}/model_optim_rng.pt" for r in range(SAVE_RANKS)]
    expect = [f"megatron/{p}" for p in [*shards, MEGATRON_TRACKER]]

    a = mounts("a")
    a.mount()
    root = job_dir(a.mnt / "megatron", user)
    # torchrun as root; as the user, the ranks as Slurm's srun starts them.
    launch = torchrun if user is None else ranks
    out = launch(SAVE_RANKS, "megatron-save", str(root), user=user)
    assert all(f"megatron-save ok rank {r}" in out for r in range(SAVE_RANKS)), out
    assert files_under(root) == sorted([*shards, MEGATRON_TRACKER])
    assert (root / MEGATRON_TRACKER).read_text() == "10"
    assert_owned(a.mnt, expect, user)
    umount_checked(a, expect)

    for name in ("b", "c"):
        m = mounts(name)
        m.mount()
        out = launch(
            LOAD_RANKS, "megatron-load", str(m.mnt / "megatron"), str(SAVE_RANKS), user=user
        )
        assert "megatron-load ok rank 0 shards [0, 1]" in out, out
        assert "megatron-load ok rank 1 shards [2, 3]" in out, out
        umount_checked(m, expect)
