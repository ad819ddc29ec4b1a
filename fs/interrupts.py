"""A caller's signal (FUSE_INTERRUPT) ends the waits that may end early.

When a process blocked in a FUSE request gets a signal (Ctrl-C of a training
job stuck in a save), the kernel sends FUSE_INTERRUPT naming that request and
keeps the process waiting for the reply. Ignoring it leaves Ctrl-C without
effect for as long as the wait lasts: a write in backpressure while the
backing store is down, a close at ``durability: backing``, a read of a
chunk from a store that hangs. (The kernel sends INTERRUPT only for a
request its caller waits for itself: never for the read-ahead behind a
buffered read, which only SIGKILL ends, nor, with ASYNC_DIO, for O_DIRECT
I/O, which is why the session does not ask for it.)

Only signals that ask the process to stop count: SIGINT, SIGTERM, SIGHUP,
SIGQUIT, and any fatal one (the kernel then marks SIGKILL pending, and
without a reply the killed process would stay blocked until the wait ended).
The kernel sends INTERRUPT for every signal the process catches, and a
training process catches others all the time (DataLoader's SIGCHLD handler
when a worker exits, profilers' timers); a local disk's write or close never
fails with EINTR, so programs do not retry them (libstdc++ retries a write,
not a close): those signals leave ckptfs's waits alone, as NFS has done for
every signal but SIGKILL since ``intr`` went away. The pending signals are
read from /proc (:func:`stop_requested`).

Only waits that opt in end early, with :func:`interruptible`: a request
handler is never cancelled at an arbitrary await, where its state changes
could be half done. An interrupted wait raises :class:`Interrupted` (EINTR),
which the handler turns into its reply: a write returns the bytes it wrote
before the wait (a short write) or EINTR, a close returns EINTR with the file
published and on its way to the backing store.

The session (fusesession.py) marks each request it hands to a handler with
:func:`handling`, and calls :meth:`InFlight.interrupt` when the kernel
interrupts it. Outside a handler (the flusher, peers' requests, tests
driving the cache) :func:`interruptible` does nothing.
"""

from __future__ import annotations

import errno
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import trio


class Interrupted(OSError):
    """A wait ended early by the caller's signal."""

    def __init__(self, what: str) -> None:
        super().__init__(errno.EINTR, f"{what}: interrupted by the caller's signal")


# Signals that ask a process to stop; SIGKILL also stands for any fatal one.
STOP_SIGNALS = frozenset(
    {signal.SIGHUP, signal.SIGINT, signal.SIGQUIT, signal.SIGKILL, signal.SIGTERM}
)


def stop_requested(tid: int, proc: str = "/proc") -> bool:
    """Whether thread ``tid`` (a FUSE request's caller) has a stop signal
    pending, its own or its process's. A caller that is gone waits for
    nothing: True. One the daemon cannot see (0: another PID namespace) or
    whose status cannot be read: False, the waits go on as before."""
    if tid <= 0:
        return False
    try:
        # procfs, in memory: read on the loop (INTERRUPTs are rare).
        with open(f"{proc}/{tid}/status", "rb") as status:
            lines = status.read().splitlines()
    except FileNotFoundError:
        return True
    except OSError:
        return False
    pending = 0
    for line in lines:
        if line.startswith((b"SigPnd:", b"ShdPnd:")):
            pending |= int(line.split()[1], 16)
    return any(pending >> (sig - 1) & 1 for sig in STOP_SIGNALS)


class InFlight:
    """One request being handled: whether its caller was interrupted, and the
    interruptible wait it is in, if any."""

    def __init__(self, unique: int, caller: int = 0) -> None:
        self.unique = unique
        self.caller = caller  # the calling thread's id, as the kernel gave it
        self.interrupted = False
        # Only the handler's own task: a task it starts inherits the context
        # variable, and must not be ended by this caller's signal.
        self.task = trio.lowlevel.current_task()
        self._waits: set[trio.CancelScope] = set()

    def interrupt(self) -> None:
        self.interrupted = True
        for scope in self._waits:
            scope.cancel()


_current: ContextVar[InFlight | None] = ContextVar("ckptfs_request", default=None)


@contextmanager
def handling(unique: int, caller: int = 0) -> Iterator[InFlight]:
    """Mark the current task as handling request ``unique`` of thread
    ``caller`` (by the session)."""
    inflight = InFlight(unique, caller)
    token = _current.set(inflight)
    try:
        yield inflight
    finally:
        _current.reset(token)


@contextmanager
def interruptible(what: str) -> Iterator[None]:
    """A wait that the caller's signal may end: raises :class:`Interrupted`
    (naming ``what``) if the request was or gets interrupted before the body
    is done."""
    inflight = _current.get()
    if inflight is None or inflight.task is not trio.lowlevel.current_task():
        yield
        return
    if inflight.interrupted:
        raise Interrupted(what)
    with trio.CancelScope() as scope:
        inflight._waits.add(scope)
        try:
            yield
        finally:
            inflight._waits.discard(scope)
    if scope.cancelled_caught:
        raise Interrupted(what)
