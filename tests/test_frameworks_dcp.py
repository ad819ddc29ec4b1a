"""torch.distributed.checkpoint through the mount: FSDP2 (fully_shard) on 2
gloo ranks on CPU, ``dcp.save`` and ``dcp.async_save``, then loads with 2 ranks
and a resharded load with 1 rank, each on a new mount with an empty cache.

The ranks are real processes (tests/frameworks_util.py under
torch.distributed.run); every tensor of the model and optimizer state is
compared with torch.equal against the full state rank 0 kept at save time.
"""

from __future__ import annotations

from frameworks_util import files_under, torchrun, umount_checked, worker

DCP_FILES = [".metadata", "__0_0.distcp", "__1_0.distcp"]


def test_dcp_fsdp2_save_async_save_and_resharded_loads(mounts, tmp_path):
    ref = tmp_path / "ref"  # the expected full states, outside any mount
    ref.mkdir()
    expect = [f"dcp/{d}/{f}" for d in ("async", "sync") for f in DCP_FILES]

    a = mounts("a")
    a.mount()
    out = torchrun(2, "dcp-save", str(a.mnt / "dcp"), str(ref))
    assert "dcp-save ok rank 0" in out and "dcp-save ok rank 1" in out
    assert files_under(a.mnt) == sorted(expect)
    umount_checked(a, expect)

    for name in ("b", "c"):
        m = mounts(name)  # same backing directory, new empty cache
        m.mount()
        out = torchrun(2, "dcp-load", str(m.mnt / "dcp"), str(ref))
        assert "dcp-load ok rank 0 world 2" in out and "dcp-load ok rank 1 world 2" in out
        out = worker("dcp-load", str(m.mnt / "dcp"), str(ref))  # resharded: 1 rank
        assert "dcp-load ok rank 0 world 1" in out
        umount_checked(m, expect)
