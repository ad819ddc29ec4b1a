"""Train a small GPT-like transformer on synthetic data, checkpointing with torch.save.

A plain PyTorch training script, the kind that writes checkpoints into a directory
on shared storage:

    python train.py --ckpt-dir /ckpt/run1 --steps 20 --save-every 5 --size-mb 64

Every --save-every steps (and after the last step) it saves model, optimizer and
step to ``<ckpt-dir>/checkpoint-<step>/model.pt``. At the end it loads the latest
checkpoint back, plainly and with ``mmap=True``, and exits non-zero unless both
equal the in-memory state.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

VOCAB = 256
SEQ_LEN = 64
N_LAYER = 4
# Adam keeps two moments per parameter besides the fp32 weight itself.
BYTES_PER_PARAM = 4 * 3


@dataclass
class GPTConfig:
    vocab: int
    n_layer: int
    n_head: int
    d_model: int
    seq_len: int


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.d_model, 4 * cfg.d_model),
            nn.GELU(),
            nn.Linear(4 * cfg.d_model, cfg.d_model),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def config_for_size(size_mb: float) -> GPTConfig:
    """Pick a width so that weights plus Adam state come to about ``size_mb`` MB."""
    params = size_mb * 1e6 / BYTES_PER_PARAM
    # Per layer about 12*d^2 (attention 4*d^2, MLP 8*d^2); the embeddings and
    # head add about 2*vocab*d. Solve 12*L*d^2 + 2*V*d = params for d.
    a, b = 12 * N_LAYER, 2 * VOCAB
    d = (-b + math.sqrt(b * b + 4 * a * params)) / (2 * a)
    head_dim = 32
    d_model = max(head_dim, round(d / head_dim) * head_dim)
    return GPTConfig(VOCAB, N_LAYER, d_model // head_dim, d_model, SEQ_LEN)


def synthetic_batch(batch: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequences that follow a fixed rule (next = 5*prev + 3 mod V), so loss can fall."""
    start = torch.randint(0, VOCAB, (batch, 1), generator=gen)
    seq = [start]
    for _ in range(SEQ_LEN):
        seq.append((seq[-1] * 5 + 3) % VOCAB)
    tokens = torch.cat(seq, dim=1)
    return tokens[:, :-1], tokens[:, 1:]


def save_checkpoint(
    ckpt_dir: str, step: int, model: nn.Module, optimizer: torch.optim.Optimizer
) -> str:
    path = f"{ckpt_dir}/checkpoint-{step}/model.pt"
    os.makedirs(os.path.dirname(path), exist_ok=True)
    start = time.perf_counter()
    torch.save(
        {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}, path
    )
    seconds = time.perf_counter() - start
    size = os.path.getsize(path)
    print(
        f"step {step}: saved {path} ({size / 1e6:.1f} MB) in {seconds:.3f} s "
        f"({size / 1e9 / seconds:.2f} GB/s)",
        flush=True,
    )
    return path


def differences(expected: Any, actual: Any, where: str = "checkpoint") -> list[str]:
    """Where two (nested) state dicts differ; empty if they are equal."""
    if isinstance(expected, torch.Tensor):
        if not isinstance(actual, torch.Tensor):
            return [f"{where}: expected a tensor, got {type(actual).__name__}"]
        same = expected.dtype == actual.dtype and expected.shape == actual.shape
        return [] if same and torch.equal(expected, actual) else [f"{where}: tensor differs"]
    if isinstance(expected, dict):
        if not isinstance(actual, dict) or expected.keys() != actual.keys():
            return [f"{where}: keys differ"]
        return [d for k in expected for d in differences(expected[k], actual[k], f"{where}.{k}")]
    if isinstance(expected, list | tuple):
        if not isinstance(actual, list | tuple) or len(expected) != len(actual):
            return [f"{where}: length differs"]
        pairs = enumerate(zip(expected, actual, strict=True))
        return [d for i, (e, a) in pairs for d in differences(e, a, f"{where}[{i}]")]
    return [] if expected == actual else [f"{where}: {expected!r} != {actual!r}"]


def latest_checkpoint(ckpt_dir: str) -> str | None:
    """The model.pt of the highest-numbered checkpoint-<step> directory, as a restart finds it."""
    steps = []
    for name in os.listdir(ckpt_dir):
        prefix, _, number = name.partition("-")
        if prefix == "checkpoint" and number.isdigit():
            steps.append(int(number))
    return f"{ckpt_dir}/checkpoint-{max(steps)}/model.pt" if steps else None


def verify(path: str, state: dict[str, Any]) -> bool:
    ok = True
    for mmap in (False, True):
        start = time.perf_counter()
        loaded = torch.load(path, mmap=mmap)
        problems = differences(state, loaded)
        seconds = time.perf_counter() - start
        how = "torch.load(mmap=True)" if mmap else "torch.load"
        if problems:
            ok = False
            print(f"FAIL: {how} of {path} differs from memory:", *problems[:10], sep="\n  ")
        else:
            print(f"{how} of {path}: equals the in-memory state ({seconds:.3f} s)")
    return ok


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ckpt-dir", required=True, help="directory to write checkpoints into")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--save-every", type=int, default=5)
    p.add_argument("--size-mb", type=float, default=64, help="approximate checkpoint size")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.steps < 1 or args.save_every < 1 or args.size_mb <= 0:
        p.error("--steps and --save-every must be >= 1 and --size-mb > 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    cfg = config_for_size(args.size_mb)
    model = GPT(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {cfg}, {n_params / 1e6:.1f}M parameters")

    last_path = ""
    for step in range(1, args.steps + 1):
        x, y = synthetic_batch(args.batch_size, gen)
        loss = F.cross_entropy(model(x).reshape(-1, cfg.vocab), y.reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        print(f"step {step}: loss {loss.item():.4f}", flush=True)
        if step % args.save_every == 0 or step == args.steps:
            last_path = save_checkpoint(args.ckpt_dir, step, model, optimizer)

    latest = latest_checkpoint(args.ckpt_dir)
    if latest != last_path:
        print(f"FAIL: the latest checkpoint in {args.ckpt_dir} is {latest}, not {last_path}")
        return 1
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": args.steps}
    return 0 if verify(latest, state) else 1


if __name__ == "__main__":
    sys.exit(main())
