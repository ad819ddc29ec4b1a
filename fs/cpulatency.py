"""Fast CPU wake-ups while the mount is in use: a PM QoS CPU latency request.

Every FUSE request is two wake-ups: the daemon's when the caller's request
arrives, the caller's when the reply does. A CPU with nothing to run halts
(a VM's vCPU) or sleeps in a deep C-state (a server core), and waking it costs
tens of microseconds, more than the daemon's own work on a warm open:
torch.load(mmap=True) makes three such requests between its two opens.

While requests flow, the daemon asks the kernel, through the PM QoS device
/dev/cpu_dma_latency, to keep idle CPUs in their shallowest idle state (they
poll instead of halting), and drops the request once no FUSE request came for
``fuse.cpu_latency_hold`` seconds, so an idle node idles as before. Off by
default: it changes the whole machine's idle behaviour while held, and it only
helps when the caller and the daemon run on different CPUs (README
"Benchmark" has the measurements). The device is root's; without it (an
unprivileged daemon, a kernel without PM QoS) the mount works as before and
``ckptfs stat`` says why.
"""

from __future__ import annotations

import enum
import logging
import os
import struct
from collections.abc import Callable
from typing import Any

import trio

log = logging.getLogger(__name__)

DEVICE = "/dev/cpu_dma_latency"
# The most exit latency (µs) an idle state may have while held: none, so idle
# CPUs only poll. Anything above 0 admits the halt state this is about.
LATENCY_US = 0


class HoldState(enum.Enum):
    OFF = "off"  # fuse.cpu_latency_hold is 0
    UNAVAILABLE = "unavailable"  # the device could not be opened; see ``reason``
    IDLE = "idle"  # no request within the hold time: idle CPUs sleep as they like
    HELD = "held"  # requests are flowing: idle CPUs poll


class CpuLatencyHold:
    """Holds a PM QoS CPU latency request from one FUSE request until ``hold``
    seconds pass without another. ``touch`` runs on every FUSE request (cheap
    once held); ``run`` is the task that lets go."""

    def __init__(
        self,
        hold: float,
        key: str = "fuse.cpu_latency_hold",
        device: str = DEVICE,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self.hold = hold
        self.key = key  # the config key that sets ``hold``, for the log
        self.device = device
        # trio's clock unless told otherwise; run() binds the run's clock
        # itself, because touch() runs on every request and
        # trio.current_time() is three Python calls.
        self._clock: Callable[[], float] = clock or trio.current_time
        self._bind_clock = clock is None
        self.state = HoldState.OFF if hold <= 0 else HoldState.IDLE
        self.reason = ""
        self._fd: int | None = None
        self._last = 0.0  # the last request, by self._clock
        self._since = 0.0  # when the current hold was taken
        self._taken = trio.Event()  # set while HELD (or once UNAVAILABLE): wakes run()
        self.holds = 0
        self.held_seconds = 0.0  # over the holds already let go

    def touch(self) -> None:
        """A FUSE request arrived: take the hold, or keep it."""
        if self.state is HoldState.HELD:
            self._last = self._clock()
        elif self.state is HoldState.IDLE:
            self._take()

    def _take(self) -> None:
        # On the event loop on purpose: opening this device and writing to it
        # only add a kernel PM QoS request (no I/O, microseconds), and a thread
        # hop would cost the request that asked for it more than it saves.
        try:
            fd = os.open(self.device, os.O_WRONLY | os.O_CLOEXEC)
        except OSError as exc:
            self._unavailable(exc)
            return
        try:
            os.write(fd, struct.pack("=i", LATENCY_US))
        except OSError as exc:
            os.close(fd)
            self._unavailable(exc)
            return
        self._fd = fd
        self.state = HoldState.HELD
        self.holds += 1
        self._last = self._since = self._clock()
        self._taken.set()

    def _unavailable(self, exc: OSError) -> None:
        self.state = HoldState.UNAVAILABLE
        self.reason = f"{self.device}: {exc.strerror or exc}"
        self._taken.set()  # run() has nothing left to do
        log.info(
            "not holding CPU wake-up latency (%s), and not trying again: each FUSE "
            "request pays idle CPUs' wake-ups as without %s",
            self.reason,
            self.key,
        )

    def release(self) -> None:
        """Let idle CPUs sleep again (closing the device drops the request)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self.state is HoldState.HELD:
            self.held_seconds += self._clock() - self._since
            self.state = HoldState.IDLE
            self._taken = trio.Event()

    async def run(self, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Let go of the hold once ``hold`` seconds pass without a request."""
        if self._bind_clock:
            self._clock = trio.lowlevel.current_clock().current_time
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
            self.release()

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
