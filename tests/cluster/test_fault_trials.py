"""The fault-trial harness (tests/cluster/faults/, docs/FAULT-TRIALS.md): its oracle
catches what it must, the stand-in store's injected faults hold, and a
small fixed-seed run of real trials passes.

The run is marked ``cluster`` (``pytest -m "not cluster"`` leaves it out):
it needs root, network namespaces and FUSE, and takes a few minutes.
"""

from __future__ import annotations

import errno
import os
import shutil
import threading
import time
from pathlib import Path

import pytest
from countingfs import counting_mount
from faults.netns import remove_stale
from faults.oracle import ABSENT, EMPTY, Observed, Oracle, digest
from faults.trials import KINDS, Trials, parse_args, plan_trial
from faults.workload import EventLog

# CI's run: a fixed seed, three nodes, 50 trials (the target: at
# least 50 in at most 5 minutes; about 4 on CI's two cores). The kinds are
# those CI can inject, and they draw every kind
# (test_the_ci_run_meets_every_fault_kind).
CI_SEED = 20261203
CI_TRIALS = 50
CI_KINDS = [
    "none",
    "kill_keep",
    "kill_lost",
    "pair_lost",
    "stop",
    "oneway",
    "loss",
    "store_stall",
    "store_full",
    "store_eio",
    "takeover_restart",
    "restart_store_eio",
]
CI_BUDGET_S = 300.0


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        self.t += 1.0
        return self.t


def oracle() -> Oracle:
    return Oracle(clock=Clock())


def written(o: Oracle, path: str, data: bytes, node: str = "n1", ok: bool = True) -> None:
    op = o.begin("write", path, node, digest(data), data=data)
    o.end(op, ok, "" if ok else "ENOTCONN", holders=(node, "n2") if ok else None)


# ----- the oracle ---------------------------------------------------------------------
def test_a_read_of_a_wrong_byte_is_flagged_with_what_it_is_made_of():
    o = oracle()
    v1, v2 = os.urandom(10000), os.urandom(10000)
    written(o, "a", v1)
    written(o, "a", v2)
    assert o.check_read("a", v1, "n3") is None
    assert o.check_read("a", b"", "n3") is None  # an in-place rewrite truncates first
    bad = bytearray(v2)
    bad[5000] ^= 1
    failure = o.check_read("a", bytes(bad), "n3")
    assert failure is not None and failure.startswith("WRONG BYTES: a read of a on n3")
    assert "none@4096" in failure  # the block with the wrong byte is no version's
    # Stale size, new bytes: a torn read.
    torn = o.check_read("a", v2[:4000], "n3")
    assert torn is not None and f"its first bytes are at {digest(v2)[:12]}+0" in torn
    assert len(o.failures) == 2


def test_a_read_of_a_version_of_another_path_is_wrong():
    o = oracle()
    written(o, "a", b"A" * 100)
    written(o, "b", b"B" * 100)
    assert o.check_read("a", b"B" * 100, "n2") is not None


def test_the_final_check_wants_the_newest_version_durable():
    o = oracle()
    v1, v2 = os.urandom(5000), os.urandom(6000)
    written(o, "a", v1)
    written(o, "a", v2)
    good = {"a": Observed("a", "durable", digest(v2))}
    assert o.verify(good) == []
    old = o.verify({"a": Observed("a", "durable", digest(v1))})
    assert len(old) == 1 and old[0].startswith("NOT NEWEST: a holds")
    pending = o.verify({"a": Observed("a", "pending", digest(v2), holders=("n1", "n2"))})
    assert len(pending) == 1 and pending[0].startswith("NOT DURABLE")
    gone = o.verify({})
    assert len(gone) == 1 and gone[0].startswith("LOST: a is gone")
    stray = o.verify({"a": Observed("a", "durable", digest(v2)), "b": Observed("b", "durable")})
    assert len(stray) == 1 and stray[0].startswith("UNKNOWN FILE: b")


def test_a_loss_is_allowed_only_once_every_holder_lost_its_ram():
    o = oracle()
    written(o, "a", os.urandom(100))  # holders n1, n2
    unreadable = {"a": Observed("a", "pending", None, "EIO", ("n1", "n2"))}
    o.note_ram_lost("n1")
    assert len(o.verify(unreadable)) == 1  # n2 still holds it
    o.note_ram_lost("n2")
    assert o.verify(unreadable) == []


