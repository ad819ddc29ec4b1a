"""Hugging Face transformers' Trainer through the mount.

A 2-layer GPT-2 built from a config (nothing downloaded, the hub is off),
trained on a small in-memory dataset with ``save_steps`` and
``save_total_limit=2``; a new Trainer on a new mount resumes with
``resume_from_checkpoint=True``: the global step goes on from the last
checkpoint, and the weights and optimizer state it starts from are exactly the
saved ones. A third mount loads every remaining checkpoint again with
``from_pretrained`` and torch.load. Once as root and once as an ordinary user
(the daemon is root's either way).
"""

from __future__ import annotations

import os

from frameworks_util import FRAMEWORK_ENV

for _k, _v in FRAMEWORK_ENV.items():  # before transformers / huggingface_hub are imported
    if _k != "OMP_NUM_THREADS":
        os.environ[_k] = _v

import json  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from clusters import PEER_LOGS, cluster  # noqa: E402
from frameworks_util import (  # noqa: E402
    ORDINARY,
    acting_as,
    assert_backing_durable,
    assert_owned,
    backing_manifests,
    clone_tree,
    job_dir,
    umount_checked,
)
from safetensors.torch import load_file  # noqa: E402
from tensors import assert_same  # noqa: E402
from torch.utils.data import Dataset  # noqa: E402
from transformers import (  # noqa: E402
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)
from waits import wait_for  # noqa: E402

SEQ, BATCH, SAVE_STEPS = 8, 4, 2


