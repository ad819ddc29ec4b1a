"""Ordinary users on a root-mounted ckptfs, and input that tries to break it.

The daemon runs as root (systemd, DaemonSet, Slurm prolog); training jobs run
as the submitting user. Each user-side step runs in a child process that
imports what it needs as root, then drops to the user with setgid/setuid (the
virtualenv may live where an ordinary user cannot read it), and only then
touches the mount.
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from manifests import manifest_body
from mounts import Mount, is_mounted
from users import GROUP, OTHER, USER, run_as

MiB = 1 << 20


def manifest_of(path: Path) -> dict[str, Any]:
    """The JSON body of a manifest (its record in force, docs/FORMAT.md)."""
    return manifest_body(path)


def user_dir(m: Mount, name: str = "job") -> Path:
    d = m.mnt / name
    d.mkdir()
    os.chown(d, USER, GROUP)
    return d


def test_hf_like_sequence_as_an_ordinary_user(shared_mounts):
    m = shared_mounts()
    m.mount()
    job = user_dir(m)
    save = """
        job = sys.argv[3]
        torch.manual_seed(int(sys.argv[4]))
        state = {"w": torch.randn(256, 1024), "step": int(sys.argv[4])}
        os.makedirs(f"{job}/checkpoint-1", exist_ok=True)
        os.makedirs(f"{job}/checkpoint-2", exist_ok=True)
        # The same path twice (the bug: the second save was EACCES).
        torch.save(state, f"{job}/checkpoint-2/model.pt")
        torch.save(state, f"{job}/checkpoint-2/model.pt")
        torch.save(state, f"{job}/checkpoint-1/model.pt")
        # Temporary name, then os.replace (HF, Lightning, DCP all do this).
        torch.save(state, f"{job}/checkpoint-2/optimizer.pt.tmp")
        os.replace(f"{job}/checkpoint-2/optimizer.pt.tmp", f"{job}/checkpoint-2/optimizer.pt")
        os.chmod(f"{job}/checkpoint-2/optimizer.pt", 0o600)
        os.symlink("checkpoint-2", f"{job}/latest")
        with open(f"{job}/checkpoint-2/trainer_state.json", "w") as out:
            json.dump({"step": state["step"]}, out)
        shutil.rmtree(f"{job}/checkpoint-1")  # save_total_limit rotation
        back = torch.load(f"{job}/latest/optimizer.pt")
        print(json.dumps({"equal": bool(torch.equal(back["w"], state["w"])),
                          "listing": sorted(os.listdir(job))}))
    """
    out = run_as(USER, GROUP, save, str(job), "7")
    assert out == {"equal": True, "listing": ["checkpoint-2", "latest"]}

    # Through the mount and in the backing store, everything is the user's.
    m.wait_durable()
    for base in (job, m.backing / "job"):
        for path in [base, *base.rglob("*")]:
            st = os.lstat(path)
            assert (st.st_uid, st.st_gid) == (USER, GROUP), f"{path} owned by {st.st_uid}"
    assert stat.S_IMODE(os.stat(m.backing / "job/checkpoint-2/optimizer.pt").st_mode) == 0o600
    assert stat.S_IMODE(os.stat(job / "checkpoint-2/optimizer.pt").st_mode) == 0o600

    # Another user cannot read the 0600 file, and cannot write into the job.
    other = """
        job = sys.argv[3]
        result = {}
        for what, fn in (
            ("read", lambda: open(f"{job}/checkpoint-2/optimizer.pt", "rb").read(1)),
            ("create", lambda: open(f"{job}/intruder", "wb")),
            ("chmod", lambda: os.chmod(f"{job}/checkpoint-2/model.pt", 0o777)),
        ):
            try:
                fn()
                result[what] = "allowed"
            except OSError as exc:
                result[what] = errno.errorcode[exc.errno]
        print(json.dumps(result))
    """
    assert run_as(OTHER, OTHER, other, str(job)) == {
        "read": "EACCES",
        "create": "EACCES",
        "chmod": "EPERM",
    }

    # Resume after a remount: load, save over the same names again, load again.
    for cycle in range(2):
        m.umount()
        m.mount()
        resume = """
            job = sys.argv[3]
            old = torch.load(f"{job}/checkpoint-2/optimizer.pt")
            torch.manual_seed(7)
            expected = torch.randn(256, 1024)
            ok = bool(torch.equal(old["w"], expected))
            torch.save({"w": old["w"] * 2}, f"{job}/checkpoint-2/model.pt")
            ok = ok and bool(torch.equal(torch.load(f"{job}/checkpoint-2/model.pt")["w"],
                                         expected * 2))
            print(json.dumps(ok))
        """
        assert run_as(USER, GROUP, resume, str(job)) is True, f"cycle {cycle}"
    st = os.stat(m.backing / "job/checkpoint-2/model.pt")
    assert (st.st_uid, st.st_gid) == (USER, GROUP)


def test_setgid_directory_gives_its_group(shared_mounts):
    m = shared_mounts()
    m.mount()
    job = user_dir(m)
    os.chown(job, USER, 4242)
    os.chmod(job, 0o2775)
    code = """
        job = sys.argv[3]
        torch.save({"x": torch.ones(3)}, f"{job}/a.pt")
        os.mkdir(f"{job}/sub")
        st, sd = os.stat(f"{job}/a.pt"), os.stat(f"{job}/sub")
        print(json.dumps([st.st_gid, sd.st_gid, bool(sd.st_mode & stat.S_ISGID)]))
    """
    assert run_as(USER, GROUP, code, str(job)) == [4242, 4242, True]
    m.wait_durable()
    assert os.stat(m.backing / "job/a.pt").st_gid == 4242


def test_writes_by_others_clear_setuid_and_setgid(shared_mounts):
    m = shared_mounts()
    m.mount()
    target = m.mnt / "tool"
    target.write_bytes(b"#!/bin/sh\n")
    os.chmod(target, 0o6777)
    code = """
        path = sys.argv[3]
        with open(path, "ab") as out:
            out.write(b"echo hi\\n")
        print(json.dumps(stat.S_IMODE(os.stat(path).st_mode)))
    """
    assert run_as(USER, GROUP, code, str(target)) == 0o0777
    # Root's writes keep them (as on ext4, tmpfs, NFS).
    os.chmod(target, 0o6755)
    with open(target, "ab") as out:
        out.write(b"# root\n")
    assert stat.S_IMODE(os.stat(target).st_mode) == 0o6755
    # chown clears them too.
    os.chown(target, USER, GROUP)
    assert stat.S_IMODE(os.stat(target).st_mode) == 0o0755
    m.wait_durable()
    st = os.stat(m.backing / "tool")
    assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (USER, 0o0755)


def test_control_socket_permissions(shared_mounts):
    root_owned = shared_mounts("r")
    root_owned.mount()
    user_owned = shared_mounts("u")
    os.chown(user_owned.mnt, USER, GROUP)
    user_owned.mount()
    (root_owned.mnt / "f").write_bytes(os.urandom(1000))
    (user_owned.mnt / "g").write_bytes(os.urandom(1000))
    code = """
        import contextlib
        os.environ["CKPTFS_RUN_DIR"] = sys.argv[3]
        results = {}
        for op in (["stat", sys.argv[4]], ["flush", sys.argv[4], "--wait"],
                   ["evict", sys.argv[4]], ["umount", sys.argv[4]]):
            err = io.StringIO()
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                code = cli.main(op)
            results[op[0]] = [code, err.getvalue().strip()]
        print(json.dumps(results))
    """
    denied = run_as(USER, GROUP, code, str(root_owned.run_dir), str(root_owned.mnt))
    assert denied["stat"] == [0, ""]
    for op in ("flush", "evict", "umount"):
        status, message = denied[op]
        assert status == 1, op
        assert "permission denied" in message and "root and the mount's owner" in message, op
        assert not message.endswith(":"), message  # no dangling list of files
    assert root_owned.file_state("f") is not None  # still mounted and serving

    # The owner of the mountpoint may flush, evict and unmount its own mount.
    allowed = run_as(USER, GROUP, code, str(user_owned.run_dir), str(user_owned.mnt))
    assert {op: status for op, (status, _) in allowed.items()} == {
        "stat": 0,
        "flush": 0,
        "evict": 0,
        "umount": 0,
    }, allowed
    assert not is_mounted(user_owned.mnt)
    assert (user_owned.backing / "g").exists()


def _tree(root: Path) -> dict[str, tuple[int, int, bytes]]:
    """Each file's atime, mtime and bytes: times read before the bytes (on the
    local disk, relatime moves a day-old atime at the first read)."""
    times = {
        str(p.relative_to(root)): (p.stat().st_atime_ns, p.stat().st_mtime_ns)
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }
    return {rel: (*t, (root / rel).read_bytes()) for rel, t in times.items()}


@pytest.mark.parametrize("tool", ["cp", "rsync"])
def test_cp_p_and_rsync_a_keep_times_into_and_out_of_the_mount(shared_mounts, tmp_path, tool):
    m = shared_mounts()
    m.mount()
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    rels = ["a.bin", "sub/b.bin", "sub/c.bin"]
    for i, rel in enumerate(rels):
        (src / rel).write_bytes(os.urandom(100_000 + i * 77_777))

    def set_times(root: Path) -> None:
        # Whole seconds in the past, different atime and mtime for each file.
        for i, rel in enumerate(rels):
            os.utime(root / rel, ns=(1_600_000_000 * 10**9 + i * 10**9, 1_500_000_000 * 10**9 + i))

    set_times(src)
    expected = _tree(src)
    set_times(src)  # reading it moved the atimes on the local disk

    def copy(a: Path, b: Path) -> None:
        # rsync -a keeps mtimes only; --atimes (-U) adds atimes.
        cmd = ["cp", "-pR", f"{a}/.", str(b)] if tool == "cp" else ["rsync", "-aU", f"{a}/", str(b)]
        b.mkdir(exist_ok=True)
        subprocess.run(cmd, check=True, timeout=60, capture_output=True)

    copy(src, m.mnt / "in")
    assert _tree(m.mnt / "in") == expected
    m.wait_durable()
    m.umount()
    m.mount()
    assert _tree(m.mnt / "in") == expected  # and reading through the mount moves no atime
    out = tmp_path / "out"
    copy(m.mnt / "in", out)
    assert _tree(out) == expected


class RssWatch:
    """Samples the daemon's anonymous memory (its heap; the RAM cache is a
    shared mapping, bounded by --cache-size and reported apart) until stopped."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.peak = 0
        self.samples = 0  # taken while it ran: if its thread died, the peak would bound nothing
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def sample(self) -> int:
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
        raise AssertionError("no RssAnon")

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            try:
                self.peak = max(self.peak, self.sample())
            except (OSError, AssertionError):
                return
            self.samples += 1

    def __enter__(self) -> RssWatch:
        self.peak = self.sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        if exc[0] is None:  # the heap at the end counts, however short the watch
            self.peak = max(self.peak, self.sample())


