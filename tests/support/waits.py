"""Bounded waits: every wait in the tests ends, by its condition or by its
deadline, with a message naming what did not happen."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

import trio


def wait_for(
    predicate: Any, timeout: float, what: str | Callable[[], str], interval: float = 0.05
) -> Any:
    """Poll ``predicate`` until it returns something true (which is returned)
    or ``timeout`` seconds have passed: an AssertionError naming ``what``
    (called then, if a function, to say how things stand)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = predicate()
        if result:
            return result
        time.sleep(interval)
    said = what() if callable(what) else what
    raise AssertionError(f"timed out after {timeout}s waiting for {said}")


async def until(
    predicate: Callable[[], Any], what: str, timeout: float = 30.0, interval: float = 0.005
) -> None:
    """``wait_for`` inside a trio loop: sleeps on the loop between polls."""
    with trio.move_on_after(timeout):
        while not predicate():
            await trio.sleep(interval)
    assert predicate(), f"timed out after {timeout}s waiting for {what}"


def run_bounded(fn: Callable[[], Awaitable[None]], timeout: float = 30.0) -> None:
    """``trio.run(fn)``, cancelled with trio.TooSlowError after ``timeout`` s."""

    async def bounded() -> None:
        with trio.fail_after(timeout):
            await fn()

    trio.run(bounded)
