"""Shared code of the framework tests (tests/frameworks/).

Two roles:

* imported by the tests: the durability check of the backing directory after
  every unmount, exact comparison of nested state dicts, and running worker
  processes with a hard timeout;
* run as a script, it is the worker those tests start: the ranks of a
  ``torch.distributed.checkpoint`` job (under ``torch.distributed.run``), the
  ranks of a Megatron-style save and restart, and concurrent ``torch.load``
  readers::

      python -m torch.distributed.run --standalone --nproc-per-node 2 \\
          tests/support/frameworks_util.py dcp-save CKPT_ROOT REF_DIR

Nothing here imports ckptfs: the backing directory is read as the documented
format (docs/FORMAT.md), so these tests do not depend on the internals.
"""

from __future__ import annotations

import argparse
import codecs
import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from tensors import assert_same

WORKER = str(Path(__file__).resolve())
MAGIC = b"CKPTFS-MANIFEST 1\n"

# Every framework test runs offline and single-threaded per process (2 cores,
# several processes at once).
FRAMEWORK_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "OMP_NUM_THREADS": "1",
}


# ----- an ordinary user ---------------------------------------------------------------
# Training jobs rarely run as root: each framework test runs once as root and
# once as nobody:nogroup, the daemon being root's either way (systemd,
# DaemonSet, Slurm prolog).
ORDINARY = (65534, 65534)
AS_USER_ENV = "CKPTFS_TEST_AS"  # uid:gid a worker runs its job as


# Codecs pickles name (protocol 2 bytes are latin-1 strings; a pickle from
# Python 2 may name others): torch.load as the user would look them up,
# and importing one as the user fails when the interpreter lives under
# /root ("LookupError: unknown encoding: latin1").
UNPICKLE_CODECS = ("latin1", "ascii", "utf-8")


@contextmanager
def acting_as(user: tuple[int, int] | None) -> Iterator[None]:
    """The body's file accesses as ``user`` (None: as root), in this process.

    The effective ids (every thread's, and so the uid and gid of the FUSE
    requests) and no supplementary groups; with a non-zero effective uid the
    kernel also drops root's capabilities, so permission checks are the
    user's. Everything the body imports must be imported already: the
    interpreter may live under /root, which the user cannot read.
    """
    if user is None:
        yield
        return
    for codec in UNPICKLE_CODECS:
        codecs.lookup(codec)  # imported on first use: an unpickler's, as the user
    groups = os.getgroups()
    os.setgroups([])
    os.setegid(user[1])
    os.seteuid(user[0])
    try:
        yield
    finally:
        os.seteuid(0)
        os.setegid(0)
        os.setgroups(groups)


def job_dir(path: Path, user: tuple[int, int] | None) -> Path:
    """``path``, made by root and given to ``user``: the directory a job saves
    into, as an administrator prepares it (the mount's root is root's)."""
    path.mkdir()
    if user is not None:
        os.chown(path, *user)
    return path


@contextmanager
def scratch_dir(user: tuple[int, int] | None) -> Iterator[Path]:
    """A directory outside any mount that ``user`` can write: pytest's
    tmp_path is root's alone (its parent is mode 700)."""
    d = Path(tempfile.mkdtemp(prefix="ckptfs-frameworks-"))
    try:
        if user is not None:
            os.chown(d, *user)
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def assert_owned(root: Path, paths: Iterable[str], user: tuple[int, int] | None) -> None:
    """The files at ``paths`` under the mount ``root`` are the job's user's
    (root's for None): the framework's writes reached ckptfs as that user."""
    uid, gid = user or (0, 0)
    owners = {p: (st.st_uid, st.st_gid) for p in paths for st in [(root / p).stat()]}
    assert owners and all(o == (uid, gid) for o in owners.values()), owners


