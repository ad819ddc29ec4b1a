"""``ckptfs history`` (tools/history.py, fs/store/history.py): every node's
checkpoints in UTC, a job user's own alone, root's all; filters by path and
time; a history file of another format kept and read."""

from __future__ import annotations

import json
import os
import time
from datetime import UTC, datetime
from pathlib import Path

from test_control_users import cli_as
from users import USER, run_as
from waits import wait_for

DRAIN = """
path = sys.argv[3]
with open(path, "wb") as f:
    f.write(os.urandom(int(sys.argv[4])))
print(json.dumps(True))
"""


def test_a_user_sees_their_own_lines_of_every_node_and_root_sees_all(shared_mounts) -> None:  # type: ignore[no-untyped-def]
    n1, n2 = shared_mounts("n1"), shared_mounts("n2")  # one backing directory, not peers
    for m in (n1, n2):
        m.mount("--node", m.mnt.name.split("-")[0])
    before = time.time()
    (n1.mnt / "job").mkdir()
    os.chown(n1.mnt / "job", USER, USER)
    (n1.mnt / "root").mkdir()
    (n1.mnt / "root" / "a.pt").write_bytes(os.urandom(5000))
    run_as(USER, USER, DRAIN, str(n2.mnt / "job" / "b.pt"), "7000")
    run_as(USER, USER, DRAIN, str(n1.mnt / "job" / "c.pt"), "3000")
    for m in (n1, n2):
        m.wait_durable()
    root = json.loads(n1.cli("history", str(n1.mnt), "--json").stdout)
    assert [(x["node"], x["path"], x["size"]) for x in root] == [
        ("n1", "root/a.pt", 5000), ("n2", "job/b.pt", 7000), ("n1", "job/c.pt", 3000),
    ]  # fmt: skip
    for x in root:
        when = datetime.fromisoformat(x["time"])
        assert when.utcoffset().total_seconds() == 0 and when.timestamp() >= before - 1
        assert x["durable_s"] is not None and x["close_s"] is not None
    assert {x["uid"] for x in root} == {0, USER}
    # The user: their own files, written on either node; not root's.
    ((code, out, err, _),) = cli_as(USER, n2, ["history", str(n2.mnt), "--json"])
    assert code == 0, err
    assert [x["path"] for x in json.loads(out)] == ["job/b.pt", "job/c.pt"]
    # The table, by path, as the user.
    ((code, out, err, _),) = cli_as(USER, n1, ["history", str(n1.mnt / "job")])
    assert code == 0, err
    header, *rows = out.splitlines()
    assert header.split() == ["time", "(UTC)", "node", "size", "close", "mirrored",
                              "durable", "path"]  # fmt: skip
    assert [r.split()[-1] for r in rows] == ["job/b.pt", "job/c.pt"]
    assert rows[0].split()[2] == "n2" and "6.8 KiB" in rows[0]
    # Filters: by time (an age, an ISO time), by path, the newest N.
    assert n1.cli("history", str(n1.mnt), "--since", "1d").stdout.count(".pt") == 3
    future = datetime.fromtimestamp(time.time() + 3600, UTC).strftime("%Y-%m-%dT%H:%M")
    assert "no checkpoint" in n1.cli("history", str(n1.mnt), "--since", future).stdout
    assert n1.cli("history", str(n1.mnt), "--until", "2020-01-01").stdout.count(".pt") == 0
    last = json.loads(n1.cli("history", str(n1.mnt / "root"), "--json").stdout)
    assert [x["path"] for x in last] == ["root/a.pt"]
    newest = json.loads(n1.cli("history", str(n1.mnt), "--json", "--limit", "1").stdout)
    assert [x["path"] for x in newest] == ["job/c.pt"]
    bad = n1.cli("history", str(n1.mnt), "--since", "yesterday", check=False)
    assert bad.returncode == 1 and "neither an age" in bad.stderr


