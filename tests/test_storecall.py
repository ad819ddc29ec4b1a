"""The request thread's own store calls (fs/storecall.py): the one-shot timer
the loop waits on, and the states by which the loop takes the reading from a
thread held up in the store and gives it back only once the call ended."""

from __future__ import annotations

import select
import threading
import time

import pytest
from ckptfs.fs.storecall import OneShotTimer, ReadingTaken, StoreCall, StoreCallWatch

TIMEOUT = 10


def _readable(fd: int, within: float) -> bool:
    return bool(select.select([fd], [], [], within)[0])


def test_the_timer_fires_once_when_armed_and_never_when_disarmed() -> None:
    timer = OneShotTimer()
    try:
        assert not _readable(timer.fd, 0.05)  # never armed
        start = time.monotonic()
        timer.arm(0.03)
        assert _readable(timer.fd, TIMEOUT)
        assert time.monotonic() - start >= 0.025
        timer.drain()
        assert not _readable(timer.fd, 0.08)  # one shot
        timer.arm(0.03)
        timer.disarm()
        assert not _readable(timer.fd, 0.1)
        timer.drain()  # nothing there: no error
    finally:
        timer.close()
    assert timer.fd == -1
    timer.close()  # twice: nothing


def test_a_call_returns_its_result_and_a_failing_one_none() -> None:
    watch = StoreCallWatch(wait=1.0, cooldown=1.0)
    try:
        assert watch.run(lambda x: x + 1, 41, "req") == 42
        assert watch.run(lambda x: 1 / x, 0, "req") is None  # the loop's own call reports it
        assert watch.state is StoreCall.IDLE and watch.calls == 2
        assert not _readable(watch.timer.fd, 0.05)  # disarmed after each
        taken: list[int] = []
        assert not watch.take_if_overrun(lambda req: taken.append(1))  # no call: nothing to take
        assert not watch.take_if_overrun(lambda req: taken.append(1), now=True)
        assert watch.may_resume(lambda: taken.append(2)) and taken == [2]
    finally:
        watch.close()


def test_the_loop_takes_an_overrunning_call_and_resumes_only_after_it() -> None:
    watch = StoreCallWatch(wait=0.05, cooldown=0.3)
    release = threading.Event()
    outcome: list[object] = []

    def thread() -> None:
        try:
            outcome.append(watch.run(lambda e: e.wait(TIMEOUT), release, "the open"))
        except ReadingTaken as exc:
            outcome.append(exc)

    t = threading.Thread(target=thread)
    t.start()
    try:
        events: list[str] = []
        assert _readable(watch.timer.fd, TIMEOUT)  # as the loop waits on it
        assert watch.state is StoreCall.RUNNING
        assert watch.take_if_overrun(lambda req: events.append(f"taken {req}"))
        assert events == ["taken the open"]
        assert watch.state is StoreCall.OVERRAN and watch.overruns == 1
        assert not watch.usable()  # cooling down
        assert not watch.may_resume(lambda: events.append("resumed"))  # still held up
        assert not watch.take_if_overrun(lambda req: events.append("again"))  # taken once
        release.set()
        t.join(TIMEOUT)
        assert isinstance(outcome[0], ReadingTaken)  # the thread hands its request over
        assert watch.state is StoreCall.IDLE
        assert watch.may_resume(lambda: events.append("resumed"))
        assert events == ["taken the open", "resumed"]
        deadline = time.monotonic() + TIMEOUT
        while not watch.usable():
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert watch.run(lambda x: x, 7, "req") == 7  # after the cooldown, calls again
    finally:
        release.set()
        t.join(TIMEOUT)
        watch.close()


def test_a_late_expiry_takes_nothing_from_a_later_call() -> None:
    """The timer of a call that has just ended fired before it was disarmed;
    the loop wakes while the next call has only begun: not an overrun."""
    watch = StoreCallWatch(wait=0.2, cooldown=1.0)
    try:
        watch.timer.arm(0.001)
        assert _readable(watch.timer.fd, TIMEOUT)
        seen: list[bool] = []

        def call(_: object) -> None:
            seen.append(watch.take_if_overrun(lambda req: seen.append(False)))

        watch.run(call, None, "req")  # the loop's look happens inside the call, 0 s into it
        assert seen == [False] and watch.state is StoreCall.IDLE and watch.overruns == 0
    finally:
        watch.close()


def test_as_the_session_ends_a_running_call_is_taken_whatever_its_time() -> None:
    """The thread must touch no state after its call returns: the loop takes
    the call's request at once, and the thread then drops it."""
    watch = StoreCallWatch(wait=60.0, cooldown=0.0)
    taken: list[str] = []
    outcome: list[object] = []

    def call(_: object) -> str:
        assert watch.take_if_overrun(lambda req: taken.append(req), now=True)
        return "entry"

    try:
        watch.run(call, None, "the lookup")
    except ReadingTaken as exc:
        outcome.append(exc)
    finally:
        watch.close()
    assert taken == ["the lookup"] and isinstance(outcome[0], ReadingTaken)
    assert watch.state is StoreCall.IDLE


def test_calls_are_refused_once_closed() -> None:
    watch = StoreCallWatch(wait=0.05, cooldown=0.0)
    watch.close()
    assert not watch.usable()
    with pytest.raises(OSError):
        watch.timer.arm(0.01)
