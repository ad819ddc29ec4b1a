"""A daemon run by an ordinary user, as on a cluster without root: `ckptfs
mount` goes through fusermount3, and the user's whole checkpoint life (save,
umount, a cold remount, load, umount, mount, load again) works on it with
that user's rights alone.

The machine is made as a distribution has it for the test only: /dev/fuse
0666 (here root's alone), and the interpreter's directories reachable (here
under /root, 0700)."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from mounts import Mount, is_mounted

NOBODY = 65534


class UserMount(Mount):
    """A Mount whose every `ckptfs` command, daemon included, runs as nobody."""

    mount_in_process = False

    def cli(self, *args: str, **kw: Any) -> subprocess.CompletedProcess[str]:
        env = {**self.env, **(kw.pop("env", None) or {}), "HOME": str(self.root)}
        check = kw.pop("check", True)
        proc = subprocess.run(
            [sys.executable, "-m", "ckptfs", *args],
            capture_output=True,
            text=True,
            timeout=kw.pop("timeout", 120),
            env=env,
            cwd=self.root,
            user=NOBODY,
            group=NOBODY,
            extra_groups=[],
        )
        if check and proc.returncode != 0:
            raise AssertionError(f"ckptfs {' '.join(args)} failed: {proc.stderr}{proc.stdout}")
        return proc


@contextmanager
def reachable_by_others(*paths: Path) -> Iterator[None]:
    """o+x on each directory above ``paths`` that lacks it, put back after."""
    changed: list[tuple[Path, int]] = []
    try:
        for path in paths:
            for d in Path(os.path.realpath(path)).parents:
                mode = stat.S_IMODE(d.stat().st_mode)
                if not mode & stat.S_IXOTH and (d, mode) not in changed:
                    changed.append((d, mode))
                    d.chmod(mode | stat.S_IXOTH)
        yield
    finally:
        for d, mode in reversed(changed):
            d.chmod(mode)


@contextmanager
def fuse_for_everyone() -> Iterator[None]:
    mode = stat.S_IMODE(os.stat("/dev/fuse").st_mode)
    os.chmod("/dev/fuse", 0o666)
    try:
        yield
    finally:
        os.chmod("/dev/fuse", mode)


JOB = textwrap.dedent(
    """
    import os, sys, torch
    mnt, step = sys.argv[1], sys.argv[2]
    g = torch.Generator().manual_seed(1234)
    sd = {f"layer{i}.weight": torch.randn(96 * 1024 + i, generator=g) for i in range(6)}
    path = os.path.join(mnt, "run", "model.pt")
    if step == "save":
        os.makedirs(os.path.dirname(path), exist_ok=True)
        torch.save(sd, path + ".tmp")
        os.replace(path + ".tmp", path)
        torch.save({"step": 1, **sd}, path)  # the user overwrites their own file
        with open(path, "rb") as f:
            data = f.read()
        with open(os.path.join(os.environ["HOME"], "expected.pt"), "wb") as f:
            f.write(data)
    with open(path, "rb") as f, open(os.path.join(os.environ["HOME"], "expected.pt"), "rb") as e:
        assert f.read() == e.read(), "the file differs from what was saved"
    for mmap in (False, True):
        got = torch.load(path, mmap=mmap, weights_only=True)
        assert got.pop("step") == 1 and got.keys() == sd.keys()
        assert all(torch.equal(got[k], sd[k]) for k in sd), "a tensor differs"
    st = os.stat(path)
    print(st.st_uid, st.st_gid, oct(st.st_mode & 0o777))
    """
)


def test_an_ordinary_users_own_daemon() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to drop to another user")
    # Outside pytest's tmp_path, which only root may enter.
    root = Path(tempfile.mkdtemp(prefix="ckptfs-user-daemon-"))
    root.chmod(0o755)
    m = UserMount(root)
    job = root / "job.py"
    job.write_text(JOB)
    for p in [*root.iterdir(), root]:
        os.chown(p, NOBODY, NOBODY)

    def run_job(step: str) -> list[str]:
        proc = subprocess.run(
            [sys.executable, str(job), str(m.mnt), step],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "HOME": str(root)},
            user=NOBODY,
            group=NOBODY,
            extra_groups=[],
        )
        assert proc.returncode == 0, proc.stderr
        return proc.stdout.split()

    config = root / "config.yaml"
    config.write_text("fuse:\n  allow_other: false\n")
    caches = [Path(f"{m.cache_dir}-{i}") for i in range(4)]
    fuse_conf = Path("/etc/fuse.conf")
    conf = fuse_conf.read_text() if fuse_conf.exists() else ""
    refused = not any(ln.strip() == "user_allow_other" for ln in conf.splitlines())

    def mount_by_default(cache: Path) -> None:
        """The default asks fusermount3 for allow_other, which it refuses:
        one line that says what to change, and nothing left mounted."""
        proc = m.cli(
            "mount", str(m.mnt), "--backing", str(m.backing),
            "--cache-dir", str(cache), "--cache-size", "64MiB",
            check=False, timeout=90,
        )  # fmt: skip
        assert proc.returncode != 0
        assert "user_allow_other" in proc.stderr, proc.stderr
        assert "allow_other: false" in proc.stderr, proc.stderr
        assert "Traceback" not in proc.stderr and not is_mounted(m.mnt)

    def mount(cache: Path, **env: str) -> None:
        m.mount("--config", str(config), "--cache-dir", str(cache), env=env)
        line = next(ln for ln in Path("/proc/self/mounts").read_text().splitlines()
                    if ln.split()[1] == str(m.mnt))  # fmt: skip
        assert f"user_id={NOBODY}" in line and "allow_other" not in line, line

    def state() -> str | None:
        return {f["path"]: f["state"] for f in m.stat()["files"]}.get("run/model.pt")

    with fuse_for_everyone(), reachable_by_others(Path(sys.executable), Path(__file__)):
        try:
            if refused:
                mount_by_default(caches[0])
                # Nothing was cached: the failed mount gave its cache's RAM back.
                assert not [p for p in caches[0].rglob("*") if p.is_file()]
            # Save with a store so slow that the file is still pending when
            # the daemon dies.
            mount(caches[1], CKPTFS_FLUSH_BANDWIDTH="1KiB")
            assert run_job("save") == [str(NOBODY), str(NOBODY), "0o644"]
            # Pending: its flush not started yet, or started and crawling
            # (which, depends on when the settle after the first close ended).
            assert state() in ("dirty", "flushing")
            m.kill()
            if refused:
                # A failed mount must keep what the dead daemon left.
                mount_by_default(caches[1])
                assert "was not mounted; the cache at" in m.log()
            m.allowed_log = ["was not mounted; the cache at", "cannot mount"]
            # The next mount recovers it, then three lives of the job: resume
            # from the recovered cache, from a cold (new, empty) cache, and again.
            for cache in (caches[1], caches[2], caches[3]):
                mount(cache)
                assert run_job("load") == [str(NOBODY), str(NOBODY), "0o644"]
                m.wait_durable()
                assert state() == "durable"
                m.umount()
            assert "1 file(s) recovered" in m.log()
            assert not m.unexpected_log_lines(), m.unexpected_log_lines()
            model = m.backing / "run" / "model.pt"
            assert (model.stat().st_uid, model.stat().st_gid) == (NOBODY, NOBODY)
            m.cli("check", str(m.backing))
        finally:  # as nobody: the interpreter is still reachable
            m.cleanup()
            for c in caches:
                shutil.rmtree(c, ignore_errors=True)
            shutil.rmtree(root, ignore_errors=True)