def test_a_history_of_another_format_is_kept_and_read_for_root_alone(mounts) -> None:  # type: ignore[no-untyped-def]
    m = mounts()
    history = m.backing / ".ckptfs" / "history"
    history.mkdir(parents=True, mode=0o700)
    (m.backing / ".ckptfs").chmod(0o700)
    node = "n1"
    # An older release's file: local times, no uid column; and a broken line.
    (history / f"{node}.csv").write_text(
        "time,path,size,close_s,mirrored_s,durable_s,throughput_MBps\n"
        "2026-11-30T10:00:00,old/x.pt,100,0.1,,0.2,1.0\n"
        "garbage,,,\n"
    )
    m.allowed_log = ["had another format", "do not parse"]
    m.mount("--node", node)
    (m.mnt / "new.pt").write_bytes(os.urandom(2000))
    m.wait_durable()
    wait_for(lambda: len(list(history.iterdir())) == 2, 30, "the old history set aside")
    old, new = sorted(history.iterdir(), key=lambda p: not p.name.startswith("old-"))
    assert old.name.startswith("old-") and old.name.endswith(f"-{node}.csv"), old
    assert new.name == f"{node}.csv"
    assert (history / f"{node}.csv").read_text().splitlines()[0].endswith(",uid")
    lines = json.loads(m.cli("history", str(m.mnt), "--json").stdout)
    assert [(x["node"], x["path"], x["uid"]) for x in lines] == [
        (node, "old/x.pt", None), (node, "new.pt", 0),
    ]  # fmt: skip
    local = datetime.fromisoformat("2026-11-30T10:00:00").astimezone()
    assert datetime.fromisoformat(lines[0]["time"]) == local
    assert "1 line(s) that do not parse were skipped" in m.log()


def test_a_symlink_in_the_history_directory_is_not_followed(mounts, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    m = mounts()
    m.mount("--node", "n1")
    (m.mnt / "a.pt").write_bytes(b"x" * 10)
    m.wait_durable()
    wait_for(lambda: (m.backing / ".ckptfs" / "history" / "n1.csv").exists(), 30, "history")
    secret = tmp_path / "secret.csv"
    secret.write_text("time,path,size,uid\n2026-01-01T00:00:00+00:00,stolen,1,0\n")
    (m.backing / ".ckptfs" / "history" / "evil.csv").symlink_to(secret)
    m.allowed_log = ["evil.csv"]
    lines = json.loads(m.cli("history", str(m.mnt), "--json").stdout)
    assert [x["path"] for x in lines] == ["a.pt"]
    assert "evil.csv" in m.log()


def test_crafted_history_files_are_skipped_and_the_rest_is_shown(mounts) -> None:  # type: ignore[no-untyped-def]
    """The store's history files are written by other nodes: a field too
    long for csv, a FIFO (never opened, so never waited on), a name that
    only looks like a set-aside file, lines that do not parse."""
    m = mounts()
    m.mount("--node", "n1")
    (m.mnt / "a.pt").write_bytes(b"x" * 10)
    m.wait_durable()
    history = m.backing / ".ckptfs" / "history"
    wait_for(lambda: (history / "n1.csv").exists(), 30, "history")
    header = "time,path,size,close_s,mirrored_s,durable_s,throughput_MBps,uid\n"
    (history / "n9.csv").write_text(header + f"2026-12-01T00:00:00+00:00,{'y' * 200_000},1,,,,,0\n")
    os.mkfifo(history / "fifo.csv")
    (history / "old-x.csv").write_text(
        header
        + "2026-12-01T00:00:00+00:00,from/old-x.pt,5,0.1,,0.2,1.0,0\n"
        + "2026-12-01T00:00:00+00:00,/absolute.pt,5,0.1,,0.2,1.0,0\n"  # not a path in the store
        + "2026-12-01T00:00:00+00:00,neg.pt,-5,0.1,,0.2,1.0,0\n"
        + "2026-12-01T00:00:00+00:00,big.pt,"
        + "9" * 5000
        + ",0.1,,0.2,1.0,0\n"
    )
    m.allowed_log = ["history"]
    start = time.monotonic()
    lines = json.loads(m.cli("history", str(m.mnt), "--json").stdout)
    assert time.monotonic() - start < 30
    assert [(x["node"], x["path"]) for x in lines] == [("old-x", "from/old-x.pt"), ("n1", "a.pt")]
    log = m.log()
    assert "n9.csv: skipped" in log and "fifo.csv: skipped" in log
    assert "old-x.csv: 3 line(s) that do not parse were skipped" in log
