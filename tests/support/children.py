"""Child processes a test drives line by line: each prints a line at each
step, and the test waits for it (bounded), signals it, or tells it to go on."""

from __future__ import annotations

import select
import signal
import subprocess
import time

TIMEOUT = 60


def next_line(writer: subprocess.Popen[str], timeout: float = TIMEOUT) -> str:
    """The writer's next line of output, waited for at most ``timeout`` seconds."""
    assert writer.stdout is not None
    ready, _, _ = select.select([writer.stdout], [], [], timeout)
    assert ready, f"the writer printed nothing within {timeout}s"
    return writer.stdout.readline().strip()


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
