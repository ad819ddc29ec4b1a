"""Running blocking backing-store calls off the event loop, with a timeout.

Any call that touches NFS can hang. It runs in a worker thread under a time
limit; a thread stuck in the kernel cannot be cancelled, so the number of such
threads is bounded and the store's health (normal / slow / down) is tracked,
both for `ckptfs stat` and so that callers stop piling requests onto it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeVar

import trio

T = TypeVar("T")
log = logging.getLogger("ckptfs.backing")


class BackingTimeout(OSError):
    pass


class BackingIO:
    def __init__(self, timeout: float, max_threads: int = 16) -> None:
        self.timeout = timeout
        self.limiter = trio.CapacityLimiter(max_threads)
        self.health = "normal"
        self.slow_calls = 0
        self.timeouts = 0
        self._last_ok = time.monotonic()

    async def run(self, fn: Callable[..., T], *args: object, what: str = "") -> T:
        if self.health == "down" and time.monotonic() - self._last_ok < 5:
            # Fail fast while the store is known down, but probe again every 5 s.
            raise BackingTimeout(f"backing store is down ({what or fn.__name__})")
        start = time.monotonic()
        try:
            with trio.fail_after(self.timeout):
                result = await trio.to_thread.run_sync(
                    fn, *args, limiter=self.limiter, abandon_on_cancel=True
                )
        except trio.TooSlowError:
            self.timeouts += 1
            self._set_health("down", f"{what or fn.__name__} took over {self.timeout:.0f}s")
            raise BackingTimeout(
                f"backing store did not answer within {self.timeout:.0f}s ({what or fn.__name__})"
            ) from None
        elapsed = time.monotonic() - start
        self._last_ok = time.monotonic()
        if elapsed > min(5.0, self.timeout / 4):
            self.slow_calls += 1
            self._set_health("slow", f"{what or fn.__name__} took {elapsed:.1f}s")
        else:
            self._set_health("normal", "")
        return result

    def _set_health(self, health: str, why: str) -> None:
        if health != self.health:
            level = logging.INFO if health == "normal" else logging.WARNING
            log.log(level, "backing store health %s -> %s %s", self.health, health, why)
            self.health = health


async def run_cpu(fn: Callable[..., T], *args: object, limiter: trio.CapacityLimiter) -> T:
    """Run CPU-bound work (hashing) in a thread; xxhash releases the GIL."""
    return await trio.to_thread.run_sync(fn, *args, limiter=limiter)
