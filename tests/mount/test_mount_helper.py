"""mount(8) and an fstab entry mount ckptfs through mount.ckptfs and
mount.fuse.ckptfs (tools/mounthelper.py): symlinks in /sbin to the
``ckptfs`` console script, as docs/OPERATIONS.md installs them."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from conftest import is_mounted

HELPERS = [Path("/sbin/mount.ckptfs"), Path("/sbin/mount.fuse.ckptfs")]


@contextmanager
def helpers_installed() -> Iterator[None]:
    """The helpers, pointing at this checkout's ckptfs; removed after, if
    this test made them."""
    script = Path(sys.executable).parent / "ckptfs"
    made = []
    try:
        for helper in HELPERS:
            if helper.is_symlink() and helper.resolve() == script.resolve():
                continue
            assert not helper.exists(), f"{helper} is someone else's: not touching it"
            helper.symlink_to(script)
            made.append(helper)
        yield
    finally:
        for helper in made:
            helper.unlink()


def mount8(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["mount", *args], capture_output=True, text=True, timeout=120)


def test_mount_t_ckptfs_and_an_fstab_entry_of_fuse_ckptfs(mounts, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    m1, m2 = mounts("a"), mounts("b")
    opts = f"cache_size=64MiB,run_dir={m1.run_dir},cache_dir={m1.cache_dir}"
    with helpers_installed():
        done = mount8("-t", "ckptfs", str(m1.backing), str(m1.mnt), "-o", opts + ",_netdev")
        assert done.returncode == 0, done.stderr + done.stdout
        assert is_mounted(m1.mnt)
        m1.pid = int(next(m1.run_dir.glob("*.pid")).read_text())
        (m1.mnt / "x.pt").write_bytes(b"x" * 5000)
        # An fstab entry (mount -T reads another fstab than /etc/fstab).
        fstab = tmp_path / "fstab"
        config = tmp_path / "c.yaml"
        config.write_text(f"cache:\n  size: 64MiB\n  dir: {m2.cache_dir}\nrun_dir: {m2.run_dir}\n")
        fstab.write_text(
            f"{m2.backing}  {m2.mnt}  fuse.ckptfs  config={config},nofail,x-systemd.after=x  0 0\n"
        )
        done = mount8("-T", str(fstab), str(m2.mnt))
        assert done.returncode == 0, done.stderr + done.stdout
        assert is_mounted(m2.mnt)
        m2.pid = int(next(m2.run_dir.glob("*.pid")).read_text())
        assert (m2.mnt / "x.pt").read_bytes() == b"x" * 5000  # the same backing directory
        # What it cannot do is said, and nothing is mounted.
        m3 = mounts("c")
        done = mount8("-t", "ckptfs", str(m3.backing), str(m3.mnt), "-o", "ro")
        assert done.returncode != 0 and "read-only" in done.stderr, done
        assert not is_mounted(m3.mnt)
    for m in (m1, m2):
        m.umount()
