"""The control socket of a root daemon against ordinary users, on real mounts:
a flood of idle connections, the descriptor limit at accept, requests only
root (and the mount's owner) may make, and what `ckptfs stat` tells whom."""

from __future__ import annotations

import json
import os
import resource
import socket
import time
from pathlib import Path
from typing import Any

from ckptfs import __version__
from hostile import flood
from mounts import Mount, is_mounted, process_gone
from users import OTHER, USER, run_as
from waits import wait_for

OWNER = OTHER  # an ordinary user who owns a mountpoint; USER is the hostile one

# Imported as root, before the child drops to the user: no torch.
IMPORTS = """
import contextlib, io, json, os, sys, time
from ckptfs.tools import cli, control
"""


def as_user(uid: int, code: str, *args: str) -> Any:
    """Run ``code`` as ``uid`` (its group the same number); see users.run_as."""
    return run_as(uid, uid, code, *args, imports=IMPORTS, timeout=60)


# `ckptfs ARGS...` through the CLI in this process: exit code, stdout, stderr, seconds.
CLI = """
    os.environ["CKPTFS_RUN_DIR"] = sys.argv[3]
    results = []
    for args in json.loads(sys.argv[4]):
        out, err = io.StringIO(), io.StringIO()
        start = time.monotonic()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            status = cli.main(args)
        results.append([status, out.getvalue(), err.getvalue(), time.monotonic() - start])
    print(json.dumps(results))
"""


def cli_as(uid: int, m: Mount, *commands: list[str]) -> list[tuple[int, str, str, float]]:
    return [tuple(r) for r in as_user(uid, CLI, str(m.run_dir), json.dumps(list(commands)))]


def control_socket(m: Mount) -> str:
    return str(next(m.run_dir.glob("*.sock")))


def timed(m: Mount, *args: str) -> float:
    start = time.monotonic()
    m.cli(*args, timeout=60)
    return time.monotonic() - start


def test_a_users_flood_of_idle_connections_delays_neither_root_nor_the_owner(shared_mounts):
    m = shared_mounts()
    os.chown(m.mnt, OWNER, OWNER)
    m.mount()
    m.allowed_log.append(f"refused a connection of uid {USER}")
    (m.mnt / "ckpt.pt").write_bytes(os.urandom(1 << 20))
    with flood(control_socket(m), USER, 500):
        time.sleep(1)  # the flood renews every connection the daemon closes
        assert timed(m, "stat", str(m.mnt), "--json") < 3
        (stat, _, err, seconds), (flush, _, err2, seconds2) = cli_as(
            OWNER, m, ["stat", str(m.mnt)], ["flush", str(m.mnt), "--wait"]
        )
        assert stat == 0 and seconds < 3, (err, seconds)
        assert flush == 0 and seconds2 < 5, (err2, seconds2)
        assert timed(m, "umount", str(m.mnt)) < 10
    assert not is_mounted(m.mnt)
    assert (m.backing / "ckpt.pt").exists()


def wait_read_ahead_set(mountpoint: Path, kb: int = 1024, timeout: float = 10.0) -> None:
    """The daemon sets the mount's read-ahead in the background after the
    mount, opening sysfs files until the value sticks."""
    with open("/proc/self/mountinfo") as mountinfo:
        device = next(line.split()[2] for line in mountinfo if line.split()[4] == str(mountpoint))
    knob = Path(f"/sys/class/bdi/{device}/read_ahead_kb")
    wait_for(
        lambda: int(knob.read_text()) == kb, timeout, f"read-ahead of {mountpoint} at {kb} KiB"
    )
    time.sleep(0.3)  # its last check of the value