def test_a_write_cut_short_may_lose_the_file_and_a_rename_carries_that():
    o = oracle()
    written(o, "d.tmp/s", os.urandom(100), node="n3", ok=False)
    gone, moved = o.rename("d.tmp/s", "d/s", "n1")
    o.end(gone, True)
    o.end(moved, True)
    assert o.verify({"d/s": Observed("d/s", "pending", None, "EIO", ("n3",))}) == []
    assert o.verify({}) == []  # or it was never there


def test_a_rename_moves_the_version_and_empties_the_old_name():
    o = oracle()
    data = os.urandom(3000)
    written(o, "m.tmp", data)
    gone, moved = o.rename("m.tmp", "m", "n2", kind="replace")
    o.end(gone, True)
    o.end(moved, True)
    assert o.expected("m") == digest(data) and o.determined("m.tmp").effect is ABSENT
    assert o.verify({"m": Observed("m", "durable", digest(data))}) == []
    back = o.verify(
        {"m": Observed("m", "durable", digest(data)), "m.tmp": Observed("m.tmp", "durable", EMPTY)}
    )
    assert len(back) == 1 and back[0].startswith("RESURRECTED: m.tmp")


def test_overlapping_writes_from_two_nodes_may_end_with_either():
    o = oracle()
    v1, v2 = os.urandom(100), os.urandom(100)
    a = o.begin("write", "s", "n1", digest(v1), data=v1)
    b = o.begin("write", "s", "n2", digest(v2), data=v2)
    o.end(a, True, holders=("n1", "n2"))
    o.end(b, True, holders=("n2", "n3"))
    assert o.determined("s") is None
    for v in (v1, v2):
        assert o.verify({"s": Observed("s", "durable", digest(v))}) == []


# ----- the plan -----------------------------------------------------------------------
def test_a_trial_plan_depends_on_the_seed_and_the_trial_only():
    names = ["n1", "n2", "n3", "n4"]
    kinds = list(KINDS)
    assert plan_trial(5, 7, names, kinds, 3.0) == plan_trial(5, 7, names, kinds, 3.0)
    # ... and on the seed: another seed plans other trials.
    assert [plan_trial(5, k, names, kinds, 3.0) for k in range(20)] != [
        plan_trial(6, k, names, kinds, 3.0) for k in range(20)
    ]
    plans = {plan_trial(5, k, names, kinds, 3.0).kind for k in range(300)}
    assert plans == set(kinds)


def test_the_ci_run_meets_every_fault_kind():
    """CI's short run still injects every kind of fault it may: also where
    "loss" is left out (no netem and no iptables), which changes the draws."""
    names = ["n1", "n2", "n3"]
    for kinds in (CI_KINDS, [k for k in CI_KINDS if k != "loss"]):
        drawn = {plan_trial(CI_SEED, k, names, kinds, 1.5).kind for k in range(CI_TRIALS)}
        assert drawn == set(kinds), set(kinds) - drawn


# ----- the stand-in store's faults --------------------------------------------------
def test_the_stand_in_store_stalls_fills_and_fails_on_command(tmp_path: Path):
    with counting_mount(tmp_path / "real", tmp_path / "mnt", faults=True) as store:
        f = store.mountpoint / "x"
        f.write_bytes(b"hello")
        store.inject("enospc")
        with pytest.raises(OSError) as exc:
            (store.mountpoint / "y").write_bytes(b"no room")
        assert exc.value.errno == errno.ENOSPC
        assert f.read_bytes() == b"hello"  # reads still work on a full store
        store.inject("eio")
        with pytest.raises(OSError) as exc:
            f.read_bytes()
        assert exc.value.errno == errno.EIO
        assert sorted(os.listdir(store.mountpoint)) == ["x"]  # names still work
        store.inject("stall")
        done = threading.Event()
        threading.Thread(target=lambda: (os.stat(f), done.set()), daemon=True).start()
        assert not done.wait(0.5)  # the stat waits while the store stalls
        store.inject("ok")
        assert done.wait(10)
        assert f.read_bytes() == b"hello"


def test_the_stand_in_store_lists_a_directory_kept_open_as_it_is_now(tmp_path: Path):
    """A directory fd kept open (as a daemon keeps .ckptfs/renamed) lists
    entries made after it was opened, as an NFS server's READDIR does."""
    with counting_mount(tmp_path / "real", tmp_path / "mnt") as store:
        d = store.mountpoint / "d"
        d.mkdir()
        fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
        try:
            assert os.listdir(fd) == []
            (d / "new").write_bytes(b"")
            assert os.listdir(fd) == ["new"]
        finally:
            os.close(fd)