def _become(spec: str) -> None:
    """For a worker: import what its job imports later while root can read
    it, then become ``uid:gid`` for good."""
    import concurrent.futures  # noqa: F401 - dcp.async_save's executor

    import torch._dynamo  # noqa: F401 - fully_shard's, with stdlib modules of its own
    import torch.distributed.checkpoint  # noqa: F401
    import torch.distributed.checkpoint.state_dict  # noqa: F401
    import torch.distributed.device_mesh  # noqa: F401
    import torch.distributed.fsdp  # noqa: F401

    uid, gid = (int(x) for x in spec.split(":"))
    os.setgroups([])
    os.setgid(gid)
    os.setuid(uid)


def user_env(user: tuple[int, int] | None) -> dict[str, str]:
    """The environment that makes a worker run its job as ``user``."""
    return {} if user is None else {AS_USER_ENV: f"{user[0]}:{user[1]}"}


# ----- the backing directory ------------------------------------------------------
def _is_ckptfs_tmp(name: str) -> bool:
    return name.startswith(".") and ".ckptfs-tmp." in name


def backing_manifests(backing: Path) -> dict[str, dict[str, Any]]:
    """Every manifest in the backing directory, by path relative to it.

    The top-level ``.ckptfs`` directory (chunks, history) and manifests being
    written (``.NAME.ckptfs-tmp.*``) are not part of the namespace; symlinks
    are names, not files.
    """
    found: dict[str, dict[str, Any]] = {}
    for root, dirs, files in os.walk(backing):
        if Path(root) == backing and ".ckptfs" in dirs:
            dirs.remove(".ckptfs")
        for name in files:
            path = Path(root) / name
            if _is_ckptfs_tmp(name) or path.is_symlink():
                continue
            data = path.read_bytes()
            if not data.startswith(MAGIC):
                continue  # a plain file
            found[str(path.relative_to(backing))] = last_record(path, data[len(MAGIC) :])
    return found


def last_record(path: Path, records: bytes) -> dict[str, Any]:
    """The record in force of a manifest (docs/FORMAT.md): the last whole
    JSON line; a record cut short by a crash is skipped."""
    for line in reversed(records.splitlines()):
        try:
            return dict(json.loads(line))
        except ValueError:
            continue
    raise AssertionError(f"{path}: a manifest with no whole record")


def describe_manifest(body: dict[str, Any]) -> str:
    return (
        f"state={body.get('state')!r} chunks={len(body.get('chunks', []))} "
        f"size={body.get('size')} version={body.get('version')} "
        f"chunking={body.get('chunking')!r} holders={body.get('holders')}"
    )


def assert_backing_durable(m: Any, expect: Iterable[str] = ()) -> dict[str, dict[str, Any]]:
    """After an unmount: every manifest is durable and ``ckptfs check`` passes.

    ``expect``: paths (relative to the backing directory) that must be
    manifests, i.e. files the framework wrote through the mount.
    """
    manifests = backing_manifests(m.backing)
    missing = sorted(p for p in expect if p not in manifests)
    not_durable = {p: describe_manifest(b) for p, b in manifests.items() if b["state"] != "durable"}
    problems = [f"not a manifest in the backing directory: {p}" for p in missing]
    problems += [f"not durable after umount: {p}: {d}" for p, d in sorted(not_durable.items())]
    assert not problems, f"backing directory {m.backing}:\n" + "\n".join(problems)
    check = m.cli("check", str(m.backing), check=False, timeout=300)
    assert check.returncode == 0, f"ckptfs check failed:\n{check.stdout}{check.stderr}"
    return manifests


def umount_checked(m: Any, expect: Iterable[str] = ()) -> dict[str, dict[str, Any]]:
    """Unmount (flushes everything), then check the backing directory."""
    m.umount()
    return assert_backing_durable(m, expect)


def files_under(root: Path) -> list[str]:
    """Names of the regular files and symlinks under ``root``, relative, sorted."""
    out = []
    for dirpath, _dirs, files in os.walk(root):
        out += [str((Path(dirpath) / f).relative_to(root)) for f in files]
    return sorted(out)