class Tokens(Dataset):
    """24 fixed random sequences; labels are the inputs (causal LM)."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, 61, (24, SEQ), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class Record(TrainerCallback):
    """What each checkpoint held, and the state training (re)started from."""

    def __init__(self) -> None:
        self.saved: dict[int, dict] = {}
        self.began: dict | None = None
        self.steps: list[int] = []

    def _state(self, state, model, optimizer, lr_scheduler) -> dict:
        return clone_tree(
            {
                "global_step": state.global_step,
                "model": model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "scheduler": lr_scheduler.state_dict(),
            }
        )

    def on_train_begin(self, args, state, control, **kw):
        self.began = self._state(state, kw["model"], kw["optimizer"], kw["lr_scheduler"])

    def on_step_end(self, args, state, control, **kw):
        self.steps.append(state.global_step)

    def on_save(self, args, state, control, **kw):
        self.saved[state.global_step] = self._state(
            state, kw["model"], kw["optimizer"], kw["lr_scheduler"]
        )


def model_config() -> GPT2Config:
    return GPT2Config(
        vocab_size=61,
        n_positions=SEQ,
        n_embd=16,
        n_layer=2,
        n_head=2,
        n_inner=32,
        bos_token_id=0,
        eos_token_id=0,
    )


def train(output_dir, max_steps: int, seed: int, resume: bool) -> Record:
    torch.manual_seed(seed)  # a different initialisation each time
    record = Record()
    args = TrainingArguments(
        output_dir=str(output_dir),
        max_steps=max_steps,
        save_strategy="steps",
        save_steps=SAVE_STEPS,
        save_total_limit=2,
        per_device_train_batch_size=BATCH,
        learning_rate=1e-3,
        logging_strategy="no",
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=0,
    )
    trainer = Trainer(
        model=GPT2LMHeadModel(model_config()),
        args=args,
        train_dataset=Tokens(),
        callbacks=[record],
    )
    trainer.train(resume_from_checkpoint=True if resume else None)
    return record


def checkpoints(out) -> list[str]:
    return sorted(p.name for p in out.iterdir() if p.name.startswith("checkpoint-"))


def check_checkpoint(ckpt, saved: dict) -> None:
    """Every file of one checkpoint directory holds what was saved."""
    state = json.loads((ckpt / "trainer_state.json").read_text())
    assert state["global_step"] == saved["global_step"]
    model = GPT2LMHeadModel.from_pretrained(ckpt)  # a local directory, offline
    assert_same(saved["model"], model.state_dict(), f"{ckpt.name} from_pretrained")
    on_disk = load_file(ckpt / "model.safetensors")  # tied lm_head.weight is stored once
    assert_same({k: saved["model"][k] for k in on_disk}, on_disk, f"{ckpt.name} safetensors")
    optimizer = torch.load(ckpt / "optimizer.pt", weights_only=True)
    assert_same(saved["optimizer"], optimizer, f"{ckpt.name} optimizer.pt")
    scheduler = torch.load(ckpt / "scheduler.pt", weights_only=True)
    assert_same(saved["scheduler"], scheduler, f"{ckpt.name} scheduler.pt")
    torch.load(ckpt / "rng_state.pth", weights_only=False)


@pytest.mark.parametrize("user", [None, ORDINARY], ids=["root", "user"])
def test_hf_trainer_save_total_limit_and_resume(shared_mounts, user):
    mounts = shared_mounts  # under a directory every user may traverse
    a = mounts("a")
    a.mount()
    out = job_dir(a.mnt / "hf", user)
    with acting_as(user):
        first = train(out, max_steps=6, seed=0, resume=False)
        assert sorted(first.saved) == [2, 4, 6]
        assert checkpoints(out) == ["checkpoint-4", "checkpoint-6"]  # checkpoint-2 rotated out
        files = sorted(p.name for p in (out / "checkpoint-6").iterdir())
    for f in ("model.safetensors", "optimizer.pt", "scheduler.pt", "trainer_state.json"):
        assert f in files, files
    expect = [f"hf/checkpoint-{s}/{f}" for s in (4, 6) for f in files]
    assert_owned(a.mnt, expect, user)
    umount_checked(a, expect)

    b = mounts("b")
    b.mount()
    out = b.mnt / "hf"
    with acting_as(user):
        second = train(out, max_steps=10, seed=1, resume=True)
    resumed = first.saved[6]
    assert second.began["global_step"] == 6
    assert second.steps[0] == 7 and second.steps[-1] == 10
    for part in ("model", "optimizer", "scheduler"):
        assert_same(resumed[part], second.began[part], f"resumed {part}")
    assert sorted(second.saved) == [8, 10]
    saved = {**first.saved, **second.saved}
    with acting_as(user):
        assert checkpoints(out) == ["checkpoint-10", "checkpoint-8"]
        for s in (8, 10):
            check_checkpoint(out / f"checkpoint-{s}", saved[s])
    expect = [f"hf/checkpoint-{s}/{f}" for s in (8, 10) for f in files]
    assert_owned(b.mnt, expect, user)
    umount_checked(b, expect)

    c = mounts("c")
    c.mount()
    out = c.mnt / "hf"
    with acting_as(user):
        assert checkpoints(out) == ["checkpoint-10", "checkpoint-8"]
        for s in (8, 10):
            check_checkpoint(out / f"checkpoint-{s}", saved[s])
    umount_checked(c, expect)


@pytest.mark.parametrize("user", [None, ORDINARY], ids=["root", "user"])
def test_hf_trainer_resumes_after_its_daemon_died_before_the_checkpoints_were_durable(
    shared_mounts, user
):
    """The node's daemon is killed while the Trainer's checkpoints are only in
    its RAM cache (the flusher slowed to a crawl): the remount on that node
    (the same cache directory) recovers them from the cache's journal, still
    the user's, the checkpoint the rotation deleted stays deleted, the job
    resumes from the last one (and rotates out a recovered one), and
    everything ends durable."""
    a = shared_mounts("a")
    a.mount(env={"CKPTFS_FLUSH_BANDWIDTH": "16KiB"})
    out = job_dir(a.mnt / "hf", user)
    with acting_as(user):
        first = train(out, max_steps=6, seed=0, resume=False)
        assert checkpoints(out) == ["checkpoint-4", "checkpoint-6"]
        files = sorted(p.name for p in (out / "checkpoint-6").iterdir())
    pending = [p for p, b in backing_manifests(a.backing).items() if b["state"] != "durable"]
    assert any(p.startswith("hf/checkpoint-6/") for p in pending), pending  # else nothing to test
    a.kill()

    a.mount()
    a.allowed_log = ["recovered"]
    assert_owned(a.mnt, [f"hf/checkpoint-{s}/{f}" for s in (4, 6) for f in files], user)
    with acting_as(user):
        assert checkpoints(out) == ["checkpoint-4", "checkpoint-6"]  # checkpoint-2 not back
        for s in (4, 6):
            assert sorted(p.name for p in (out / f"checkpoint-{s}").iterdir()) == files
            check_checkpoint(out / f"checkpoint-{s}", first.saved[s])
        second = train(out, max_steps=8, seed=1, resume=True)
        assert checkpoints(out) == ["checkpoint-6", "checkpoint-8"]
    assert second.began["global_step"] == 6 and second.steps == [7, 8]
    for part in ("model", "optimizer", "scheduler"):
        assert_same(first.saved[6][part], second.began[part], f"resumed {part}")
    umount_checked(a, [f"hf/checkpoint-{s}/{f}" for s in (6, 8) for f in files])


def test_hf_trainer_resumes_on_another_node_after_its_node_died(mounts, tmp_path):
    """Three nodes in a buddy ring (n2 mirrors n1). The Trainer saves on n1,
    nothing durable yet (the flusher slowed); n1 dies and n2 takes its
    checkpoints over. The job resumes on n3, and its rotation deletes the
    checkpoints n2 is still flushing. At the end only the new checkpoints
    are left, durable, and a cold mount loads them."""
    slow = {"CKPTFS_FLUSH_BANDWIDTH": "64KiB"}
    nodes = cluster(mounts, tmp_path, ["n1", "n2", "n3"], {n: slow for n in ("n1", "n2")})
    n1, n2, n3 = nodes["n1"], nodes["n2"], nodes["n3"]
    for m in nodes.values():
        m.allowed_log += PEER_LOGS + ["is dead", "taking over", "is not mirrored", "no longer"]
    first = train(n1.mnt / "hf", max_steps=6, seed=0, resume=False)
    files = sorted(p.name for p in (n1.mnt / "hf" / "checkpoint-6").iterdir())
    pending = [p for p, b in backing_manifests(n1.backing).items() if b["state"] != "durable"]
    assert any(p.startswith("hf/checkpoint-6/") for p in pending), pending
    n1.kill()
    wait_for(lambda: "taking over hf/checkpoint-6" in n2.log(), 30, "n2 takes n1's files over")

    out = n3.mnt / "hf"
    assert checkpoints(out) == ["checkpoint-4", "checkpoint-6"]
    check_checkpoint(out / "checkpoint-6", first.saved[6])
    second = train(out, max_steps=10, seed=1, resume=True)
    assert second.began["global_step"] == 6 and second.steps[-1] == 10
    for part in ("model", "optimizer", "scheduler"):
        assert_same(first.saved[6][part], second.began[part], f"resumed {part}")
    assert checkpoints(out) == ["checkpoint-10", "checkpoint-8"]
    expect = [f"hf/checkpoint-{s}/{f}" for s in (8, 10) for f in files]
    n2.umount()
    n3.umount()
    manifests = assert_backing_durable(n3, expect)
    assert sorted(p for p in manifests if p.startswith("hf/")) == sorted(expect)

    c = mounts("c")
    c.mount()
    for s in (8, 10):
        check_checkpoint(c.mnt / "hf" / f"checkpoint-{s}", second.saved[s])
    umount_checked(c, expect)
