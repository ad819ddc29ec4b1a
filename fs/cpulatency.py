"""Fast CPU wake-ups while the mount is in use: a PM QoS CPU latency request.

Every FUSE request is two wake-ups: the daemon's when the caller's request
arrives, the caller's when the reply does. A CPU with nothing to run halts
(a VM's vCPU) or sleeps in a deep C-state (a server core), and waking it costs
tens of microseconds, more than the daemon's own work on a warm open:
torch.load(mmap=True) makes three such requests between its two opens.

While requests flow, the daemon asks the kernel, through the PM QoS device
/dev/cpu_dma_latency, to keep idle CPUs in their shallowest idle state (they
poll instead of halting), and drops the request once no request came for a
while, so an idle node idles as before. Two holds use it:

- ``fuse.burst_latency_hold`` (:class:`BurstHold`, 2 ms by default): taken when
  a request is answered inline, let go by the session's reader once that long
  passed without another; a caller's next request usually follows within
  microseconds. Lengthened up to ``fuse.burst_latency_hold_max`` when bursts
  come back within that: the pauses between a restore's small loads.
- ``fuse.cpu_latency_hold`` (:class:`CpuLatencyHold`, off by default): taken on
  every request, let go by a task on the loop. It changes the whole machine's
  idle behaviour while held, and it only helps when the caller and the daemon
  run on different CPUs (README "Benchmark" has the measurements).

The device is root's; without it (an unprivileged daemon, a kernel without
PM QoS) the mount works as before and ``ckptfs stat`` says why.
"""

from __future__ import annotations

import enum
import logging
import os
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

import trio

log = logging.getLogger(__name__)

DEVICE = "/dev/cpu_dma_latency"
# The most exit latency (µs) an idle state may have while held: none, so idle
# CPUs only poll. Anything above 0 admits the halt state this is about.
LATENCY_US = 0
TAKE = struct.pack("=i", LATENCY_US)
# Written to let go while keeping the device open: the kernel's
# PM_QOS_DEFAULT_VALUE, which sets our request back to "no limit".
LET_GO = struct.pack("=i", -1)
# A lengthened burst hold covers the last pause times this: pauses vary.
STRETCH = 1.5
# Inline answers a burst needs for its pause to lengthen the next hold: a
# load's OPEN, IOCTL, OPEN and RELEASEs, not a poller's lone stat.
MIN_BURST = 3
# Seconds a lengthened hold may be kept without a pause longer than its
# longest: a restore's small loads take less; a steady poller is cut off.
LENGTHENED_FOR = 10.0


class HoldState(enum.Enum):
    OFF = "off"  # the hold time is 0
    UNAVAILABLE = "unavailable"  # the device could not be opened; see ``reason``
    IDLE = "idle"  # no request within the hold time: idle CPUs sleep as they like
    HELD = "held"  # requests are flowing: idle CPUs poll


class _LatencyRequest:
    """The PM QoS request itself: taken (our limit written to the device),
    let go (the default written back), closed, and what ``ckptfs stat``
    shows of it."""

    def __init__(self, hold: float, key: str, device: str, clock: Callable[[], float]) -> None:
        self.hold = hold
        self.key = key  # the config key that sets ``hold``, for the log
        self.device = device
        self._clock = clock
        self.state = HoldState.OFF if hold <= 0 else HoldState.IDLE
        self.reason = ""
        self._fd: int | None = None
        self._last = 0.0  # the last request, by self._clock
        self._since = 0.0  # when the current hold was taken
        self.holds = 0
        self.held_seconds = 0.0  # over the holds already let go

    def _take(self) -> bool:
        """Whether the hold is now taken. The device is opened once, on the
        first hold, and kept: later holds and releases are one write each
        (an update of our kernel PM QoS request, no I/O, microseconds), made
        by the caller on the loop or the request thread, on purpose; not an
        open and a close per hold, right after a reply."""
        fd = self._fd
        try:
            if fd is None:
                fd = self._fd = os.open(self.device, os.O_WRONLY | os.O_CLOEXEC)
            os.write(fd, TAKE)
        except OSError as exc:
            self.close()
            self._unavailable(exc)
            return False
        self.state = HoldState.HELD
        self.holds += 1
        self._last = self._since = self._clock()
        return True

    def _unavailable(self, exc: OSError) -> None:
        self.state = HoldState.UNAVAILABLE
        self.reason = f"{self.device}: {exc.strerror or exc}"
        log.info(
            "not holding CPU wake-up latency (%s), and not trying again: each FUSE "
            "request pays idle CPUs' wake-ups as without %s",
            self.reason,
            self.key,
        )

    def release(self) -> None:
        """Let idle CPUs sleep again: our request goes back to the kernel's
        default (no limit); the device stays open for the next hold."""
        if self.state is not HoldState.HELD:
            return
        self.held_seconds += self._clock() - self._since
        self.state = HoldState.IDLE
        try:
            assert self._fd is not None
            os.write(self._fd, LET_GO)
        except OSError as exc:  # closing drops the request just as well
            log.warning("%s: letting go of the hold failed (%s); closing it", self.device, exc)
            self.close()

    def close(self) -> None:
        """Let go and drop the request for good (the daemon ends; the fd is
        close-on-exec, and the kernel drops it at exit anyway)."""
        self.release()
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def describe(self) -> dict[str, Any]:
        held = self.held_seconds
        if self.state is HoldState.HELD:
            held += self._clock() - self._since
        return {
            "state": self.state.value,
            "hold": self.hold,
            "holds": self.holds,
            "held_seconds": round(held, 3),
            "reason": self.reason,
        }


