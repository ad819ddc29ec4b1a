"""Running blocking backing-store calls off the event loop, with a timeout.

Any call that touches NFS can hang. It runs in a worker thread under a time
limit; a thread stuck in the kernel cannot be cancelled, so the number of such
threads is bounded and the store's health (normal / slow / down) is tracked,
both for `ckptfs stat` and so that callers stop piling requests onto it.

A call the loop gave up on still runs to its end in its thread. Two things
make that safe: ``late`` releases whatever the call holds once it ends (an fd
opened after its caller left, pins on arena slots), and ``Call.abandoned``
lets the function see, before an irreversible step (a manifest rename), that
nobody is waiting any more. A FUSE caller interrupted by a signal may give
up on a call the same way (``interruptible``, interrupts.py).
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from collections.abc import Callable
from contextlib import nullcontext
from typing import Generic, TypeVar

import trio
from ckptfs.fs.interrupts import interruptible as interrupted_by_caller

T = TypeVar("T")
log = logging.getLogger("ckptfs.backing")
DOWN_PROBE_INTERVAL = 5.0
# Errors that say the store cannot take what is written (full), or is
# failing; the health says so until a write succeeds, or this long passes
# without another such error (a read's success proves no space).
FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
FAILING_ERRNOS = frozenset({errno.EIO, errno.EROFS})
TROUBLE_HOLD = 30.0
# How much lower than the daemon's own the CPU priority of a thread doing
# background work (a flush) is, for as long as it does it: the threads serve
# FUSE requests too, and those keep the daemon's priority.
BACKGROUND_NICE = 10


class BackingTimeout(OSError):
    pass


class _GivenUp(Exception):
    """A thread began a call the loop had given up on: it is not made."""


class Call(Generic[T]):
    """One blocking call, shared between the loop and its thread.

    ``late`` runs exactly once if the loop abandoned the call (timeout or
    cancellation), in a thread, once the call has ended: with its result, or
    None if it failed or never began. It releases what the call holds (an fd
    opened too late, pins on arena slots a thread was filling). A call the
    loop gave up on while it still waited for a thread (all of them busy,
    as while the store hangs) never begins: ``late`` then runs at once.
    """

    def __init__(self, late: Callable[[T | None], None] | None) -> None:
        self._lock = threading.Lock()
        self._abandoned = False
        self._began = False
        self._finished = False
        self._result: T | None = None
        self._error: BaseException | None = None
        self._late = late

    def abandoned(self) -> bool:
        with self._lock:
            return self._abandoned

    def began(self) -> bool:
        with self._lock:
            return self._began

    def outcome(self) -> T | None:
        """What the call returned (None: it failed, or has not returned)."""
        with self._lock:
            return self._result

    def error(self) -> BaseException | None:
        """What the call raised, if it did."""
        with self._lock:
            return self._error

    def begin(self) -> bool:
        """In the thread, first: whether to make the call (not once the loop
        gave up on it: it released what the call holds then)."""
        with self._lock:
            self._began = not self._abandoned
            return self._began

    def finish(self, result: T | None, error: BaseException | None = None) -> None:
        """In the thread, when the call ends (result None on failure, with
        what it raised)."""
        with self._lock:
            late = self._abandoned
            self._finished, self._result, self._error = True, result, error
        if late and self._late is not None:
            self._late(result)

    def abandon(self) -> None:
        """On the loop: give up. A call that ended meanwhile, or never began
        (and now never will), is released here."""
        with self._lock:
            self._abandoned = True
            release = self._finished or not self._began
        if release and self._late is not None:
            # Releasing may block (close on NFS): never on the loop.
            threading.Thread(target=self._late, args=(self._result,), daemon=True).start()


class BackingIO:
    def __init__(
        self,
        timeout: float,
        max_threads: int = 16,
        on_call: Callable[[float], None] | None = None,
    ) -> None:
        self.timeout = timeout
        # Told the seconds of each call that answered (the metrics' latency).
        self.on_call = on_call
        self.limiter = trio.CapacityLimiter(max_threads)
        self.health = "normal"
        self.calls = 0
        self.slow_calls = 0
        self.timeouts = 0
        self._last_ok = time.monotonic()
        # The last full or failing error (errno, what failed), and when.
        self.trouble: tuple[int, str] | None = None
        self._trouble_at = 0.0

    async def run(
        self,
        fn: Callable[..., T],
        *args: object,
        what: str = "",
        late: Callable[[T | None], None] | None = None,
        essential: bool = False,
        with_call: bool = False,
        call: Call[T] | None = None,
        interruptible: bool = False,
    ) -> T:
        """``fn(*args)`` in a thread under the timeout.

        ``essential`` calls (closing an fd) are attempted even while the store
        is known to be down, since skipping them leaks. With ``with_call`` the
        function receives the :class:`Call` as its first argument. Passing
        ``call`` lets the caller ask afterwards whether it was abandoned.
        ``interruptible``: a FUSE caller's signal gives up on the call as the
        timeout would, sooner, without taking the store for down
        (interrupts.py); only for calls whose abandonment leaves nothing half
        done that a caller could see (reads, and a manifest replace, which
        checks for abandonment before its rename).
        """
        label = what or getattr(fn, "__name__", "call")
        self.calls += 1
        if (
            not essential
            and self.health == "down"
            and time.monotonic() - self._last_ok < DOWN_PROBE_INTERVAL
        ):
            # Fail fast while the store is known down, but probe again every 5 s.
            raise BackingTimeout(f"backing store is down ({label})")
        if call is None:
            call = Call(late)

        def body() -> T:
            if not call.begin():
                raise _GivenUp  # nobody waits for its outcome any more
            try:
                result = fn(call, *args) if with_call else fn(*args)
            except BaseException as exc:
                call.finish(None, exc)
                raise
            call.finish(result)
            return result

        start = time.monotonic()
        interrupt = interrupted_by_caller(label) if interruptible else nullcontext()
        try:
            with interrupt, trio.fail_after(self.timeout):
                try:
                    result = await trio.to_thread.run_sync(
                        body, limiter=self.limiter, abandon_on_cancel=True
                    )
                except trio.Cancelled:
                    call.abandon()  # the thread runs on; ``late`` releases what it holds
                    raise
        except trio.TooSlowError:
            raise self.timed_out(label) from None
        except OSError as exc:
            if exc.errno in FULL_ERRNOS or exc.errno in FAILING_ERRNOS:
                self._troubled(exc, label)
            else:
                self._last_ok = time.monotonic()  # it answered: not down
            raise
        elapsed = time.monotonic() - start
        self._last_ok = time.monotonic()
        if self.on_call is not None:
            self.on_call(elapsed)
        if self.health in ("full", "failing") and self._last_ok - self._trouble_at < TROUBLE_HOLD:
            return result  # a read that works says nothing of room to write
        if elapsed > min(5.0, self.timeout / 4):
            self.slow_calls += 1
            self._set_health("slow", f"{label} took {elapsed:.1f}s")
        else:
            self._set_health("normal", "")
        return result

    def _troubled(self, exc: OSError, label: str) -> None:
        self._last_ok = self._trouble_at = time.monotonic()
        self.trouble = (exc.errno or 0, f"{label}: {exc.strerror or exc}")
        health = "full" if exc.errno in FULL_ERRNOS else "failing"
        self._set_health(health, f"({errno.errorcode.get(exc.errno or 0, exc.errno)}: {label})")

    def wrote(self) -> None:
        """A write to the store (a chunk, a manifest) succeeded: it is not
        full, nor failing, any more."""
        if self.health in ("full", "failing"):
            self._set_health("normal", "(a write succeeded)")

    def describe_trouble(self) -> dict[str, object] | None:
        """The error behind a ``full`` or ``failing`` health, for ``stat``."""
        if self.trouble is None or self.health not in ("full", "failing"):
            return None
        err, what = self.trouble
        return {
            "errno": errno.errorcode.get(err, str(err)),
            "error": what,
            "seconds_ago": round(time.monotonic() - self._trouble_at, 1),
        }

    def timed_out(self, label: str) -> BackingTimeout:
        """A call ran past the timeout (seen here, or by whoever waits for a
        call the loop let run on): the store is down. The error to raise."""
        self.timeouts += 1
        self._set_health("down", f"{label} took over {self.timeout:.0f}s")
        return BackingTimeout(f"backing store did not answer within {self.timeout:.0f}s ({label})")

    def _set_health(self, health: str, why: str) -> None:
        if health != self.health:
            level = logging.INFO if health == "normal" else logging.WARNING
            log.log(level, "backing store health %s -> %s %s", self.health, health, why)
            self.health = health


def on_loop_later(fn: Callable[..., object], *args: object) -> Callable[[object], None]:
    """A ``late`` callback that runs ``fn(*args)`` back on this trio loop (from
    the thread that was abandoned), or not at all if the loop has ended."""
    token = trio.lowlevel.current_trio_token()

    def late(_: object) -> None:
        try:
            trio.from_thread.run_sync(fn, *args, trio_token=token)
        except trio.RunFinishedError:
            pass

    return late


async def run_cpu(fn: Callable[..., T], *args: object, limiter: trio.CapacityLimiter) -> T:
    """Run CPU-bound work (hashing) in a thread; xxhash releases the GIL."""
    return await trio.to_thread.run_sync(fn, *args, limiter=limiter)


def _may_renice() -> bool:
    """Whether this process may raise a thread's priority back (CAP_SYS_NICE):
    without it, a thread lowered once would stay low for the FUSE work it
    does later, so background work is not lowered at all."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> 23 & 1)
    except (OSError, ValueError):
        pass
    return False


_renice = _may_renice()


def in_background(fn: Callable[[], T]) -> Callable[[], T]:
    """``fn`` run at a lower CPU priority (nice +BACKGROUND_NICE) than the
    daemon's, in whatever thread runs it; the thread's priority is restored
    when it returns. A training job sharing the CPUs with a flush keeps its
    share; the FUSE requests the same threads serve keep theirs."""

    def run() -> T:
        global _renice
        if not _renice:
            return fn()
        tid = threading.get_native_id()
        try:
            before = os.getpriority(os.PRIO_PROCESS, tid)
            os.setpriority(os.PRIO_PROCESS, tid, min(19, before + BACKGROUND_NICE))
        except OSError:
            _renice = False
            return fn()
        try:
            return fn()
        finally:
            try:
                os.setpriority(os.PRIO_PROCESS, tid, before)
            except OSError:
                _renice = False  # not allowed after all: never lowered again

    return run
