"""The daemon's signals, as a node's shutdown (systemd stop, a Slurm epilog,
`kubectl delete pod`) sends them: the first SIGTERM flushes everything and
unmounts; a second one unmounts without waiting, even while a writer's close
waits for a slow store, and what was not durable is recovered by the next
mount."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

from children import next_line
from mounts import is_mounted, process_gone
from waits import wait_for

WRITER = textwrap.dedent(
    """
    import os, sys
    path, size = sys.argv[1], int(sys.argv[2])
    data = os.urandom(size)
    with open(sys.argv[3], "wb") as f:
        f.write(data)
    f = open(path, "wb")
    f.write(data)
    print("written", flush=True)
    try:
        f.close()  # durability backing: waits until the store has it
        print("closed", flush=True)
    except OSError as exc:
        print("close failed", exc.errno, flush=True)
    """
)


def test_sigterm_flushes_everything_then_unmounts(mounts):
    m = mounts()
    m.mount()
    data = os.urandom(3 << 20)
    (m.mnt / "ckpt.pt").write_bytes(data)
    os.kill(m.pid, signal.SIGTERM)
    wait_for(lambda: process_gone(m.pid), 60, "the daemon's exit")
    assert not is_mounted(m.mnt)
    assert "signal SIGTERM: flushing, then unmounting" in m.log()
    assert "everything was durable" in m.log()
    m.mount()
    assert (m.mnt / "ckpt.pt").read_bytes() == data
    assert m.file_state("ckpt.pt") == "durable"


def test_a_second_sigterm_unmounts_without_waiting(mounts, tmp_path):
    m = mounts()
    # A store at 1 KiB/s (its first chunk goes at once, the next after an hour):
    # the close of a 9 MiB file, at durability backing, waits.
    m.mount("--durability", "backing", env={"CKPTFS_FLUSH_BANDWIDTH": "1KiB"})
    m.allowed_log = ["second signal", "with data not yet durable"]
    expected = tmp_path / "expected"
    writer = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(m.mnt / "ckpt.pt"), str(9 << 20), str(expected)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert writer.stdout is not None
        assert next_line(writer) == "written"
        time.sleep(0.5)
        assert writer.poll() is None  # still in close()
        os.kill(m.pid, signal.SIGTERM)
        wait_for(lambda: "flushing, then unmounting" in m.log(), 10, "the first signal")
        time.sleep(0.5)
        assert not process_gone(m.pid) and writer.poll() is None  # the drain waits for the store
        os.kill(m.pid, signal.SIGTERM)
        wait_for(lambda: process_gone(m.pid), 20, "the daemon's exit after the second signal")
        out, _ = writer.communicate(timeout=20)
    finally:
        if writer.poll() is None:
            writer.kill()
    # The close did not report success: its data was not in the store.
    assert out.split()[:2] == ["close", "failed"], out
    assert not is_mounted(m.mnt)
    assert "second signal: unmounting without waiting" in m.log()
    # The next mount recovers the file from the cache and flushes it.
    m.mount()
    assert "1 file(s) recovered" in m.log()
    m.wait_durable()
    assert (m.mnt / "ckpt.pt").read_bytes() == expected.read_bytes()
    assert m.file_state("ckpt.pt") == "durable"
