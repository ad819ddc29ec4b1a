"""A backing-store call made by the FUSE request thread itself, and the
timer that lets the trio loop take the reading of /dev/fuse from it when the
call runs long.

Why in the thread: a due manifest check (close-to-open) is one stat of the
store, 2-60 µs; handing it to a helper thread cost 60-90 µs warm and
200-300 µs cold on this VM (two wake-ups and the GIL handed back and forth),
most of an open's latency (docs/PERFORMANCE.md). Why a timer: while the
thread waits in the store nobody reads /dev/fuse, and a hung NFS server
would stop every open, read and stat of the mount, cached files included.
So the thread arms a one-shot timerfd before each call; the loop waits on
it, and if the call is still running when it fires the loop takes the
reading over (``StoreCallWatch.take_if_overrun``) and answers the call's own
request itself, at once (with its own timeouts, and interruptible as any
request the loop handles); the thread drops that request when its call
returns, and reads again only when the loop hands the reading back, which
it does not while the call runs. No signal is used:
a timerfd needs no handler in the main thread and kills nobody if it fires
late.

States of the thread's store call (``StoreCall``), one owner: this watch,
under its lock. The loop takes the reading and hands it back only under that
lock (``take_if_overrun``, ``may_resume``), so it never resumes a thread that
is still held up in the store, and the thread never reads on after its call
overran.
"""

from __future__ import annotations

import ctypes
import enum
import errno
import os
import threading
import time
from collections.abc import Callable
from typing import Any

CLOCK_MONOTONIC = 1
TFD_NONBLOCK = os.O_NONBLOCK
TFD_CLOEXEC = os.O_CLOEXEC


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _Itimerspec(ctypes.Structure):
    _fields_ = [("it_interval", _Timespec), ("it_value", _Timespec)]


class OneShotTimer:
    """A timerfd that becomes readable once, ``arm(seconds)`` after it was
    armed, unless disarmed first (os.timerfd_* from Python 3.13, else libc)."""

    def __init__(self) -> None:
        self._os = hasattr(os, "timerfd_create")
        if self._os:
            self.fd = os.timerfd_create(  # type: ignore[attr-defined]
                time.CLOCK_MONOTONIC, flags=TFD_NONBLOCK | TFD_CLOEXEC
            )
            return
        libc = ctypes.CDLL(None, use_errno=True)
        # Set without letting go of the GIL (PyDLL): the call never blocks,
        # and taking the GIL back could wait for the loop's thread.
        self._settime = ctypes.PyDLL(None, use_errno=True).timerfd_settime
        self._settime.argtypes = [
            ctypes.c_int,
            ctypes.c_int,
            ctypes.POINTER(_Itimerspec),
            ctypes.c_void_p,
        ]
        fd = libc.timerfd_create(CLOCK_MONOTONIC, TFD_NONBLOCK | TFD_CLOEXEC)
        if fd < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"timerfd_create: {os.strerror(err)}")
        self.fd = fd
        self._spec = _Itimerspec()  # reused: arm and disarm run in one thread

    def arm(self, seconds: float) -> None:
        if self._os:
            os.timerfd_settime(self.fd, initial=seconds)  # type: ignore[attr-defined]
            return
        whole = int(seconds)
        self._spec.it_value.tv_sec = whole
        self._spec.it_value.tv_nsec = max(int((seconds - whole) * 1e9), 1 if not whole else 0)
        self._set()

    def disarm(self) -> None:
        if self._os:
            os.timerfd_settime(self.fd, initial=0)  # type: ignore[attr-defined]
            return
        self._spec.it_value.tv_sec = self._spec.it_value.tv_nsec = 0
        self._set()

    def _set(self) -> None:
        if self._settime(self.fd, 0, ctypes.byref(self._spec), None) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"timerfd_settime: {os.strerror(err)}")

    def drain(self) -> None:
        """Take the expiry the loop was woken for (none: a spurious wake)."""
        try:
            os.read(self.fd, 8)
        except BlockingIOError:
            pass
        except OSError as exc:
            if exc.errno != errno.EBADF:
                raise

    def close(self) -> None:
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)


class StoreCall(enum.Enum):
    IDLE = "idle"  # the thread is in no store call
    RUNNING = "running"  # it is; the reading waits for it, the timer is armed
    OVERRAN = "overran"  # it ran past its time: the loop reads until it ends


class ReadingTaken(Exception):
    """The thread's store call overran: the loop took the reading and the
    call's request (it answers it); the thread drops both, parked."""


class StoreCallWatch:
    """The request thread's store calls (``run``) and the loop's view of
    them (``take_if_overrun``, ``may_resume``)."""

    def __init__(self, wait: float, cooldown: float) -> None:
        self.wait = wait  # how long a call may hold up the reading
        self.cooldown = cooldown  # no calls for this long after one overran
        self.timer = OneShotTimer()
        self.state = StoreCall.IDLE
        self.calls = 0
        self.overruns = 0
        self._lock = threading.Lock()
        self._since = 0.0  # monotonic: when the running call began
        self._calm_from = 0.0  # monotonic: calls are made again from then on
        self._subject: Any = None  # what the running call is for (a request)

    # ----- the request thread ------------------------------------------------------------
    def usable(self) -> bool:
        """Whether the thread may call the store now: not within
        ``cooldown`` of an overrun (a slow store would hold up the reading
        for ``wait`` at every call)."""
        return self.timer.fd >= 0 and time.monotonic() >= self._calm_from

    def run(self, fn: Callable[[Any], Any], arg: Any, subject: Any) -> Any:
        """``fn(arg)`` in this (the request) thread, for ``subject`` (what
        the loop takes over with the reading); raises ReadingTaken if the
        loop took it meanwhile. Any exception of ``fn`` gives None: the loop
        then makes the call itself, and reports what fails."""
        with self._lock:
            self.state = StoreCall.RUNNING
            self._since = time.monotonic()
            self._subject = subject
        self.calls += 1
        self.timer.arm(self.wait)
        try:
            result = fn(arg)
        except Exception:  # noqa: BLE001 - the loop's own call meets it, and reports it
            result = None
        finally:
            self.timer.disarm()
            with self._lock:
                overran = self.state is StoreCall.OVERRAN
                self.state = StoreCall.IDLE
                self._subject = None
                if overran:  # the cooldown counts from here too: it may have run for long
                    self._calm_from = max(self._calm_from, time.monotonic() + self.cooldown)
        if overran:
            raise ReadingTaken
        return result

    # ----- the loop ------------------------------------------------------------------------
    def take_if_overrun(self, take: Callable[[Any], None], *, now: bool = False) -> bool:
        """When the timer fired: if a call has run for ``wait`` (``now``:
        whatever its time, as the session ends), mark it OVERRAN and run
        ``take(subject)`` (the loop takes the reading and the call's
        request, and parks the thread) under the lock, so before the thread
        can see the state; whether it did."""
        if not now:
            self.timer.drain()
        with self._lock:
            if self.state is not StoreCall.RUNNING:
                return False  # it ended before the loop woke
            t = time.monotonic()
            if not now and t - self._since < self.wait:
                return False  # an expiry of an earlier call, seen late
            self.state = StoreCall.OVERRAN
            self.overruns += 1
            self._calm_from = t + self.cooldown
            take(self._subject)
        return True

    def may_resume(self, resume: Callable[[], None]) -> bool:
        """Run ``resume`` (the thread reads again) unless its store call
        still overruns; whether it ran."""
        with self._lock:
            if self.state is StoreCall.OVERRAN:
                return False
            resume()
        return True

    def close(self) -> None:
        self.timer.close()
