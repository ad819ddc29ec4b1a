"""What `ckptfs stat` shows an operator by default (health, bytes by state and
when they are durable, backpressure, lost files, recent checkpoints), what
``--verbose`` adds, and what an ordinary user is shown: on real mounts, and
the sums (fs/daemon/statview.py ``progress``) on cache entries made by hand."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from children import next_line
from ckptfs import __version__
from ckptfs.fs.content.cachedfile import CachedFile
from ckptfs.fs.content.state import FileRole, FileState, MirrorState
from ckptfs.fs.daemon.statview import StatView, Viewer, progress
from ckptfs.tools.statfmt import SHORT, duration, eta_text, format_stat
from conftest import Mount, wait_for
from test_control_users import USER, as_user, cli_as

MiB = 1 << 20
# What the default output leaves to --verbose: one mark of each internal.
INTERNALS = (
    "read-ahead:",
    "chunk reads:",
    "requests:",
    "memory:",
    "pre-faulted",
    "peaks:",
    "saved by dedup",
    "calls,",
    "open handle(s)",
)


def text_of(m: Mount, *args: str) -> str:
    return m.cli("stat", str(m.mnt), *args).stdout


def labelled(text: str, label: str) -> list[str]:
    """The lines of the ``label:`` row and its continuation lines."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"{label}:"))
    rows = [lines[start]]
    for line in lines[start + 1 :]:
        if not line.startswith(" "):
            break
        rows.append(line)
    return rows


def stable(s: dict[str, Any]) -> Any:
    """What does not change while nothing is written: a flush in progress moves
    only at a chunk's end, under the bandwidth cap every few seconds."""
    return (
        {k: v for k, v in s["progress"].items() if k not in ("rate", "eta_seconds")},
        [(f["path"], f["state"], f["size"], f["flushed_bytes"]) for f in s["files"]],
        s["history"],
        {k: s["cache"][k] for k in ("used", "capacity", "waiting_writers")},
        s["backing_health"],
        s["daemon_health"],
    )


