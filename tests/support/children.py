"""Child processes a test drives line by line: each prints a line at each
step, and the test waits for it (bounded), signals it, or tells it to go on."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import time

TIMEOUT = 60


def next_line(child: subprocess.Popen, timeout: float = TIMEOUT) -> str:
    """The child's next line of output, stripped, waited for at most
    ``timeout`` seconds in all. Read byte by byte from the pipe itself: a
    buffered ``readline`` could take several lines into its buffer, where a
    later ``select`` would not see them."""
    assert child.stdout is not None
    fd = child.stdout.fileno()
    deadline = time.monotonic() + timeout
    line = bytearray()
    while not line.endswith(b"\n"):
        left = deadline - time.monotonic()
        ready, _, _ = select.select([fd], [], [], max(left, 0))
        assert ready, f"the child printed no whole line within {timeout}s: {bytes(line)!r}"
        byte = os.read(fd, 1)
        assert byte, f"the child closed its output after {bytes(line)!r} (exit {child.poll()})"
        line += byte
    return line.decode().strip()


def interrupt(writer: subprocess.Popen[str], line: str) -> float:
    """SIGINT, then the seconds until the writer printed ``line``."""
    start = time.monotonic()
    writer.send_signal(signal.SIGINT)
    assert next_line(writer) == line
    return time.monotonic() - start


def stop(writer: subprocess.Popen[str]) -> None:
    """Killed, if it still runs, and reaped."""
    if writer.poll() is None:
        writer.kill()
        writer.wait(10)


def go(reader: subprocess.Popen[str]) -> None:
    """Tell a child waiting on its standard input to go on."""
    assert reader.stdin is not None
    reader.stdin.write("go\n")
    reader.stdin.flush()
