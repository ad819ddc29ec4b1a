"""The Slurm prolog and epilog (deploy/slurm-*.sh) of a job on three nodes,
each a daemon on this machine on its own loopback address, with a fake
``scontrol``: peers from the job's node list, a per-job secret derived from
the cluster secret, a stable by-name path, and a resubmission of the same
run on one node finding its checkpoint there."""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from ckptfs.tools.control import request
from mounts import FUSERMOUNT, is_mounted, process_gone
from users import USER, run_as
from waits import wait_for

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
NODES = ["127.0.0.1", "127.0.0.2", "127.0.0.3"]
JOB_NAME = "llama-7b"

FAKE_SCONTROL = """#!/bin/bash
# scontrol show hostnames LIST | scontrol show job -o ID
case "$1 $2" in
"show hostnames") printf '%s\\n' $FAKE_NODES ;;
"show job") echo "JobId=$3 JobName=$FAKE_JOB_NAME UserId=nobody(65534) NodeList=fake[1-3]" ;;
*) exit 1 ;;
esac
"""

WRITE = """
shutil.copyfile(sys.argv[4], sys.argv[3])
print(json.dumps(True))
"""

READ = """
import hashlib
import json
print(json.dumps(hashlib.sha256(open(sys.argv[3], "rb").read()).hexdigest()))
"""


@pytest.fixture
def site() -> Iterator[Path]:
    """A directory every user may traverse (the job user reaches its mount)."""
    root = Path(tempfile.mkdtemp(prefix="ckptfs-slurm-", dir="/tmp"))
    root.chmod(0o755)
    try:
        yield root
    finally:
        for mnt in root.glob("node*/ckpt/*"):
            if is_mounted(mnt):
                subprocess.run([FUSERMOUNT, "-u", "-z", str(mnt)], capture_output=True, timeout=30)
        for pid_file in root.glob("node*/run/*.pid"):
            try:
                pid = int(pid_file.read_text())
                if not process_gone(pid):
                    os.kill(pid, signal.SIGKILL)
            except (OSError, ValueError):
                pass
        for i in range(len(NODES)):
            shutil.rmtree(cache_root(root, i), ignore_errors=True)
        shutil.rmtree(root, ignore_errors=True)


def cache_root(site: Path, i: int) -> Path:
    return Path(f"/dev/shm/ckptfs-slurm-test-{site.name}-{i}")


def node_env(site: Path, i: int, job: int, nodes: list[str]) -> dict[str, str]:
    return {
        **os.environ,
        "SLURM_JOB_ID": str(job),
        "SLURMD_NODENAME": NODES[i],
        "SLURM_JOB_USER": "nobody",
        "SLURM_JOB_UID": str(USER),
        "SLURM_JOB_GID": str(USER),
        "CKPTFS_SLURM_BIN": str(Path(sys.executable).parent / "ckptfs"),
        "CKPTFS_SLURM_ROOT": str(site / f"node{i}" / "ckpt"),
        "CKPTFS_SLURM_BACKING": str(site / "nfs" / "%u"),
        "CKPTFS_SLURM_CACHE_ROOT": str(cache_root(site, i)),
        "CKPTFS_SLURM_CONFIG": str(site / "ckptfs.yaml"),
        "CKPTFS_SLURM_SECRET": str(site / "cluster.secret"),
        "CKPTFS_SLURM_SCONTROL": str(site / "scontrol"),
        "CKPTFS_SLURM_LISTEN": NODES[i],
        # Inside the daemon's run_dir, as /run/ckptfs/slurm is in /run/ckptfs.
        "CKPTFS_SLURM_RUN": str(site / f"node{i}" / "run" / "slurm"),
        "CKPTFS_SLURM_MOUNT_TIMEOUT": "60",
        "CKPTFS_SLURM_UMOUNT_TIMEOUT": "60",
        "CKPTFS_RUN_DIR": str(site / f"node{i}" / "run"),  # one machine, three nodes
        "FAKE_NODES": " ".join(nodes),
        "FAKE_JOB_NAME": JOB_NAME,
    }


def script(name: str, env: dict[str, str]) -> None:
    done = subprocess.run(["bash", str(DEPLOY / name)], env=env, capture_output=True,
                          text=True, timeout=180)  # fmt: skip
    assert done.returncode == 0, f"{name} on {env['SLURMD_NODENAME']}: {done.stderr}"


def stat(env: dict[str, str]) -> dict:
    mnt = Path(env["CKPTFS_SLURM_ROOT"]) / env["SLURM_JOB_ID"]
    return request(mnt, {"op": "stat", "path": ""}, 10, run=Path(env["CKPTFS_RUN_DIR"]))