HEAP_BOUND = 256 * MiB  # stated in the README ("Limits")


def test_huge_sizes_and_offsets_cost_no_memory(shared_mounts):
    m = shared_mounts()
    m.mount(cache_size="128MiB")
    assert m.pid is not None
    with RssWatch(m.pid) as rss:
        huge = m.mnt / "huge"
        huge.write_bytes(b"")
        with pytest.raises(OSError) as err:
            os.truncate(huge, 999_999_999_999_999)
        assert err.value.errno == errno.EFBIG
        os.truncate(huge, 10 << 40)  # 10 TiB: sparse, allowed
        assert os.stat(huge).st_size == 10 << 40
        fd = os.open(m.mnt / "far", os.O_CREAT | os.O_WRONLY, 0o644)
        try:
            os.pwrite(fd, b"tail", (12 << 40) - 4)
            with pytest.raises(OSError) as err:
                os.pwrite(fd, b"x", 1 << 50)
            assert err.value.errno == errno.EFBIG
        finally:
            os.close(fd)
        m.wait_durable(timeout=120)
        with open(m.mnt / "far", "rb") as f:
            f.seek((12 << 40) - 8)
            assert f.read() == b"\0\0\0\0tail"
            f.seek(5 << 40)
            assert f.read(1 << 20) == bytes(1 << 20)
    assert rss.peak < HEAP_BOUND, f"daemon heap peaked at {rss.peak >> 20} MiB"
    manifest = manifest_of(m.backing / "far")
    assert manifest["state"] == "durable" and manifest["size"] == 12 << 40
    assert sum(c[1] for c in manifest["chunks"]) < 8 * MiB  # only the bytes it holds