def test_the_stand_in_store_answers_estale_for_a_file_renamed_over(tmp_path: Path):
    """A GETATTR of the old file's inode, after a rename put another file at
    its name and nothing has it open, is ESTALE (as on NFS: the kernel looks
    the name up again), not an I/O error."""
    import pyfuse3
    import trio
    from countingfs import CountingFS

    (tmp_path / "a").write_bytes(b"old")
    (tmp_path / "b").write_bytes(b"new")

    async def main() -> int:
        fs = CountingFS(tmp_path)
        old = await fs.lookup(pyfuse3.ROOT_INODE, b"a")
        await fs.rename(pyfuse3.ROOT_INODE, b"b", pyfuse3.ROOT_INODE, b"a", 0, None)
        with pytest.raises(pyfuse3.FUSEError) as exc:
            await fs.getattr(old.st_ino)
        with pytest.raises(pyfuse3.FUSEError) as exc_open:
            await fs.open(old.st_ino, os.O_RDONLY, None)
        return exc.value.errno, exc_open.value.errno

    assert trio.run(main) == (errno.ESTALE, errno.ESTALE)


# ----- a run of real trials -------------------------------------------------------------
def cluster_run_possible() -> str | None:
    if os.geteuid() != 0:
        return "needs root"
    for tool in ("ip", "nsenter", "fusermount3"):
        if shutil.which(tool) is None:
            return f"needs {tool}"
    return None


@pytest.mark.skipif(cluster_run_possible() is not None, reason=str(cluster_run_possible()))
def test_fault_trials_with_a_fixed_seed(tmp_path: Path):
    """CI's run (docs/FAULT-TRIALS.md): CI_TRIALS trials of seed CI_SEED on three
    nodes, each a fault of CI_KINDS; every failure is printed with its seed,
    trial and event log."""
    remove_stale()
    lines: list[str] = []
    args = parse_args(
        [
            "--trials",
            str(CI_TRIALS),
            "--seed",
            str(CI_SEED),
            "--nodes",
            "3",
            "--work",
            "1.5",
            "--workdir",
            str(tmp_path / "work"),
            "--kinds",
            ",".join(CI_KINDS),
            "--keep-going",
        ]  # fmt: skip
    )
    start = time.monotonic()
    code = Trials(args, out=lambda line: (lines.append(line), print(line))).run()
    took = time.monotonic() - start
    assert code == 0, "\n".join(lines)
    assert sum(line.startswith("trial ") for line in lines) == CI_TRIALS
    print(f"{CI_TRIALS} trials in {took:.0f}s")
    assert took < CI_BUDGET_S + 120, f"{CI_TRIALS} trials took {took:.0f}s"


class CheckSays:
    """The edge the harness reads ``ckptfs check`` through: a canned answer."""

    def __init__(self, code: int, out: str) -> None:
        self.answer = (code, out)

    def check(self, name: str, rel: str) -> tuple[int, str]:
        return self.answer


def test_check_must_name_exactly_the_lost_files_and_never_an_empty_pending_one():
    trials = Trials(parse_args(["--nodes", "3"]))
    trials.observed = {
        "t/lost.pt": Observed("t/lost.pt", "pending", None, "EIO", ("n1",), 10),
        "t/empty.pt": Observed("t/empty.pt", "pending", digest(b""), "", ("n1",), 0),
        "t/ok.pt": Observed("t/ok.pt", "durable", digest(b"x"), "", ("n1",), 1),
    }
    lost = "ckptfs: error: /m/t/lost.pt: pending, 10 bytes, holders n1, age 3s: lost: ..."
    empty_ok = "/m/t/empty.pt: pending, 0 bytes, holders n1, age 3s: empty, nothing to lose"
    empty_lost = "ckptfs: error: /m/t/empty.pt: pending, 0 bytes, holders n1, age 3s: lost: ..."
    summary = "checked 3 manifest(s)"

    def judged(code: int, *lines: str) -> list[str]:
        cluster = CheckSays(code, "\n".join([*lines, summary]))
        return trials.check_agrees(cluster, Oracle(), "t", EventLog())  # type: ignore[arg-type]

    assert judged(1, lost, empty_ok) == []
    assert judged(1, lost, empty_lost) != []  # an empty file has nothing to lose
    assert judged(0, empty_ok) != []  # the lost file is not named
    assert judged(0, lost) != []  # named, yet exit 0