@contextmanager
def writing(path: Path, size: int) -> Iterator[None]:
    """``path`` written and held open (not committed: dirty) by a process that
    forks nothing (a fork's copy of the descriptor, closed at its exec, would
    commit the file); closed at the end."""
    code = (
        "import os, sys\n"
        "f = open(sys.argv[1], 'wb'); f.write(os.urandom(int(sys.argv[2]))); f.flush()\n"
        "print('written', flush=True); sys.stdin.read(); f.close()\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code, str(path), str(size)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert next_line(proc) == "written"
        yield
    finally:
        proc.communicate(timeout=30)  # end of input: it closes the file


def same_moment(m: Mount) -> tuple[dict[str, Any], str]:
    """The default output and a --json taken before it that says the same."""
    for _ in range(10):
        before = m.stat()
        text = text_of(m)
        if stable(m.stat()) == stable(before):
            return before, text
    raise AssertionError("stat never held still for three calls")


def test_the_default_output_shows_what_an_operator_acts_on_with_the_numbers_of_the_json(
    mounts,
):
    m = mounts()
    # A flush paced to 1 MiB/s stores its 4 MiB chunks seconds apart.
    m.mount(env={"CKPTFS_FLUSH_BANDWIDTH": "1MiB"})
    (m.mnt / "durable.bin").write_bytes(os.urandom(100_000))
    m.wait_durable()
    (m.mnt / "flushing.bin").write_bytes(os.urandom(9_000_000))
    with writing(m.mnt / "dirty.bin", 3_000_000):
        wait_for(lambda: m.file_state("flushing.bin") == "flushing", 30, "flushing.bin flushing")
        s, text = same_moment(m)
        p = s["progress"]
        assert p["dirty"] == {"files": 1, "bytes": 3_000_000}, p
        assert p["durable"] == {"files": 1, "bytes": 100_000}, p
        flushing = p["flushing"]
        assert flushing["files"] == 1 and flushing["bytes"] == 9_000_000, p
        assert p["to_store"] == 12_000_000 - flushing["flushed"], p
        # The time left is reckoned from the measured rate, or is unknown.
        if p["rate"]:
            assert p["eta_seconds"] == round(p["to_store"] / p["rate"], 1), p
        else:
            assert p["eta_seconds"] is None, p

        lines = text.splitlines()
        assert lines[0].startswith(f"ckptfs at {m.mnt}  node {s['node']}  durability local")
        assert labelled(text, "health") == ["health:       store normal; daemon ok"]
        done = f"{flushing['flushed'] / 9_000_000:.0%}"
        assert labelled(text, "data") == [
            "data:         2.9 MiB dirty (1 file), "
            f"8.6 MiB flushing (1 file, {done} flushed), 97.7 KiB durable (1 file)"
        ]
        (eta,) = labelled(text, "durable in")
        to_store = f"{p['to_store'] / MiB:.1f} MiB to store"
        assert eta.startswith("durable in:   ") and to_store in eta, eta
        assert re.match(r"durable in: +(about [0-9.]+ s|about [0-9hmsd]+|unknown): ", eta), eta
        c = s["cache"]
        assert labelled(text, "backpressure") == [
            "backpressure: 0 writers waiting now; 0.0 s waited in 0 waits since mount; "
            f"cache {c['used'] / MiB:.1f} MiB of {c['capacity'] / MiB:.1f} MiB in use"
        ]
        assert labelled(text, "lost") == ["lost:         none"]
        (recent,) = labelled(text, "recent")
        assert recent.endswith("  97.7 KiB  durable.bin"), recent
        clock = s["history"][-1]["time"].partition("T")[2]
        assert recent.startswith(f"recent:       {clock[:5]}"), (recent, s["history"])
        flushed = s["files"][2]["flushed_bytes"] / 9_000_000
        assert labelled(text, "files") == [
            "files:        dirty        2.9 MiB        dirty.bin",
            "              durable     97.7 KiB  100%  durable.bin",
            f"              flushing     8.6 MiB {f'{flushed:.0%}':>5}  flushing.bin",
        ]
        assert "peers:" not in text and "not shown" not in text
        assert not [mark for mark in INTERNALS if mark in text], text
        # The formatter says of this very reply what the mount's output says,
        # but for the uptime and the measured rate, which move.
        moving = ("ckptfs at ", "durable in:")
        assert [x for x in format_stat(s).splitlines() if not x.startswith(moving)] == [
            x for x in lines if not x.startswith(moving)
        ]
    m.wait_durable(timeout=60)
    done_text = text_of(m)
    assert "durable in:   now (nothing left to store)" in done_text, done_text
    assert "0 B flushing (0 files)," in done_text and "11.5 MiB durable (3 files)" in done_text


def test_the_time_left_is_unknown_without_a_measured_rate() -> None:
    reply = {
        "flush": {"bandwidth_cap": 0},
        "progress": {"to_store": 3 * MiB, "rate": 0.0, "eta_seconds": None},
    }
    assert eta_text(reply) == "unknown: 3.0 MiB to store, nothing flushed in the last 10 s"
    reply["progress"] = {"to_store": 300 * MiB, "rate": 2.0 * MiB, "eta_seconds": 150.0}
    assert eta_text(reply) == (
        "about 2m30s: 300.0 MiB to store at 2.0 MiB/s (measured over the last 10 s)"
    )
    assert [duration(x) for x in (0.42, 42, 185, 7500, 200_000)] == [
        "0.4 s",
        "42 s",
        "3m05s",
        "2h05m",
        "2d07h",
    ]


def test_verbose_adds_the_internals_and_every_file(mounted: Mount):
    m = mounted
    names = [f"ckpt-{i}.pt" for i in range(SHORT + 2)]
    for name in names:
        (m.mnt / name).write_bytes(os.urandom(200_000))
    m.wait_durable()
    default, verbose = text_of(m), text_of(m, "--verbose")
    # Default: the files counted, the three newest checkpoints, no internals.
    assert labelled(default, "files") == [
        f"files:        {len(names)} (ckptfs stat --verbose lists them)"
    ]
    assert len(labelled(default, "recent")) == 3
    assert not [mark for mark in INTERNALS if mark in default], default
    # Verbose: every file, every checkpoint with its timings, and the internals.
    assert [line.split()[-1] for line in labelled(verbose, "files")] == names
    recent = labelled(verbose, "recent")
    assert len(recent) == len(names) and all("after the close" in r for r in recent), recent
    assert [mark for mark in INTERNALS if mark not in verbose] == [], verbose
    (store,) = labelled(verbose, "store")
    assert re.fullmatch(rf"store: +{m.backing}; \d+ calls, \d+ slow, 0 timed out", store), store
    assert labelled(default, "health") == labelled(verbose, "health")


@pytest.fixture
def full_shared_store(shared_mounts):  # type: ignore[no-untyped-def]
    """A mount every user may reach, over a 4 MiB tmpfs backing directory."""
    m = shared_mounts()
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4m,mode=0755", "tmpfs", str(m.backing)],
        check=True,
        timeout=30,
    )
    try:
        yield m
    finally:
        m.cleanup()
        subprocess.run(["umount", "-l", str(m.backing)], capture_output=True, timeout=30)


