"""Progress of `ckptfs flush --wait` and `umount` (tools/progress.py): a bar
on a terminal (read through a pty), a line every few seconds off one, a
summary at the end; `stat --watch` bars."""

from __future__ import annotations

import os
import pty
import re
import select
import subprocess
import sys
import time

from ckptfs.tools.progress import bars, left_to_store
from conftest import Mount, is_mounted, wait_for

MiB = 1 << 20


def paced(mounts, rate: str = "2MiB") -> Mount:  # type: ignore[no-untyped-def]
    """A mount whose flush stores ``rate`` per second: a drain lasts seconds."""
    m = mounts()
    m.mount(env={"CKPTFS_FLUSH_BANDWIDTH": rate})
    return m


def on_a_terminal(m: Mount, *args: str, timeout: float = 90) -> tuple[int, str]:
    """``ckptfs ARGS`` with a pty as stdout and stderr: its exit code and
    everything it wrote (with the terminal's control sequences)."""
    leader, follower = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "ckptfs", *args], stdin=subprocess.DEVNULL,
                            stdout=follower, stderr=follower, env=m.env)  # fmt: skip
    os.close(follower)
    out = b""
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([leader], [], [], 0.5)
            if ready:
                try:
                    piece = os.read(leader, 1 << 16)
                except OSError:  # EIO: the child closed the terminal
                    break
                if not piece:
                    break
                out += piece
            elif proc.poll() is not None:
                break
        return proc.wait(timeout=max(1.0, deadline - time.monotonic())), out.decode(
            errors="replace"
        )
    finally:
        os.close(leader)
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)


def test_on_a_terminal_flush_and_umount_show_a_bar_then_a_summary(mounts) -> None:  # type: ignore[no-untyped-def]
    m = paced(mounts, "4MiB")  # 4 MiB chunks: the bar moves a chunk at a time
    (m.mnt / "a.pt").write_bytes(os.urandom(24 * MiB))
    code, out = on_a_terminal(m, "flush", str(m.mnt), "--wait")
    assert code == 0, out
    # tqdm's bar: a percentage, bytes stored of those left when it began
    # (the flush started at the close), a rate; then the summary.
    assert re.search(r"\rflushing: +[1-9]\d*%\|.*\| [\d.]+M?/[\d.]+MiB \[.*MiB/s\]", out), out
    assert re.search(r"flushing .*: [\d.]+ MiB stored in \d+\.\ds \([\d.]+ [KM]iB/s\)", out), out
    assert "1 file(s) durable under" in out
    (m.mnt / "b.pt").write_bytes(os.urandom(16 * MiB))
    code, out = on_a_terminal(m, "umount", str(m.mnt))
    assert code == 0, out
    assert re.search(r"\runmounting: +\d+%\|", out), out
    assert re.search(r"unmounting .*: [\d.]+ MiB stored in ", out), out
    assert f"unmounted {m.mnt}" in out
    assert not is_mounted(m.mnt)


def test_off_a_terminal_a_long_flush_logs_lines_then_a_summary(mounts) -> None:  # type: ignore[no-untyped-def]
    m = paced(mounts, "1MiB")
    (m.mnt / "a.pt").write_bytes(os.urandom(14 * MiB))
    start = time.monotonic()
    done = m.cli("flush", str(m.mnt / "a.pt"), "--wait")  # pipes, as in a Slurm epilog
    took = time.monotonic() - start
    lines = done.stderr.splitlines()
    periodic = [x for x in lines if "left to store" in x]
    # A line each 5 s of the drain (about 10 s at 1 MiB/s), none of them a bar.
    assert took > 6 and 1 <= len(periodic) <= took / 5 + 1, (took, lines)
    assert all(re.fullmatch(r"flushing \S+: [\d.]+ [KM]?i?B left to store, [\d.]+ [KM]?i?B/s"
                            r"(, about \d+s left)?", x) for x in periodic), periodic  # fmt: skip
    assert re.fullmatch(r"flushing \S+a\.pt: [\d.]+ MiB stored in [\d.]+s \([\d.]+ [KM]iB/s\)",
                        lines[-1]), lines  # fmt: skip
    assert "\r" not in done.stderr and "%|" not in done.stderr
    assert done.stdout.strip() == f"1 file(s) durable under {m.mnt / 'a.pt'}"
    # Nothing left to store: no progress, no summary, the one result line.
    again = m.cli("flush", str(m.mnt), "--wait")
    assert again.stderr == "" and again.stdout.strip().endswith(f"durable under {m.mnt}"), again


def test_stat_watch_bars_and_the_bytes_left_of_the_files_asked_about(mounts) -> None:  # type: ignore[no-untyped-def]
    m = paced(mounts, "1MiB")
    (m.mnt / "a.pt").write_bytes(os.urandom(6 * MiB))
    wait_for(lambda: m.file_state("a.pt") == "flushing", 30, "a.pt flushing")
    reply = m.stat()
    (line,) = bars(reply["files"], width=100)
    assert re.fullmatch(r"flushing a\.pt: +\d+%\|.*\| [\d.]+[kM]?/6\.00MiB", line), line
    left = left_to_store({**reply, "ok": True}, whole_mount=False)
    (f,) = reply["files"]
    assert left == 6 * MiB - f["flushed_bytes"] > 0
    assert left_to_store(reply, whole_mount=True) == reply["progress"]["to_store"]
    m.wait_durable()
    assert bars(m.stat()["files"]) == []


def test_gc_on_a_terminal_counts_what_it_walks_then_reports(mounts) -> None:  # type: ignore[no-untyped-def]
    m = mounts()
    m.mount()
    for i in range(3):
        (m.mnt / f"{i}.pt").write_bytes(os.urandom(5 * MiB))
    m.wait_durable()
    (m.mnt / "0.pt").unlink()  # its two chunks become garbage
    m.umount()
    code, out = on_a_terminal(m, "gc", str(m.backing), "--grace", "0")
    assert code == 0, out
    assert re.search(r"manifests read: 2", out), out
    assert re.search(r"store files looked at: [1-9]", out), out
    assert re.search(
        r"would remove 2 chunk file\(s\), \d+ bytes; \d+ referenced by 2 manifest", out
    )
    # Off a terminal: the report alone.
    done = m.cli("gc", str(m.backing), "--grace", "0")
    assert "manifests read" not in done.stdout + done.stderr
    assert done.stdout.splitlines()[-1] == "nothing was removed: run with --delete to remove them"
