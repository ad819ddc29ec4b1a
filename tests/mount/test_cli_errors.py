"""Every bad input gives a one-line error and a non-zero exit."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from ckptfs.fs.config import ConfigError, load_config, parse_size
from mounts import process_gone
from waits import wait_for


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ckptfs", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **(env or {})},
    )


def assert_one_line_error(proc: subprocess.CompletedProcess[str], *words: str) -> None:
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("ckptfs: error:"), lines[0]
    for word in words:
        assert word in lines[0], (word, lines[0])


@pytest.fixture
def dirs(tmp_path: Path) -> tuple[Path, Path, dict[str, str]]:
    mnt, backing = tmp_path / "mnt", tmp_path / "backing"
    mnt.mkdir()
    backing.mkdir()
    return (
        mnt,
        backing,
        {"CKPTFS_RUN_DIR": str(tmp_path / "run"), "CKPTFS_CACHE_DIR": str(tmp_path / "cache")},
    )


def test_mountpoint_missing(dirs, tmp_path):
    _, backing, env = dirs
    proc = run("mount", str(tmp_path / "nope"), "--backing", str(backing), env=env)
    assert_one_line_error(proc, "does not exist", "nope")


def test_mountpoint_not_a_directory(dirs, tmp_path):
    _, backing, env = dirs
    (tmp_path / "file").write_text("x")
    proc = run("mount", str(tmp_path / "file"), "--backing", str(backing), env=env)
    assert_one_line_error(proc, "not a directory")


def test_mountpoint_not_empty(dirs):
    mnt, backing, env = dirs
    (mnt / "x").write_text("x")
    assert_one_line_error(run("mount", str(mnt), "--backing", str(backing), env=env), "not empty")


def test_mountpoint_already_mounted(mounted):
    proc = run("mount", str(mounted.mnt), "--backing", str(mounted.backing), env=mounted.env)
    assert_one_line_error(proc, "already mounted")


def test_mountpoint_left_dead_by_a_killed_daemon(mounted):
    """It was a Python traceback (ENOTCONN from the mountpoint's stat)."""
    import signal

    os.kill(mounted.pid, signal.SIGKILL)
    wait_for(lambda: process_gone(mounted.pid), 10, "the killed daemon's exit")
    proc = run("mount", str(mounted.mnt), "--backing", str(mounted.backing), env=mounted.env)
    assert_one_line_error(proc, "dead ckptfs mount", "fusermount3 -u -z", str(mounted.mnt))


def test_backing_missing(dirs, tmp_path):
    mnt, _, env = dirs
    proc = run("mount", str(mnt), "--backing", str(tmp_path / "gone"), env=env)
    assert_one_line_error(proc, "backing directory", "does not exist")


def test_backing_not_writable(dirs, tmp_path):
    mnt, backing, env = dirs
    # Root ignores permission bits; a read-only bind mount is what refuses root.
    ro = tmp_path / "ro"
    ro.mkdir()
    subprocess.run(["mount", "--bind", str(backing), str(ro)], check=True)
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(ro)], check=True)
        assert_one_line_error(run("mount", str(mnt), "--backing", str(ro), env=env), "not writable")
    finally:
        subprocess.run(["umount", str(ro)], check=False)


def test_cache_larger_than_cache_dir(dirs, tmp_path):
    mnt, backing, env = dirs
    small = tmp_path / "small-tmpfs"
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=32m", "tmpfs", str(small)], check=True)
    try:
        proc = run(
            "mount",
            str(mnt),
            "--backing",
            str(backing),
            "--cache-size",
            "64MiB",
            "--cache-dir",
            str(small / "c"),
            env=env,
        )
        assert_one_line_error(proc, "cache directory", "cache.size needs 64 MiB")
    finally:
        subprocess.run(["umount", str(small)], check=False)


def test_no_daemon_at_path(tmp_path):
    for cmd in ("stat", "flush", "evict"):
        assert_one_line_error(run(cmd, str(tmp_path)), "no ckptfs daemon")
    assert_one_line_error(run("umount", str(tmp_path)), "not mounted")