def test_an_ordinary_user_sees_health_and_sums_but_no_other_users_file_names(
    full_shared_store: Mount,
):
    m = full_shared_store
    m.mount()
    m.allowed_log = [
        "No space left on device",
        "health",
        "forced unmount",
        "with data not yet durable",
    ]
    private = m.mnt / "private"
    private.mkdir(mode=0o700)
    job = m.mnt / "job"
    job.mkdir()
    os.chown(job, USER, USER)
    # The user's file, made durable; then root's, too big for the store.
    write = """
        with open(sys.argv[3], "wb") as out:
            out.write(os.urandom(100_000))
        print(json.dumps("written"))
    """
    assert as_user(USER, write, str(job / "mine.pt")) == "written"
    m.wait_durable()
    (private / "salary-2027.pt").write_bytes(os.urandom(16 * MiB))
    wait_for(lambda: m.stat()["backing_health"] == "full", 60, "the store said full")
    whole = m.stat()
    assert "salary-2027.pt" in json.dumps(whole["backing_error"]), whole["backing_error"]

    shown, verbose = (
        r[1] for r in cli_as(USER, m, ["stat", str(m.mnt)], ["stat", str(m.mnt), "-v"])
    )
    for text in (shown, verbose):
        assert "salary" not in text and "private/" not in text, text
        assert "job/mine.pt" in text, text
        # The store's error by its errno and text, without the file that failed.
        assert "store full (ENOSPC: No space left on device, " in text, text
        assert "not shown: 1 cached file" in text, text
    # The sums are the whole mount's, the same as root is told.
    (user_json,) = (json.loads(r[1]) for r in cli_as(USER, m, ["stat", str(m.mnt), "--json"]))
    assert "salary" not in json.dumps(user_json)
    assert user_json["backing_error"]["errno"] == "ENOSPC"
    assert user_json["backing_error"]["error"] == "No space left on device"
    for p in (user_json["progress"], m.stat()["progress"]):
        owed = p["dirty"]["files"] + p["flushing"]["files"]
        assert owed == 1 and p["dirty"]["bytes"] + p["flushing"]["bytes"] == 16 * MiB, p
        assert p["durable"] == {"files": 1, "bytes": 100_000}, p
    (data,) = labelled(shown, "data")
    assert "16.0 MiB" in data and "97.7 KiB durable (1 file)" in data, data
    # Root is shown the file's name.
    assert "salary-2027.pt" in text_of(m)
    m.cli("umount", str(m.mnt), "--force", timeout=60)


ROOT, ALICE = 0, 1001


def cached(path: str, size: int, state: FileState, **kw: Any) -> CachedFile:
    return CachedFile(
        file_id=f"id-{path}",
        version=f"v-{path}",
        path=path,
        size=size,
        mode=0o100600,
        uid=ALICE,
        gid=ALICE,
        mtime_ns=0,
        atime_ns=0,
        page_size=4096,
        state=state,
        **kw,
    )


def test_progress_sums_this_nodes_files_by_state() -> None:
    flushing = cached("f", 1000, FileState.PENDING)
    flushing.flushing = object()  # type: ignore[assignment]  # a snapshot being stored
    flushing.flushed_bytes = 400
    files = [
        cached("d", 100, FileState.MODIFIED),
        cached("m", 10, FileState.PENDING, mirror=MirrorState.ACKED),
        flushing,
        cached("ok", 5000, FileState.DURABLE),
        cached("t", 20, FileState.PENDING, role=FileRole.TAKEOVER),
        # Not this node's to store, or never to be: left out.
        cached("r", 7, FileState.PENDING, role=FileRole.REMOTE),
        cached("l", 9, FileState.LOST),
    ]
    p = progress(files, 0.0)
    assert p == {
        "dirty": {"files": 2, "bytes": 120},
        "mirrored": {"files": 1, "bytes": 10},
        "flushing": {"files": 1, "bytes": 1000, "flushed": 400},
        "durable": {"files": 1, "bytes": 5000},
        "to_store": 730,
        "rate": 0.0,
        "eta_seconds": None,
    }
    assert progress(files, 73.0)["eta_seconds"] == 10.0
    assert progress(files[3:4], 0.0)["eta_seconds"] == 0.0  # nothing to store


def test_the_stores_error_names_its_file_to_root_alone() -> None:
    trouble = {"errno": "ENOSPC", "error": "write manifest private/x.pt: full", "seconds_ago": 3}
    assert StatView(Viewer(ROOT)).backing_error(trouble) == trouble
    assert StatView(Viewer(ALICE)).backing_error(trouble) == {
        "errno": "ENOSPC",
        "error": "No space left on device",
        "seconds_ago": 3,
    }
    assert StatView(Viewer(ALICE)).backing_error(None) is None


def test_the_daemon_logs_json_at_the_level_asked_and_reports_its_version(mounts):
    m = mounts()
    m.mount("--log-level", "debug", env={"CKPTFS_LOG_FORMAT": "json"})
    (m.mnt / "a.bin").write_bytes(os.urandom(10_000))
    m.wait_durable()
    assert json.loads(m.cli("stat", str(m.mnt), "--json").stdout)["version"] == __version__
    m.cli("evict", str(m.mnt))  # an eviction is logged at DEBUG
    (m.mnt / "a.bin").unlink()  # a deletion at INFO
    lines = [json.loads(line) for line in m.log().splitlines() if line.startswith("{")]
    levels = {line["level"] for line in lines}
    assert "DEBUG" in levels and "INFO" in levels, levels
    assert any(line["message"].startswith("evicted ") for line in lines), lines
    assert any(line["level"] == "INFO" and line["message"].startswith("deleted ")
               and "a.bin" in line["message"] for line in lines), lines  # fmt: skip
    assert any(line["message"].startswith("durable: ") and "a.bin" in line["message"]
               for line in lines), lines  # fmt: skip
    assert any(re.fullmatch(r"saved: 'a\.bin' \(10000 bytes, in this node's RAM, [\d.]+s after "
                            r"its open\)", line["message"]) for line in lines), lines  # fmt: skip
    assert all(line["time"].endswith("+00:00") for line in lines)