def test_a_job_on_three_nodes_mirrors_and_its_rerun_finds_its_checkpoint(site: Path) -> None:
    (site / "scontrol").write_text(FAKE_SCONTROL)
    (site / "scontrol").chmod(0o755)
    (site / "cluster.secret").write_text("the cluster's own secret, 32 bytes or so\n")
    (site / "cluster.secret").chmod(0o600)
    (site / "ckptfs.yaml").write_text("cache:\n  size: 128MiB\n")  # the site's settings
    envs = [node_env(site, i, 4242, NODES) for i in range(3)]
    for env in envs:
        script("slurm-prolog.sh", env)
    # Each node's config: the site's keys and the job's peers, on one port.
    secret = hmac.new(b"the cluster's own secret, 32 bytes or so", b"ckptfs-slurm-job:4242",
                      hashlib.sha256).hexdigest()  # fmt: skip
    for i, env in enumerate(envs):
        run = site / f"node{i}" / "run" / "slurm" / "4242"
        assert (run / "secret").read_text().strip() == secret
        assert (run / "secret").stat().st_mode & 0o077 == 0 and run.stat().st_mode & 0o077 == 0
        s = stat(env)
        assert s["cache"]["capacity"] == 128 << 20 and s["durability"] == "buddy"
    for env in envs:
        alive = [p["alive"] for p in stat(env)["peers"]]
        wait_for(lambda env=env: [p["alive"] for p in stat(env)["peers"]] == [True, True], 30,
                 f"{env['SLURMD_NODENAME']} sees both peers alive (first {alive})")  # fmt: skip
    ports = {p["address"].rsplit(":", 1)[1] for p in stat(envs[0])["peers"]}
    assert ports == {str(17000 + 4242 % 1000)}
    # The job's user writes through the stable path; the file is mirrored to
    # the buddy of the first node (the next in the node list).
    link = site / "node0" / "ckpt" / "by-name" / "nobody" / JOB_NAME
    assert os.readlink(link) == str(site / "node0" / "ckpt" / "4242")
    data = os.urandom(300_000)
    (site / "data.bin").write_bytes(data)
    (site / "data.bin").chmod(0o644)
    digest = hashlib.sha256(data).hexdigest()
    run_as(USER, USER, WRITE, str(link / "step-100.pt"), str(site / "data.bin"))
    (f,) = [f for f in stat(envs[0])["files"] if f["path"] == "step-100.pt"]
    assert f["holders"] == NODES[:2], f
    assert run_as(USER, USER, READ, str(site / "node2" / "ckpt" / "4242" / "step-100.pt")) == (
        digest
    )
    for env in envs:
        script("slurm-epilog.sh", env)
    for i in range(3):
        assert not is_mounted(site / f"node{i}" / "ckpt" / "4242")
        assert not (site / f"node{i}" / "run" / "slurm" / "4242").exists()
        assert not (site / f"node{i}" / "ckpt" / "by-name" / "nobody" / JOB_NAME).is_symlink()
        assert not (cache_root(site, i) / "4242").exists()
    # The same run submitted again, as job 4243 on one node: same path, and
    # the checkpoint is there (from the backing store); no peers, no secret.
    rerun = node_env(site, 0, 4243, NODES[:1])
    script("slurm-prolog.sh", rerun)
    assert run_as(USER, USER, READ, str(link / "step-100.pt")) == digest
    assert not (site / "node0" / "run" / "slurm" / "4243").exists()
    assert stat(rerun)["peers"] == [] and stat(rerun)["durability"] == "local"
    script("slurm-epilog.sh", rerun)
    assert not is_mounted(site / "node0" / "ckpt" / "4243")


def test_fields_a_user_can_shape_do_not_choose_the_nodes_or_the_path(site: Path) -> None:
    """scontrol's one-line output holds fields the job's user chose (its
    name, comment, paths): a name with a space or one that smuggles in
    another field is not used, and a node name that is not one is refused."""
    common = DEPLOY / "slurm-common.sh"

    def field(line: str, key: str) -> tuple[int, str]:
        fake = site / "scontrol-field"
        fake.write_text(f"#!/bin/bash\necho {json.dumps(line)}\n")
        fake.chmod(0o755)
        done = subprocess.run(
            ["bash", "-c", f". {common}; scontrol_job {key}"],
            env={**os.environ, "SLURM_JOB_ID": "7", "CKPTFS_SLURM_SCONTROL": str(fake)},
            capture_output=True, text=True, timeout=30,
        )  # fmt: skip
        return done.returncode, done.stdout.strip()

    real = "JobId=7 JobName=run1 UserId=a(1) Comment=x NodeList=gpu[1-2] WorkDir=/w"
    assert field(real, "JobName") == (0, "run1")
    assert field(real, "NodeList") == (0, "gpu[1-2]")
    smuggled = "JobId=7 JobName=x NodeList=evil[1-9] UserId=a(1) NodeList=gpu[1-2] WorkDir=/w"
    assert field(smuggled, "NodeList")[0] != 0
    spaced = "JobId=7 JobName=my run UserId=a(1) NodeList=gpu1"
    assert field(spaced, "JobName")[0] != 0
    # A node list with a name that is not a node name: the prolog refuses.
    (site / "cluster.secret").write_text("s" * 32)
    (site / "cluster.secret").chmod(0o600)
    (site / "scontrol").write_text(FAKE_SCONTROL)
    (site / "scontrol").chmod(0o755)
    env = node_env(site, 0, 77, ["127.0.0.1", "x':{evil"])
    done = subprocess.run(["bash", str(DEPLOY / "slurm-prolog.sh")], env=env,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 1 and "bad node name" in done.stderr, done.stderr
    assert not is_mounted(site / "node0" / "ckpt" / "77")
