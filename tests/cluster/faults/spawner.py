"""Every command the trials run (``ckptfs`` as the operator, a daemon's mount,
``ip``/``tc``, ``fusermount3``) is started from worker processes forked
before the workload opens any file, never from the trial process itself.

Why: a process started from the trial process gets a copy of its descriptor
table, the workload's open files included, and closes that copy at
``exec``. Each such close is a ``close()`` of the file for the filesystem (a
FUSE ``FLUSH``): ckptfs commits what the writer had written so far, as any
close-to-open filesystem would, and a reader on another node may then read
that prefix. The workload's writers would have published versions the
oracle never heard of. (Such a close from a training job's own child
processes is real and allowed: docs/SEMANTICS.md.)

The workers come from a fork server started once, before the first trial
(:func:`start`); ``concurrent.futures`` gives the pool, its queue and its
worker restarts.
"""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import threading
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor

WORKERS = 4  # an operator's command, a restart and a fault's commands at once
SLACK = 30.0  # for the worker itself, beyond the command's own timeout

_pool: ProcessPoolExecutor | None = None
_lock = threading.Lock()


def start() -> None:
    """Start the fork server and one worker now, before any workload file is open."""
    global _pool
    with _lock:
        if _pool is None:
            context = multiprocessing.get_context("forkserver")
            # Each worker in a process group of its own: a Ctrl-C at the
            # terminal interrupts the trials, whose cleanup then needs the
            # workers (to unmount, to remove namespaces) alive.
            _pool = ProcessPoolExecutor(WORKERS, mp_context=context, initializer=os.setpgrp)
    run(["true"], timeout=30)


def stop() -> None:
    global _pool
    with _lock:
        pool, _pool = _pool, None
    if pool is not None:
        pool.shutdown(wait=True, cancel_futures=True)


def run(
    argv: Sequence[str], *, env: dict[str, str] | None = None, timeout: float
) -> subprocess.CompletedProcess[str]:
    """``subprocess.run(argv, capture_output=True, text=True)`` in a worker;
    subprocess.TimeoutExpired after ``timeout`` seconds (the command killed).
    Before :func:`start` (setting up, before any trial) and after :func:`stop`
    it runs from this process."""
    with _lock:
        pool = _pool
    if pool is None:
        return _run(list(argv), env, timeout)
    future = pool.submit(_run, list(argv), env, timeout)
    try:
        return future.result(timeout + SLACK)
    except TimeoutError:
        raise subprocess.TimeoutExpired(list(argv), timeout) from None


def _run(
    argv: list[str], env: dict[str, str] | None, timeout: float
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout)
