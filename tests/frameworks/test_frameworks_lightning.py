"""PyTorch Lightning's ModelCheckpoint through the mount.

Top-k rotation (save_top_k=2 on a monitored metric, so older checkpoints are
deleted), ``save_last`` (a file, or with ``"link"`` a symlink to the newest
top-k file), then a new Trainer on a new mount resumes with
``ckpt_path="last"``: the restored epoch, global step, weights and optimizer
state must be exactly the saved ones, and the rotation goes on across the
restart (it deletes files the first mount wrote). A third mount loads every
remaining checkpoint again.

Lightning serialises a checkpoint into memory, writes it to a temporary file
in TMPDIR (fsspec transaction) and moves it into place, which across
filesystems is a copy into the mount. TMPDIR is pointed at a directory of the
test so that it is seen to be cleaned up.

ModelCheckpoint restores its top-k state only if ``dirpath`` (resolved) is the
same as when it was saved, so, like a job that mounts ckptfs at its checkpoint
directory every time, mounts B and C use A's mountpoint (each with its own new,
empty cache).

Each case runs once as root and once as an ordinary user (the daemon is
root's either way).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
from clusters import PEER_LOGS, cluster
from frameworks_util import (
    ORDINARY,
    acting_as,
    assert_backing_durable,
    assert_owned,
    backing_manifests,
    clone_tree,
    files_under,
    job_dir,
    scratch_dir,
    umount_checked,
)
from pytorch_lightning.callbacks import ModelCheckpoint
from tensors import assert_same
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset
from waits import wait_for

# The monitored metric per epoch (mode="max"): epochs 0-3 on mount A keep
# {1, 3}; epochs 4-5 after the resume keep {3, 5}.
SCORES = [0.1, 0.3, 0.2, 0.4, 0.35, 0.5]
STEPS_PER_EPOCH = 4
KEYS = ("epoch", "global_step", "state_dict", "optimizer_states")


class Tiny(pl.LightningModule):
    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
        self.saved: dict[tuple[int, int], dict] = {}  # what each checkpoint held
        self.resumed: dict | None = None  # the state training (re)started from

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def on_train_epoch_end(self) -> None:
        self.log("score", SCORES[self.current_epoch])

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.01)

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        self.saved[(checkpoint["epoch"], checkpoint["global_step"])] = clone_tree(
            {k: checkpoint[k] for k in KEYS}
        )

    def on_train_start(self) -> None:
        self.resumed = clone_tree(
            {
                "epoch": self.current_epoch,
                "global_step": self.trainer.global_step,
                "state_dict": self.state_dict(),
                "optimizer_states": [o.state_dict() for o in self.trainer.optimizers],
            }
        )


def mount_at(m, mnt) -> None:
    """Mount ``m`` (its own new cache and run directory) at the mountpoint ``mnt``."""
    m.mnt = mnt
    m.mount()


def data() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4 * STEPS_PER_EPOCH, 8, generator=g)
    return DataLoader(TensorDataset(x, x[:, :2] * 2 - 1), batch_size=4)


def fit(ckpt_dir, save_last, max_epochs: int, seed: int, ckpt_path=None) -> Tiny:
    model = Tiny(seed)
    checkpoint = ModelCheckpoint(
        dirpath=ckpt_dir, monitor="score", mode="max", save_top_k=2, save_last=save_last
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=max_epochs,
        callbacks=[checkpoint],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, data(), ckpt_path=ckpt_path)
    return model


def name(epoch: int) -> str:
    return f"epoch={epoch}-step={(epoch + 1) * STEPS_PER_EPOCH}.ckpt"


def check_files(ckpt_dir, saved: dict, top: list[int], save_last) -> None:
    """The directory holds exactly the top-k files and last.ckpt, each as saved."""
    assert files_under(ckpt_dir) == sorted([*map(name, top), "last.ckpt"])
    last = ckpt_dir / "last.ckpt"
    if save_last == "link":
        assert last.is_symlink() and os.readlink(last) == name(top[-1])
    else:
        assert not last.is_symlink()
    for f in [*map(name, top), "last.ckpt"]:
        ckpt = torch.load(ckpt_dir / f, weights_only=False)
        assert_same(saved[(ckpt["epoch"], ckpt["global_step"])], {k: ckpt[k] for k in KEYS}, f)
    assert torch.load(last, weights_only=False)["epoch"] == top[-1]


@pytest.mark.parametrize("user", [None, ORDINARY], ids=["root", "user"])
@pytest.mark.parametrize("save_last", [True, "link"])
def test_lightning_topk_last_and_resume(shared_mounts, monkeypatch, save_last, user):
    # shared_mounts: under a directory every user may traverse
    with scratch_dir(user) as staging:
        monkeypatch.setattr(tempfile, "tempdir", str(staging))  # Lightning's TMPDIR
        run_topk_last_and_resume(shared_mounts, monkeypatch, lambda mnt: staging, save_last, user)


@pytest.mark.parametrize("user", [None, ORDINARY], ids=["root", "user"])
def test_lightning_with_its_tmpdir_in_the_mount(shared_mounts, monkeypatch, user):
    """The setting this README advises: TMPDIR inside the mount, so that each
    checkpoint is staged there and renamed into place, not copied."""

    def staging(mnt):
        d = mnt / "tmp"
        if not d.exists():  # made on the first mount; the later ones find it
            job_dir(d, user)
        monkeypatch.setattr(tempfile, "tempdir", str(d))
        return d

    run_topk_last_and_resume(shared_mounts, monkeypatch, staging, True, user)


def run_topk_last_and_resume(mounts, monkeypatch, staging_in, save_last, user) -> None:
    """``staging_in(mountpoint)``: Lightning's TMPDIR, set by then."""
    staged = []  # where each checkpoint Lightning moved into place was written
    move = shutil.move

    def moving(src, dst, *args, **kwargs):
        staged.append(Path(src).parent)
        return move(src, dst, *args, **kwargs)

    monkeypatch.setattr(shutil, "move", moving)  # fsspec's commit of the staged file
    top_a, top_b = [1, 3], [3, 5]
    expect_a = [f"lightning/{name(e)}" for e in top_a]
    expect_b = [f"lightning/{name(e)}" for e in top_b]
    if save_last is True:
        expect_a.append("lightning/last.ckpt")
        expect_b.append("lightning/last.ckpt")

    a = mounts("a")
    a.mount()
    staging = staging_in(a.mnt)
    ckpt_dir = job_dir(a.mnt / "lightning", user)
    with acting_as(user):
        first = fit(ckpt_dir, save_last, max_epochs=4, seed=0)
        saved = dict(first.saved)
        check_files(ckpt_dir, saved, top_a, save_last)
    assert first.resumed["global_step"] == 0
    assert sorted({e for e, _ in saved}) == [0, 1, 2, 3]
    assert list(staging.iterdir()) == []  # every staged copy was moved into the mount
    assert staged and set(staged) == {staging}, staged
    assert_owned(a.mnt, expect_a, user)
    umount_checked(a, expect_a)

    b = mounts("b")
    mount_at(b, a.mnt)
    staging = staging_in(b.mnt)
    with acting_as(user):
        second = fit(b.mnt / "lightning", save_last, max_epochs=6, seed=1, ckpt_path="last")
    last_saved = saved[(3, 4 * STEPS_PER_EPOCH)]
    assert second.resumed["epoch"] == 4
    assert second.resumed["global_step"] == 4 * STEPS_PER_EPOCH
    assert_same(last_saved["state_dict"], second.resumed["state_dict"], "resumed weights")
    assert_same(
        last_saved["optimizer_states"], second.resumed["optimizer_states"], "resumed optimizer"
    )
    assert sorted({e for e, _ in second.saved}) == [4, 5]
    saved.update(second.saved)
    with acting_as(user):
        check_files(b.mnt / "lightning", saved, top_b, save_last)
    assert list(staging.iterdir()) == []
    assert_owned(b.mnt, expect_b, user)
    umount_checked(b, expect_b)

    c = mounts("c")
    mount_at(c, a.mnt)
    with acting_as(user):
        check_files(c.mnt / "lightning", saved, top_b, save_last)
        # Lightning's own loading code, through last.ckpt.
        restored = Tiny.load_from_checkpoint(c.mnt / "lightning" / "last.ckpt", seed=2)
    assert_same(saved[(5, 6 * STEPS_PER_EPOCH)]["state_dict"], restored.state_dict(), "restored")
    umount_checked(c, expect_b)


