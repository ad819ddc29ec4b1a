"""A wheel built from this tree, installed into a clean virtual environment,
is a working ckptfs: pure Python, only the package (no tests, benchmarks or
top-level fs/peer/tools), its console script mounts, and the daemon it
starts runs the installed code."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

from ckptfs import __version__
from mounts import Mount

ROOT = Path(__file__).resolve().parents[2]


def run(*argv: str | Path, env: dict[str, str] | None = None, timeout: float = 600) -> str:
    # cwd "/": the checkout's fs/, peer/ and tools/ must not be importable by
    # being in the current directory.
    done = subprocess.run([str(a) for a in argv], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd="/")  # fmt: skip
    assert done.returncode == 0, f"{argv}: {done.stderr}{done.stdout}"
    return done.stdout


def test_a_wheel_in_a_clean_venv_mounts_and_runs_its_own_code(mounts, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    # --no-build-isolation: this environment's setuptools, no download.
    run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
        "-w", tmp_path / "dist", ROOT)  # fmt: skip
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    assert wheel.name == f"ckptfs-{__version__}-py3-none-any.whl"  # pure Python
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert tops == {"ckptfs", f"ckptfs-{__version__}.dist-info"}, tops
    assert "ckptfs/fs/daemon/daemon.py" in names and "ckptfs/peer/node.py" in names
    assert not [n for n in names if "/tests/" in n or "/bench/" in n or n.endswith(".so")]
    # A clean environment: nothing but the wheel and its dependencies.
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    python, ckptfs = env_dir / "bin" / "python", env_dir / "bin" / "ckptfs"
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    run(python, "-m", "pip", "install", "-q", wheel, env=clean)
    assert run(ckptfs, "--version", env=clean).strip() == f"ckptfs {__version__}"
    installed = run(python, "-c", "import ckptfs, sys; print(ckptfs.__file__)", env=clean)
    assert installed.startswith(str(env_dir)), installed
    not_there = run(python, "-c", "import importlib.util as u; "
                    "print([m for m in ('fs', 'peer', 'tools', 'pytest', 'torch') "
                    "if u.find_spec(m)])", env=clean)  # fmt: skip
    assert not_there.strip() == "[]"
    # Its console script mounts; the daemon is that environment's.
    m: Mount = mounts()
    env = {**clean, "CKPTFS_RUN_DIR": str(m.run_dir), "CKPTFS_CACHE_DIR": str(m.cache_dir)}
    run(ckptfs, "mount", m.mnt, "--backing", m.backing, "--cache-size", "64MiB", env=env)
    m.pid = int(next(m.run_dir.glob("*.pid")).read_text())
    exe = os.readlink(f"/proc/{m.pid}/exe")
    cmdline = Path(f"/proc/{m.pid}/cmdline").read_bytes().split(b"\0")
    assert cmdline[0].decode() == str(python) or exe == os.path.realpath(python), cmdline
    data = os.urandom(1_000_000)
    (m.mnt / "a.pt").write_bytes(data)
    run(ckptfs, "flush", m.mnt, "--wait", env=env)
    s = json.loads(run(ckptfs, "stat", m.mnt, "--json", env=env))
    assert s["version"] == __version__ and s["progress"]["durable"]["files"] == 1
    run(ckptfs, "umount", m.mnt, env=env)
    run(ckptfs, "mount", m.mnt, "--backing", m.backing, "--cache-size", "64MiB", env=env)
    m.pid = int(next(m.run_dir.glob("*.pid")).read_text())
    assert (m.mnt / "a.pt").read_bytes() == data  # from the store
    run(ckptfs, "umount", m.mnt, env=env)