def clone_tree(obj: Any) -> Any:
    """A deep copy whose tensors own their memory (detached CPU clones)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: clone_tree(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(clone_tree(v) for v in obj)
    return obj


# ----- processes ----------------------------------------------------------------------
def subprocess_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    return {**os.environ, **FRAMEWORK_ENV, **(extra or {})}


def run(cmd: list[str], *, timeout: float, env: dict[str, str] | None = None) -> str:
    """Run ``cmd`` in its own process group; the whole group is killed on timeout."""
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=subprocess_env(env),
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        out, _ = proc.communicate()
        raise AssertionError(
            f"timed out after {timeout}s: {' '.join(cmd)}\n{out[-6000:]}"
        ) from None
    assert proc.returncode == 0, f"exit {proc.returncode}: {' '.join(cmd)}\n{out[-6000:]}"
    return out


def kill_group(proc: subprocess.Popen[Any]) -> None:
    """SIGKILL the process group of a child started with start_new_session=True."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def torchrun(
    nproc: int, *args: str, user: tuple[int, int] | None = None, timeout: float = 180
) -> str:
    """The worker's ranks under torch.distributed.run (root's), each rank as ``user``."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += [f"--nproc-per-node={nproc}", WORKER, *args]
    return run(cmd, timeout=timeout, env=user_env(user))


def ranks(nproc: int, *args: str, user: tuple[int, int] | None = None, timeout: float = 180) -> str:
    """The worker's ranks started as a cluster's own launcher starts them
    (Slurm's ``srun``, an MPI launcher): one process per rank, told its rank,
    the world size and the rendezvous address in the environment, which is
    all torch.distributed reads from torchrun too. Without torchrun's agent,
    whose own import of torch costs 2-4 s here before any rank starts; the
    tests whose subject is the launcher-independent checkpoint code use it,
    and torchrun keeps its own tests. Their output, rank by rank."""
    from conftest import free_port  # the test process's (this file is also the worker)

    rendezvous = {
        "WORLD_SIZE": str(nproc),
        "LOCAL_WORLD_SIZE": str(nproc),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
    }
    cmd = [sys.executable, WORKER, *args]
    with tempfile.TemporaryDirectory(prefix="ckptfs-ranks-") as tmp:
        outs = [Path(tmp) / f"rank{r}.out" for r in range(nproc)]
        procs = []
        try:
            for r, out in enumerate(outs):
                env = {**user_env(user), **rendezvous, "RANK": str(r), "LOCAL_RANK": str(r)}
                with open(out, "w") as sink:
                    procs.append(
                        subprocess.Popen(
                            cmd,
                            stdout=sink,
                            stderr=subprocess.STDOUT,
                            env=subprocess_env(env),
                            start_new_session=True,
                        )
                    )
            failed = _wait_all(procs, timeout)
        finally:
            for proc in procs:  # a rank left waiting for one that failed
                if proc.poll() is None:
                    kill_group(proc)
                    proc.wait()
        text = "".join(out.read_text(errors="replace") for out in outs)
    if failed:
        raise AssertionError(f"{failed}: {' '.join(cmd)} ({nproc} ranks)\n{text[-6000:]}")
    return text


def _wait_all(procs: list[subprocess.Popen[Any]], timeout: float) -> str:
    """Wait for every process; what went wrong ("" if they all exited 0): the
    first rank to fail, or the timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        codes = [proc.poll() for proc in procs]
        bad = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
        if bad:
            return f"rank {bad[0][0]} exited {bad[0][1]}"
        if all(c == 0 for c in codes):
            return ""
        time.sleep(0.05)
    return f"timed out after {timeout}s"


def worker(*args: str, user: tuple[int, int] | None = None, timeout: float = 180) -> str:
    """The worker as one plain process (world size 1, no launcher), as ``user``."""
    return run([sys.executable, WORKER, *args], timeout=timeout, env=user_env(user))


# ----- torch.distributed.checkpoint + FSDP2 -------------------------------------------
def _init_dist(tmp: Path | None = None) -> None:
    import torch.distributed as dist

    if "RANK" in os.environ:  # under torch.distributed.run
        dist.init_process_group("gloo")
    else:  # one plain process
        assert tmp is not None
        store = (tmp / f"store-{os.getpid()}").resolve()
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)


