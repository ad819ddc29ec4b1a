"""safetensors through the mount: ``save_file``, ``load_file`` and
``safe_open(..., framework="pt")`` (which mmaps the file), on the mount that
wrote it and on two new mounts with empty caches; once as root and once as
an ordinary user."""

from __future__ import annotations

import pytest
import torch
from frameworks_util import ORDINARY, acting_as, assert_owned, job_dir, umount_checked
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from tensors import assert_same

METADATA = {"format": "pt", "step": "42"}


def tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {
        "embed.weight": torch.randn(1024, 1100, generator=g),  # > 4 MiB: several chunks
        "layers.0.attn.qkv.weight": torch.randn(96, 32, generator=g).to(torch.bfloat16),
        "layers.0.mlp.fc.weight": torch.randn(64, 32, generator=g).to(torch.float16),
        "layers.0.norm.weight": torch.rand(32, generator=g, dtype=torch.float64),
        "positions": torch.arange(-50, 50, dtype=torch.int64),
        "vocab_mask": torch.rand(333, generator=g) > 0.5,
        "quant": torch.randint(0, 256, (4097,), generator=g, dtype=torch.uint8),
        "int8": torch.randint(-128, 128, (17, 3), generator=g, dtype=torch.int8),
        "scale": torch.tensor(0.125),
        "empty": torch.zeros(0, 4),
    }


def check_reads(path, expected):
    assert_same(expected, load_file(path), "load_file")
    with safe_open(path, framework="pt") as f:
        assert sorted(f.keys()) == sorted(expected)
        assert f.metadata() == METADATA
        for k in f.keys():
            assert_same({k: expected[k]}, {k: f.get_tensor(k)}, f"safe_open {k}")
        for k in ("embed.weight", "layers.0.attn.qkv.weight"):
            if k in expected:  # a slice reads only part of the mapped file
                assert torch.equal(f.get_slice(k)[60:90, 7:9], expected[k][60:90, 7:9])


@pytest.mark.parametrize("user", [None, ORDINARY], ids=["root", "user"])
def test_safetensors_save_load_safe_open(shared_mounts, user):
    mounts = shared_mounts  # under a directory every user may traverse
    expected = tensors()
    files = ["st/model.safetensors", "st/small.safetensors"]
    small = {k: v for k, v in expected.items() if k != "embed.weight"}

    a = mounts("a")
    a.mount()
    job_dir(a.mnt / "st", user)
    with acting_as(user):
        save_file(expected, a.mnt / files[0], metadata=METADATA)
        save_file(small, a.mnt / files[1], metadata=METADATA)
        check_reads(a.mnt / files[0], expected)  # from the RAM cache
    assert_owned(a.mnt, files, user)
    if user is not None:  # the user's own permissions, not root's: the mount's root is root's
        with acting_as(user), pytest.raises(PermissionError):
            open(a.mnt / "not-the-users.safetensors", "wb").close()
    umount_checked(a, files)

    for name in ("b", "c"):
        m = mounts(name)
        m.mount()
        with acting_as(user):
            check_reads(m.mnt / files[0], expected)
            check_reads(m.mnt / files[1], small)
        umount_checked(m, files)
