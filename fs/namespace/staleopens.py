"""Which threads' opens were sent back (ESTALE) to walk their path again.

The kernel retries an open that got ESTALE once, after a fresh lookup; a
second ESTALE would reach the caller. So a thread sent back once is
remembered until its next such open, which is then let through.
"""

from __future__ import annotations

import time

# Threads whose open was sent back with ESTALE (a rename replaced its file)
# are remembered until their retry, or, past this many, for this long.
STALE_OPENS_KEPT = 1024
STALE_OPEN_FORGOTTEN = 60.0


class StaleOpens:
    """The threads whose last open was sent back, and when (by thread id)."""

    def __init__(self) -> None:
        self._sent_back: dict[int, float] = {}

    def may_send_back(self, tid: int) -> bool:
        """Whether this thread's open may be sent back: not if the last one
        was (that is the kernel's retry, however long its lookup took). The
        thread's next open of this kind takes the mark back. Callers the
        kernel names 0 (another PID namespace) share one mark."""
        if self._sent_back.pop(tid, None) is not None:
            return False
        now = time.monotonic()
        if len(self._sent_back) >= STALE_OPENS_KEPT:  # threads that never came back
            self._sent_back = {
                t: at for t, at in self._sent_back.items() if now - at < STALE_OPEN_FORGOTTEN
            }
        self._sent_back[tid] = now
        return True