class BurstHold(_LatencyRequest):
    """Held from an inline answer until ``hold`` seconds pass without one.

    No task lets it go: the session's reader (the request thread, or the
    loop's reader while the loop reads) bounds its wait for the next request
    by :meth:`remaining` and calls :meth:`release` when the wait runs out.
    One reader at a time reads, so one thread at a time uses it.

    The hold follows the caller's rhythm, up to ``longest``: a burst (at
    least MIN_BURST answers: a load's opens, isatty and closes) followed by
    another within ``longest`` makes that one's hold 1.5 times the pause
    between them, so that the burst after it finds idle CPUs polling; a
    smaller burst, or a pause longer than ``longest``, sets it back to
    ``base``. Bursts seconds apart thus cost no more polling than a fixed
    hold, and steady bursts pay one wake-up, not one each. A lengthened hold
    kept for LENGTHENED_FOR without a pause longer than ``longest`` goes
    back to ``base`` (a steady poller, not a restore), and is not lengthened
    again until such a pause."""

    def __init__(
        self,
        hold: float,
        longest: float = 0.0,
        key: str = "fuse.burst_latency_hold",
        device: str = DEVICE,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(hold, key, device, clock)
        self.base = hold
        self.longest = max(longest, hold)
        self.lengthened = 0  # bursts whose hold was lengthened
        self._answers = 0  # in the current (or last) burst
        self._tired = False  # held lengthened for LENGTHENED_FOR: base until a long pause

    def answered(self) -> None:
        """A request was answered inline: take the hold, or keep it. The
        first answer after a pause longer than ``base`` starts a burst, and
        the hold's length is fitted to that pause and the last burst."""
        now = self._clock()
        pause = now - self._last
        if self.state is HoldState.HELD:
            if pause > self.base:  # a new burst, within a lengthened hold
                self._fit(pause)
                self._answers = 0
            self._last = now
            self._answers += 1
        elif self.state is HoldState.IDLE:
            self._fit(pause)
            if self._take():
                self._answers = 1

    def _fit(self, pause: float) -> None:
        """The hold's length for a burst that starts ``pause`` seconds after
        the last answer of the one before (of ``_answers`` answers)."""
        if pause > self.longest:
            self._tired = False
        follows = pause <= self.longest and self._answers >= MIN_BURST and not self._tired
        self.hold = min(self.longest, max(self.base, pause * STRETCH)) if follows else self.base
        self.lengthened += self.hold > self.base

    def remaining(self) -> float | None:
        """Seconds until the hold is to be let go (0: now); None if not held."""
        if self.state is not HoldState.HELD:
            return None
        now = self._clock()
        if self.hold > self.base and now - self._since > LENGTHENED_FOR:
            self.hold, self._tired = self.base, True
        return max(0.0, self._last + self.hold - now)

    def let_go_if_over(self) -> None:
        """After a wait bounded by :meth:`remaining`: let go if it ran out."""
        if self.remaining() == 0:
            self.release()

    def describe(self) -> dict[str, Any]:
        out = super().describe()
        out.update(base=self.base, longest=self.longest, lengthened=self.lengthened)
        return out


class CpuLatencyHold(_LatencyRequest):
    """Holds a PM QoS CPU latency request from one FUSE request until ``hold``
    seconds pass without another. ``touch`` runs on every FUSE request (cheap
    once held, from any thread); ``run`` is the task that lets go."""

    def __init__(
        self,
        hold: float,
        key: str = "fuse.cpu_latency_hold",
        device: str = DEVICE,
        clock: Callable[[], float] | None = None,
    ) -> None:
        # trio's clock unless told otherwise; run() binds the run's clock
        # itself, because touch() runs on every request and
        # trio.current_time() is three Python calls.
        super().__init__(hold, key, device, clock or trio.current_time)
        self._bind_clock = clock is None
        self._taken = trio.Event()  # set while HELD (or once UNAVAILABLE): wakes run()
        self._token: trio.lowlevel.TrioToken | None = None
        self._loop_thread: int | None = None

    def touch(self) -> None:
        """A FUSE request arrived: take the hold, or keep it."""
        if self.state is HoldState.HELD:
            self._last = self._clock()
        elif self.state is HoldState.IDLE:
            if self._token is not None and threading.get_ident() != self._loop_thread:
                # The request thread: run() must be woken on the loop.
                try:
                    self._token.run_sync_soon(self.touch)
                except trio.RunFinishedError:
                    pass
                return
            self._take()
            self._taken.set()

    def _unavailable(self, exc: OSError) -> None:
        super()._unavailable(exc)
        self._taken.set()  # run() has nothing left to do

    def release(self) -> None:
        was_held = self.state is HoldState.HELD
        super().release()
        if was_held:
            self._taken = trio.Event()

    async def run(self, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Let go of the hold once ``hold`` seconds pass without a request."""
        if self._bind_clock:
            self._clock = trio.lowlevel.current_clock().current_time
        self._token = trio.lowlevel.current_trio_token()
        self._loop_thread = threading.get_ident()
        task_status.started()
        try:
            while True:
                if self.state is HoldState.HELD:
                    left = self._last + self.hold - self._clock()
                    if left > 0:
                        await trio.sleep(left)
                    else:
                        self.release()
                elif self.state is HoldState.IDLE:
                    await self._taken.wait()
                else:  # OFF, or UNAVAILABLE: there is nothing to let go
                    return
        finally:
            self.close()