def _dcp_model(seed: int) -> Any:
    """A small model whose dimensions do not divide evenly by 2 ranks."""
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Embedding(37, 12),
        nn.Linear(12, 33),
        nn.GELU(),
        nn.LayerNorm(33),
        nn.Linear(33, 7),
    )
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model:
        if any(True for _ in layer.parameters()):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    return model, opt


def _dcp_train_step(model: Any, opt: Any, step: int) -> None:
    import torch.distributed as dist

    g = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    x = torch.randint(0, 37, (5,), generator=g)
    model(x).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def _dcp_full_state(model: Any, opt: Any) -> dict[str, Any]:
    """The full (unsharded) model and optimizer state, on every rank."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    return clone_tree({"model": msd, "optim": osd})


def rank_root(spec: str) -> Path:
    """The checkpoint directory of this rank: ``spec`` itself, or with
    several comma-separated ones (a mount per node), the rank's: rank r
    saves or loads through node r's mount."""
    roots = spec.split(",")
    return Path(roots[int(os.environ.get("RANK", "0")) % len(roots)])


def dcp_save(ckpt_root: Path, ref: Path, seed: int = 0) -> None:
    """``dcp.save`` into ckpt_root/sync and ``dcp.async_save`` into ckpt_root/async.

    Rank 0 also writes the full state of each (outside the mount) for the loads
    to compare against.
    """
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    _init_dist()
    rank = dist.get_rank()
    model, opt = _dcp_model(seed=seed)
    for step in range(2):
        _dcp_train_step(model, opt, step)

    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(ckpt_root / "sync"))
    full = _dcp_full_state(model, opt)
    if rank == 0:
        torch.save(full, ref / "sync.pt")

    _dcp_train_step(model, opt, 2)
    full = _dcp_full_state(model, opt)
    if rank == 0:
        torch.save(full, ref / "async.pt")
    msd, osd = get_state_dict(model, opt)
    # async_save runs its collectives in a background thread: with gloo they
    # need their own process group, or they collide with training's.
    ckpt_group = dist.new_group(backend="gloo")
    future = dcp.async_save(
        {"model": msd, "optim": osd},
        checkpoint_id=str(ckpt_root / "async"),
        process_group=ckpt_group,
    )
    # Training goes on while the checkpoint is written: the state was staged
    # when async_save was called, so the files hold the state of that moment.
    _dcp_train_step(model, opt, 3)
    _dcp_train_step(model, opt, 4)
    future.result(timeout=120)
    dist.barrier()
    print(f"dcp-save ok rank {rank}", flush=True)
    dist.destroy_process_group()


