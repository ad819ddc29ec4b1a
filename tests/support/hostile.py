"""An ordinary user who floods a control socket with idle connections.

``flood(path, uid, n)`` starts a child process that connects ``n`` times to
the Unix socket ``path`` as ``uid`` (it drops from root after starting, since
the interpreter may not be readable by that user), never sends a byte, and
connects again whenever the daemon closes one of them, until it is killed.
It prints one line once its first round of connections is made.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from children import next_line

FLOOD = r"""
import os, selectors, socket, sys, time
path, uid, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
os.setgroups([]); os.setgid(uid); os.setuid(uid)
sel = selectors.DefaultSelector()

def connect():
    # Non-blocking: a full backlog answers EAGAIN at once; try again for 5 s.
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.setblocking(False)
    deadline = time.monotonic() + 5
    while True:
        try:
            s.connect(path)
            break
        except BlockingIOError:
            if time.monotonic() > deadline:
                s.close()
                return False
            time.sleep(0.001)
        except OSError:
            s.close()
            return False
    sel.register(s, selectors.EVENT_READ)
    return True

made = sum(connect() for _ in range(n))
print(f"connected {made}", flush=True)
while True:
    for key, _ in sel.select(timeout=1):
        s = key.fileobj
        try:
            data = s.recv(65536)
        except BlockingIOError:
            continue
        except OSError:
            data = b""
        if not data:  # closed by the daemon: renew it
            sel.unregister(s)
            s.close()
            connect()
"""


@contextmanager
def flood(path: str, uid: int, n: int) -> Iterator[subprocess.Popen[str]]:
    proc = subprocess.Popen(
        [sys.executable, "-c", FLOOD, path, str(uid), str(n)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = next_line(proc)
        assert line.startswith("connected"), f"flood did not start: {line}"
        yield proc
    finally:
        proc.kill()
        proc.wait(10)