def test_the_descriptor_limit_at_accept_is_logged_and_the_daemon_goes_on(mounts):
    m = mounts()
    m.mount()
    m.allowed_log.append("control socket: accept failed")
    (m.mnt / "a.bin").write_bytes(b"a" * 5000)
    m.wait_durable()
    wait_read_ahead_set(m.mnt)  # nothing else of the daemon's opens files meanwhile
    assert m.pid is not None
    soft, hard = resource.prlimit(m.pid, resource.RLIMIT_NOFILE)
    in_use = len(os.listdir(f"/proc/{m.pid}/fd"))
    conns = []
    try:
        # Room for two more descriptors: the third connection meets EMFILE.
        resource.prlimit(m.pid, resource.RLIMIT_NOFILE, (in_use + 2, hard))
        for _ in range(10):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(control_socket(m))  # waits in the backlog when not accepted
            conns.append(s)
        time.sleep(2)
        assert not process_gone(m.pid), "the daemon died at the descriptor limit"
    finally:
        resource.prlimit(m.pid, resource.RLIMIT_NOFILE, (soft, hard))
        for s in conns:
            s.close()
    assert (m.mnt / "a.bin").read_bytes() == b"a" * 5000
    assert m.stat()["files"][0]["path"] == "a.bin"
    failures = [line for line in m.log().splitlines() if "accept failed" in line]
    assert 1 <= len(failures) <= 2, failures  # once, not at every retry
    assert "Too many open files" in failures[0], failures


def test_holds_is_answered_to_root_alone_here(shared_mounts):
    m = shared_mounts()
    m.mount()
    (m.mnt / "f").write_bytes(b"x" * 100)
    ask = """
        reply = control.request(control.Path(sys.argv[3]), {"op": "holds", "files": [["a", "b"]]},
                                run=control.Path(sys.argv[4]))
        print(json.dumps(reply))
    """
    reply = as_user(USER, ask, str(m.mnt), str(m.run_dir))
    assert reply.get("ok") is False and reply.get("denied") is True, reply
    assert "permission denied" in reply["error"], reply
    assert as_user(0, ask, str(m.mnt), str(m.run_dir)) == {
        "ok": True,
        "held": [False],
        "version": __version__,
    }


def names_in(reply: Any) -> str:
    return json.dumps(reply)


def test_stat_names_a_file_only_to_its_owner_and_root(shared_mounts):
    m = shared_mounts()
    m.mount()
    private = m.mnt / "private"
    private.mkdir(mode=0o700)
    (private / "salary-2027.pt").write_bytes(os.urandom(300_000))
    job = m.mnt / "job"
    job.mkdir()
    os.chown(job, USER, USER)
    mine = """
        with open(sys.argv[3] + "/mine.pt", "wb") as out:
            out.write(os.urandom(200_000))
        try:
            os.listdir(sys.argv[4])
            listing = "allowed"
        except PermissionError:
            listing = "EACCES"
        print(json.dumps(listing))
    """
    assert as_user(USER, mine, str(job), str(private)) == "EACCES"

    def user_stat(*paths: Path) -> list[dict[str, Any]]:
        results = cli_as(USER, m, *[["stat", str(p), "--json"] for p in paths])
        assert all(r[0] == 0 for r in results), results
        return [json.loads(r[1]) for r in results]

    def check(phase: str) -> None:
        whole, probe_real, probe_none = user_stat(
            m.mnt, private / "salary-2027.pt", private / "no-such.pt"
        )
        assert "salary" not in names_in(whole), (phase, whole)
        assert [f["path"] for f in whole["files"]] == ["job/mine.pt"], phase
        assert whole["not_shown"]["files"] == 1, (phase, whole["not_shown"])
        # A guessed name under the prefix tells nothing: the same answer as a
        # name that does not exist.
        assert probe_real["files"] == probe_none["files"] == []
        assert probe_real["not_shown"] == probe_none["not_shown"] == whole["not_shown"]
        everything = m.stat()
        assert {f["path"] for f in everything["files"]} == {
            "job/mine.pt",
            "private/salary-2027.pt",
        }, phase
        assert everything["not_shown"] == {k: 0 for k in everything["not_shown"]}
        (status, text, _, _) = cli_as(USER, m, ["stat", str(m.mnt)])[0]
        assert status == 0 and "salary" not in text and "job/mine.pt" in text, text
        assert "not shown: 1 cached file" in text and "of other users" in text, text

    check("cached")
    m.wait_durable()
    check("durable")
    (whole,) = user_stat(m.mnt)
    assert [h["path"] for h in whole["history"]] == ["job/mine.pt"]
    assert whole["not_shown"]["history"] == 1
    assert {h["path"] for h in m.stat()["history"]} == {"job/mine.pt", "private/salary-2027.pt"}
