"""An ordinary user, and code run as one in a child process."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from typing import Any

USER, GROUP = 65534, 65534  # nobody:nogroup
OTHER = 65533  # another ordinary user (a mountpoint's owner, a second job)


# Imported and exercised as root, before the child drops its privileges (the
# interpreter's directories may be root's alone): the CLI, and torch warmed up.
IMPORTS = """
import contextlib, errno, json, os, shutil, stat, sys, io, time
import torch
buf = io.BytesIO(); torch.save({"w": torch.zeros(4)}, buf); buf.seek(0); torch.load(buf)
from ckptfs.tools import cli, control
"""

DROP = """
uid, gid = int(sys.argv[1]), int(sys.argv[2])
os.setgroups([]); os.setgid(gid); os.setuid(uid)
os.umask(0o022)
"""


def run_as(
    uid: int, gid: int, code: str, *args: str, imports: str = IMPORTS, timeout: float = 120
) -> Any:
    """Run ``code`` as uid:gid in a new interpreter, after ``imports`` ran as
    root; its arguments are ``sys.argv[3:]``. It prints one JSON value, the
    last line of its output, which is returned."""
    script = imports + DROP + textwrap.dedent(code)
    proc = subprocess.run(
        [sys.executable, "-c", script, str(uid), str(gid), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, f"as {uid}:{gid} failed:\n{proc.stderr}{proc.stdout}"
    return json.loads(proc.stdout.strip().splitlines()[-1])