def dcp_load(ckpt_root: Path, ref: Path, tmp: Path) -> None:
    """Load ckpt_root/{sync,async} into a freshly initialised sharded model and compare."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    _init_dist(tmp)
    rank, world = dist.get_rank(), dist.get_world_size()
    for name in ("sync", "async"):
        model, opt = _dcp_model(seed=1000)  # other initial weights than the saved ones
        expected = torch.load(ref / f"{name}.pt", weights_only=True)
        assert not torch.equal(
            _dcp_full_state(model, opt)["model"]["1.weight"], expected["model"]["1.weight"]
        )
        msd, osd = get_state_dict(model, opt)  # sharded, optimizer state initialised
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=str(ckpt_root / name))
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        assert_same(expected, _dcp_full_state(model, opt), f"{name} (rank {rank}/{world})")
        _dcp_train_step(model, opt, 10)  # and it trains on
    dist.barrier()
    print(f"dcp-load ok rank {rank} world {world}", flush=True)
    dist.destroy_process_group()


# ----- Megatron-style per-rank files --------------------------------------------------
MEGATRON_ITERATION = 10
MEGATRON_TRACKER = "latest_checkpointed_iteration.txt"


def megatron_full(seed: int = 7) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embedding.word_embeddings.weight": torch.randn(64, 16, generator=g),
        "decoder.layers.0.mlp.linear_fc1.weight": torch.randn(48, 16, generator=g),
        "decoder.layers.0.mlp.linear_fc1.bias": torch.randn(48, generator=g),
        "decoder.layers.0.self_attention.linear_qkv.weight": torch.randn(96, 16, generator=g).to(
            torch.bfloat16
        ),
    }


def megatron_shard(rank: int, world: int) -> dict[str, Any]:
    """What tensor-parallel rank ``rank`` of ``world`` saves (Megatron's layout)."""
    model = {k: v.chunk(world, dim=0)[rank].clone() for k, v in megatron_full().items()}
    g = torch.Generator().manual_seed(100 + rank)
    return {
        "args": argparse.Namespace(tensor_model_parallel_size=world, seed=1234),
        "checkpoint_version": 3.0,
        "iteration": MEGATRON_ITERATION,
        "model": model,
        "optimizer": {
            "state": {
                i: {
                    "exp_avg": torch.randn(v.shape, generator=g),
                    "exp_avg_sq": torch.rand(v.shape, generator=g),
                }
                for i, v in enumerate(model.values())
            },
            "param_groups": [{"lr": 3e-4, "params": list(range(len(model)))}],
        },
        "rng_state": [{"torch_rng_state": torch.Generator().manual_seed(rank).get_state()}],
    }


def megatron_save(root: Path) -> None:
    """Every rank writes its shard; after a barrier rank 0 writes the tracker."""
    import torch.distributed as dist

    _init_dist()
    rank, world = dist.get_rank(), dist.get_world_size()
    it_dir = root / f"iter_{MEGATRON_ITERATION:07d}" / f"mp_rank_{rank:02d}"
    os.makedirs(it_dir, exist_ok=True)  # all ranks race on iter_0000010/
    torch.save(megatron_shard(rank, world), it_dir / "model_optim_rng.pt")
    dist.barrier()
    if rank == 0:
        with open(root / MEGATRON_TRACKER, "w") as f:
            f.write(str(MEGATRON_ITERATION))
    dist.barrier()
    print(f"megatron-save ok rank {rank}", flush=True)
    dist.destroy_process_group()


def megatron_load(root: Path, old_world: int) -> None:
    """Restart with another world size: read the tracker, load and merge the shards."""
    import torch.distributed as dist

    _init_dist()
    rank, world = dist.get_rank(), dist.get_world_size()
    with open(root / MEGATRON_TRACKER) as f:
        iteration = int(f.read().strip())
    assert iteration == MEGATRON_ITERATION
    it_dir = root / f"iter_{iteration:07d}"
    shards = sorted(p.name for p in it_dir.iterdir())
    assert shards == [f"mp_rank_{r:02d}" for r in range(old_world)], shards
    per_rank = old_world // world
    mine = range(rank * per_rank, (rank + 1) * per_rank)
    loaded = []
    for r in mine:
        sd = torch.load(it_dir / f"mp_rank_{r:02d}" / "model_optim_rng.pt", weights_only=False)
        assert_same(megatron_shard(r, old_world), sd, f"mp_rank_{r:02d}")
        loaded.append(sd["model"])
    # Merged to this rank's tensor-parallel slice of the new world size.
    for k, full in megatron_full().items():
        merged = torch.cat([sd[k] for sd in loaded], dim=0)
        assert torch.equal(merged, full.chunk(world, dim=0)[rank]), k
    dist.barrier()
    print(f"megatron-load ok rank {rank} shards {list(mine)}", flush=True)
    dist.destroy_process_group()


# ----- torch.save + os.replace while others torch.load ------------------------------
REPLACE_FIRST = 1000  # versions 1000..9999 pickle to the same number of bytes


def replace_version(v: int) -> dict[str, Any]:
    """Version ``v`` of the file. Every version has the same byte layout, and
    says which it is twice: in the pickle (an int) and in its tensor bytes."""
    g = torch.Generator().manual_seed(v)
    return {
        "version": v,
        "marker": torch.full((8,), v, dtype=torch.int64),
        "w": torch.randn(256, 512, generator=g),
    }


def classify_load(sd: dict[str, Any], cache: dict[int, torch.Tensor]) -> str:
    """``exact``: one whole version. ``torn``: the tensor bytes are one whole
    version but the pickle is another's (what a replace between torch.load's
    open and its mmap re-open gives). ``bad``: anything else."""
    marker = sd["marker"]
    v = int(marker[0])
    if not (REPLACE_FIRST <= v < 10000) or not torch.equal(marker, torch.full((8,), v)):
        return "bad"
    if v not in cache:
        cache[v] = replace_version(v)["w"]
    if not torch.equal(sd["w"], cache[v]):
        return "bad"
    return "exact" if sd["version"] == v else "torn"


def reader(path: Path, mode: str, out: Path, ready: Path, stop: Path, limit: float) -> None:
    """torch.load ``path`` in a loop until ``stop`` exists (or ``limit`` seconds)."""
    counts = {"exact": 0, "torn": 0, "bad": 0, "error": 0, "estale": 0}
    samples: list[str] = []
    seen: set[int] = set()
    cache: dict[int, torch.Tensor] = {}
    ready.touch()
    deadline = time.monotonic() + limit
    while not stop.exists() and time.monotonic() < deadline:
        try:
            sd = torch.load(path, mmap=(mode == "mmap"), weights_only=True)
            kind = classify_load(sd, cache)
            seen.add(int(sd["marker"][0]))
            del sd
        except Exception as exc:  # counted and reported, not hidden
            # ESTALE, as on NFS (README, Limits), only across nodes: an open
            # of a name replaced again before the kernel's one retry, a read
            # of a version replaced before it was durable. Counted apart.
            stale = getattr(exc, "errno", None) == errno.ESTALE or (
                isinstance(exc, RuntimeError) and "Stale file handle (116)" in str(exc)
            )
            kind = "estale" if stale else "error"
            if len(samples) < 5:
                samples.append(f"{type(exc).__name__}: {exc}"[:300])
        counts[kind] += 1
    out.write_text(json.dumps({"mode": mode, **counts, "versions": len(seen), "samples": samples}))


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="frameworks_util")
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("dcp-save")
    s.add_argument("ckpt", type=rank_root)
    s.add_argument("ref", type=Path)
    s.add_argument("--seed", type=int, default=0, help="the model's initial weights")
    s = sub.add_parser("dcp-load")
    s.add_argument("ckpt", type=rank_root)
    s.add_argument("ref", type=Path)
    s = sub.add_parser("megatron-save")
    s.add_argument("root", type=Path)
    s = sub.add_parser("megatron-load")
    s.add_argument("root", type=Path)
    s.add_argument("old_world", type=int)
    s = sub.add_parser("reader")
    s.add_argument("path", type=Path)
    s.add_argument("mode", choices=["plain", "mmap"])
    s.add_argument("out", type=Path)
    s.add_argument("ready", type=Path)
    s.add_argument("stop", type=Path)
    s.add_argument("--limit", type=float, default=120)
    a = p.parse_args(argv)
    if os.environ.get(AS_USER_ENV):
        _become(os.environ[AS_USER_ENV])
    if a.cmd == "dcp-save":
        dcp_save(a.ckpt, a.ref, a.seed)
    elif a.cmd == "dcp-load":
        dcp_load(a.ckpt, a.ref, a.ref)
    elif a.cmd == "megatron-save":
        megatron_save(a.root)
    elif a.cmd == "megatron-load":
        megatron_load(a.root, a.old_world)
    elif a.cmd == "reader":
        reader(a.path, a.mode, a.out, a.ready, a.stop, a.limit)
    if a.cmd.startswith(("dcp-", "megatron-")):
        # Done, and said so (each rank's "ok" line comes after its every
        # comparison). The interpreter's teardown is skipped: gloo's worker
        # threads can still be joinable when torch's C++ state is destroyed
        # at exit, and a rank then aborts ("terminate called without an
        # active exception", SIGABRT) after a successful run (it happened
        # once in CI, to rank 1 of a load); pytorch/pytorch#179291 explains.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1:])