def test_unknown_config_key(dirs, tmp_path):
    mnt, backing, env = dirs
    cfg = tmp_path / "c.yaml"
    cfg.write_text("cache:\n  sise: 1GiB\n")
    proc = run("mount", str(mnt), "--backing", str(backing), "--config", str(cfg), env=env)
    assert_one_line_error(proc, "cache.sise", "unknown key")


@pytest.mark.parametrize(
    "yaml_text,key",
    [
        ("durability: sometimes\n", "durability"),
        ("cache: {size: lots}\n", "cache.size"),
        ("cache: {size: 150%}\n", "cache.size"),
        ("flush: {workers: 0}\n", "flush.workers"),
        ("flush: {bandwidth: fast}\n", "flush.bandwidth"),
        ("chunk_size: 1\n", "chunk_size"),
        ("node: 'a b'\n", "node"),
        ("fuse: {writeback_cache: maybe}\n", "fuse.writeback_cache"),
        ("fuse: {open_recheck: soon}\n", "fuse.open_recheck"),
    ],
)
def test_bad_config_value_names_the_key(dirs, tmp_path, yaml_text, key):
    mnt, backing, env = dirs
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml_text)
    proc = run("mount", str(mnt), "--backing", str(backing), "--config", str(cfg), env=env)
    assert_one_line_error(proc, f"'{key}'")


def test_bad_flag_and_env_values_name_the_key(dirs):
    mnt, backing, env = dirs
    proc = run("mount", str(mnt), "--backing", str(backing), "--cache-size", "12 apples", env=env)
    assert_one_line_error(proc, "'cache.size'")
    proc = run(
        "mount", str(mnt), "--backing", str(backing), env={**env, "CKPTFS_FLUSH_WORKERS": "-3"}
    )
    assert_one_line_error(proc, "'flush.workers'")


def test_size_parsing():
    assert parse_size("512MiB", "k") == 512 << 20
    assert parse_size("2GiB", "k") == 2 << 30
    assert parse_size("1.5G", "k") == int(1.5 * (1 << 30))
    assert parse_size(4096, "k") == 4096
    assert (
        0 < parse_size("10%", "k", allow_percent=True) < parse_size("20%", "k", allow_percent=True)
    )
    with pytest.raises(ConfigError):
        parse_size("10%", "k")


def test_config_precedence(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("cache: {size: 1GiB}\nflush: {workers: 2}\n")
    c = load_config(cfg, {"flush.workers": 7}, environ={"CKPTFS_CACHE_SIZE": "2GiB"})
    assert c.cache_size == 2 << 30 and c.flush_workers == 7
    assert c.open_recheck == 0.05  # the default on a single node
    recheck = load_config(None, {}, environ={"CKPTFS_FUSE_OPEN_RECHECK": "0"})
    assert recheck.open_recheck == 0.0
    with pytest.raises(ConfigError, match="durability"):
        load_config(None, {"durability": "buddy"}, environ={})


def test_a_run_dir_set_in_the_config_file_is_where_every_command_looks(mounts, tmp_path):
    """`run_dir:` in the YAML file, no CKPTFS_RUN_DIR: `ckptfs mount` used to
    ping /run/ckptfs for 60 s, then SIGKILL the daemon that had mounted fine,
    leaving a dead mount; the other commands could not find it either."""
    from ckptfs.fs.store.manifest import read_manifest
    from conftest import is_mounted

    m = mounts("cfg")
    del m.env["CKPTFS_RUN_DIR"]
    config = tmp_path / "ckptfs.yaml"
    config.write_text(f"run_dir: {m.run_dir}\n")
    m.mount("--config", str(config))
    data = os.urandom(3 << 20)
    (m.mnt / "ckpt.pt").write_bytes(data)
    stat = m.cli("stat", str(m.mnt), "--json", "--config", str(config))
    assert "ckpt.pt" in stat.stdout
    m.cli("flush", str(m.mnt), "--wait", "--config", str(config))
    # Without the config file the command looks in the default place: a clear error.
    assert_one_line_error(m.cli("stat", str(m.mnt), check=False), "no ckptfs daemon answers")
    m.cli("umount", str(m.mnt), "--config", str(config))
    assert not is_mounted(m.mnt)
    manifest = read_manifest(m.backing / "ckpt.pt")
    assert manifest is not None and manifest.state == "durable" and manifest.size == len(data)