def _long_tree(root: Path, target_len: int) -> tuple[list[str], str]:
    """Directory names (and a file name) whose joined path from ``root`` is
    about ``target_len`` bytes: built with directory fds, as a job would."""
    names, total = [], 0
    while total + 250 < target_len:
        name = f"d{len(names):03d}" + "x" * 200
        names.append(name)
        total += len(name) + 1
    return names, "f" * max(1, min(255, target_len - total))


def test_long_names_deep_trees_and_paths_near_path_max(shared_mounts):
    m = shared_mounts()
    m.mount()
    with pytest.raises(OSError) as err:
        (m.mnt / ("n" * 256)).write_bytes(b"")
    assert err.value.errno == errno.ENAMETOOLONG
    (m.mnt / ("n" * 255)).write_bytes(b"255")
    assert (m.mnt / ("n" * 255)).read_bytes() == b"255"

    # About 4000 bytes below the mountpoint: with the backing root's prefix
    # this is beyond PATH_MAX, so the daemon must use dir-fd-relative calls.
    dirs, leaf = _long_tree(m.mnt, 4000)
    payload = os.urandom(3 * MiB + 12345)
    fd = os.open(m.mnt, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for name in dirs:
            os.mkdir(name, dir_fd=fd)
            nfd = os.open(name, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = nfd
        out = os.open(leaf, os.O_CREAT | os.O_WRONLY, 0o644, dir_fd=fd)
        os.write(out, payload)
        os.close(out)
    finally:
        os.close(fd)
    m.wait_durable()
    m.umount()
    m.mount()
    fd = os.open(m.mnt, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for name in dirs:
            nfd = os.open(name, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = nfd
        inp = os.open(leaf, os.O_RDONLY, dir_fd=fd)
        got = b""
        while chunk := os.read(inp, 1 << 20):
            got += chunk
        os.close(inp)
    finally:
        os.close(fd)
    assert got == payload

    # A deep tree of short names: 300 levels.
    deep = m.mnt / "deep"
    path = deep
    for i in range(300):
        path = path / f"{i % 10}"
    path.mkdir(parents=True)
    (path / "leaf").write_bytes(b"bottom")
    m.wait_durable()
    assert (path / "leaf").read_bytes() == b"bottom"
    shutil.rmtree(deep)
    assert not deep.exists()


TINY_FILES = int(os.environ.get("CKPTFS_TINY_FILES", "6000"))


def test_many_tiny_files_keep_the_heap_bounded(shared_mounts):
    """Many small files from parallel writers (CKPTFS_TINY_FILES, default
    6000 to keep CI short; the README gives a 100,000-file run)."""
    m = shared_mounts()
    m.mount(cache_size="256MiB")
    assert m.pid is not None
    writers = 8
    sample_at = TINY_FILES // 3

    def write(k: int) -> None:
        d = m.mnt / "tiny" / f"w{k}"
        d.mkdir(parents=True, exist_ok=True)
        for i in range(k, TINY_FILES, writers):
            (d / f"f{i}").write_bytes(i.to_bytes(8, "little") * 8)

    with RssWatch(m.pid) as rss:
        start = time.monotonic()
        threads = [threading.Thread(target=write, args=(k,)) for k in range(writers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=max(900, TINY_FILES / 20))  # at least 20 files/s
        assert not any(t.is_alive() for t in threads)
        elapsed = time.monotonic() - start
        m.wait_durable(timeout=300)
        after_all = rss.sample()
        m.cli("evict", str(m.mnt))  # and back from the backing store
    print(f"{TINY_FILES} tiny files in {elapsed:.1f}s; heap {after_all >> 20} MiB")
    assert rss.samples >= 10, f"the heap was sampled {rss.samples} times during the writes"
    assert rss.peak < HEAP_BOUND, f"daemon heap peaked at {rss.peak >> 20} MiB"
    # Every file is there, whole, and durable.
    files = sorted((m.mnt / "tiny").rglob("f*"))
    assert len(files) == TINY_FILES
    for path in files[:: max(1, TINY_FILES // sample_at)]:
        i = int(path.name[1:])
        assert path.read_bytes() == i.to_bytes(8, "little") * 8
    manifests = list((m.backing / "tiny").rglob("f*"))
    assert len(manifests) == TINY_FILES
    assert all(manifest_of(p)["state"] == "durable" for p in manifests[:500])


def test_refusals_by_design_are_not_warnings(shared_mounts):
    m = shared_mounts()
    m.mount()
    for i in range(200):
        with pytest.raises(OSError) as err:
            os.mkfifo(m.mnt / f"fifo{i}")
        assert err.value.errno == errno.EPERM
        with pytest.raises(OSError) as err:
            os.open(m.mnt / ("x" * 256), os.O_CREAT | os.O_WRONLY)
        assert err.value.errno == errno.ENAMETOOLONG
    log = m.log()
    # Logged once, at INFO, saying more go to DEBUG; never WARNING (the
    # fixture fails the test on any WARNING line).
    refused = [line for line in log.splitlines() if "refused" in line]
    kinds = [line.split("ckptfs.fuse: ")[1].split("(")[0] + line.split("[Errno ")[1][:3]
             for line in refused]  # fmt: skip
    assert refused and len(kinds) == len(set(kinds)) <= 2, refused  # mknod EPERM, long name
    assert all(" INFO " in line and "logged once per kind" in line for line in refused)