@pytest.mark.parametrize("save_last", [True, "link"])
def test_lightning_resumes_on_the_buddy_after_its_node_died(
    mounts, tmp_path, monkeypatch, save_last
):
    """Two nodes, each other's buddy. Lightning saves on n1 with its TMPDIR in
    the mount and nothing durable yet (the flusher slowed); n1 dies and n2
    takes its checkpoints over; the job resumes on n2 with
    ``ckpt_path="last"`` from exactly the last saved state and trains on,
    and everything ends durable. (Its mountpoint differs from n1's here, so
    Lightning keeps n1's files and names its own last checkpoint
    last-v1.ckpt; on real nodes the path is the same.)"""
    slow = {"CKPTFS_FLUSH_BANDWIDTH": "32KiB"}
    nodes = cluster(mounts, tmp_path, ["n1", "n2"], {"n1": slow, "n2": slow})
    n1, n2 = nodes["n1"], nodes["n2"]
    n2.allowed_log += PEER_LOGS + ["is dead", "taking over", "is not mirrored"]
    (n1.mnt / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(n1.mnt / "tmp"))
    first = fit(n1.mnt / "lightning", save_last, max_epochs=4, seed=0)
    pending = [p for p, b in backing_manifests(n1.backing).items() if b["state"] != "durable"]
    assert f"lightning/{name(3)}" in pending, pending  # else the takeover tests nothing
    n1.kill()
    wait_for(lambda: f"taking over lightning/{name(3)}" in n2.log(), 30, "n2 takes over")

    monkeypatch.setattr(tempfile, "tempdir", str(n2.mnt / "tmp"))
    second = fit(n2.mnt / "lightning", save_last, max_epochs=6, seed=1, ckpt_path="last")
    last_saved = first.saved[(3, 4 * STEPS_PER_EPOCH)]
    assert second.resumed["epoch"] == 4
    assert_same(last_saved["state_dict"], second.resumed["state_dict"], "resumed weights")
    assert_same(
        last_saved["optimizer_states"], second.resumed["optimizer_states"], "resumed optimizer"
    )
    assert sorted({e for e, _ in second.saved}) == [4, 5]
    for e in (4, 5):
        ckpt = torch.load(n2.mnt / "lightning" / name(e), weights_only=False)
        assert_same(
            second.saved[(e, (e + 1) * STEPS_PER_EPOCH)], {k: ckpt[k] for k in KEYS}, name(e)
        )
    n2.umount()
    manifests = assert_backing_durable(n2)
    assert {f"lightning/{name(e)}" for e in (1, 3, 4, 5)} <= set(manifests), sorted(manifests)
