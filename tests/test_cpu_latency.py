"""The CPU wake-up latency hold (fs/cpulatency.py): taken on a FUSE request,
kept while requests come, let go ``fuse.cpu_latency_hold`` seconds after the
last; on a real mount, the kernel's PM QoS limit shows it."""

from __future__ import annotations

import os
import struct
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from ckptfs.fs.cpulatency import (
    DEVICE,
    LENGTHENED_FOR,
    MIN_BURST,
    BurstHold,
    CpuLatencyHold,
    HoldState,
)

REAL_DEVICE = Path(DEVICE)


def requested(device: Path) -> int:
    """The latency a (fake) device was last asked for: the kernel keeps the
    last value written to an open device as that fd's request."""
    return struct.unpack("=i", device.read_bytes()[-4:])[0]


def run_clocked(fn) -> None:  # type: ignore[no-untyped-def]
    trio.run(fn, clock=trio.testing.MockClock(autojump_threshold=0))


@asynccontextmanager
async def running(seconds: float, device: Path) -> AsyncIterator[tuple[CpuLatencyHold, Any]]:
    """A hold of ``seconds`` on ``device`` with its task running: (hold, nursery)."""
    hold = CpuLatencyHold(seconds, device=str(device))
    async with trio.open_nursery() as nursery:
        await nursery.start(hold.run)
        yield hold, nursery


def test_held_while_requests_come_and_let_go_after(tmp_path: Path) -> None:
    device = tmp_path / "cpu_dma_latency"
    device.write_bytes(b"")

    async def main() -> None:
        async with running(1.0, device) as (hold, nursery):
            assert hold.state is HoldState.IDLE
            hold.touch()
            assert hold.state is HoldState.HELD
            assert requested(device) == 0  # idle CPUs may only poll
            for _ in range(4):  # a request every 0.6 s keeps it past its first second
                await trio.sleep(0.6)
                assert hold.state is HoldState.HELD
                hold.touch()
            await trio.sleep(0.9)
            assert hold.state is HoldState.HELD
            await trio.sleep(0.2)
            assert hold.state is HoldState.IDLE
            assert hold.holds == 1
            assert hold.describe()["held_seconds"] == pytest.approx(3.4, abs=0.01)
            assert requested(device) == -1  # let go: back to the kernel's default
            hold.touch()  # the next burst takes it again, through the same fd
            assert hold.state is HoldState.HELD and hold.holds == 2
            assert requested(device) == 0
            nursery.cancel_scope.cancel()
        assert hold.state is HoldState.IDLE  # cancelled: let go, the device closed
        assert requested(device) == -1 and hold._fd is None
        assert device.read_bytes() == struct.pack("=4i", 0, -1, 0, -1)  # one open, four writes

    run_clocked(main)


def test_missing_device_is_reported_and_not_retried(tmp_path: Path) -> None:
    device = tmp_path / "no-such-device"

    async def main() -> None:
        async with running(1.0, device) as (hold, nursery):
            hold.touch()
            assert hold.state is HoldState.UNAVAILABLE
            assert str(device) in hold.reason and "No such file" in hold.reason
            device.write_bytes(b"")
            hold.touch()  # not retried on every request
            assert hold.state is HoldState.UNAVAILABLE and hold.holds == 0
            with trio.fail_after(1):  # run() has nothing to let go and returns
                await trio.sleep(0.1)
            assert not nursery.child_tasks

    run_clocked(main)


def test_off_never_opens_the_device(tmp_path: Path) -> None:
    device = tmp_path / "cpu_dma_latency"
    device.write_bytes(b"untouched")

    async def main() -> None:
        async with running(0, device) as (hold, nursery):
            hold.touch()
            assert hold.state is HoldState.OFF
        assert device.read_bytes() == b"untouched"
        assert hold.describe() == {
            "state": "off",
            "hold": 0,
            "holds": 0,
            "held_seconds": 0.0,
            "reason": "",
        }

    run_clocked(main)


def test_a_burst_hold_is_kept_by_answers_and_let_go_by_its_reader(tmp_path: Path) -> None:
    """BurstHold has no task: the reader asks how long it may still wait
    (remaining) and lets go when that wait runs out."""
    device = tmp_path / "cpu_dma_latency"
    device.write_bytes(b"")
    now = [100.0]
    hold = BurstHold(0.002, device=str(device), clock=lambda: now[0])
    assert hold.state is HoldState.IDLE and hold.remaining() is None
    hold.answered()
    assert hold.state is HoldState.HELD and requested(device) == 0
    now[0] += 0.0015
    assert hold.remaining() == pytest.approx(0.0005)
    hold.answered()  # the next answer keeps it
    assert hold.remaining() == pytest.approx(0.002) and hold.holds == 1
    now[0] += 0.003
    assert hold.remaining() == 0
    hold.release()
    assert hold.state is HoldState.IDLE and hold.remaining() is None
    assert hold.held_seconds == pytest.approx(0.0045)
    assert requested(device) == -1
    hold.answered()
    assert hold.holds == 2 and requested(device) == 0
    hold.close()
    assert hold.state is HoldState.IDLE and hold._fd is None
    assert device.read_bytes() == struct.pack("=4i", 0, -1, 0, -1)
    off = BurstHold(0, device=str(device))
    off.answered()
    assert off.state is HoldState.OFF and off.remaining() is None


def test_a_burst_hold_follows_the_pauses_between_bursts(tmp_path: Path) -> None:
    """A burst (at least MIN_BURST answers) followed by another soon after
    the hold lapsed lengthens the next hold to 1.5 times that pause (up to
    ``longest``): the next burst's first request then finds the CPUs
    polling. A long pause sets it back; a poller's lone requests never
    lengthen it; a lengthened hold kept LENGTHENED_FOR without a long pause
    goes back to the base until there is one."""
    device = tmp_path / "cpu_dma_latency"
    device.write_bytes(b"")
    now = [100.0]
    hold = BurstHold(0.002, 0.05, device=str(device), clock=lambda: now[0])

    def burst_after(pause: float, answers: int = MIN_BURST) -> None:
        now[0] += pause
        hold.let_go_if_over()  # the reader's wait ran out meanwhile, if it did
        for _ in range(answers):
            hold.answered()
            now[0] += 0.0001

    burst_after(0.0)
    assert hold.hold == 0.002 and hold.lengthened == 0  # no pause seen yet: the base
    burst_after(0.004)  # lapsed after 2 ms; back 4.1 ms after the last answer
    assert hold.holds == 2 and hold.hold == pytest.approx(0.00615) and hold.lengthened == 1
    burst_after(0.005)  # within the lengthened hold: kept, not taken again, fitted anew
    assert hold.holds == 2 and hold.state is HoldState.HELD
    assert hold.hold == pytest.approx(0.00765) and hold.lengthened == 2
    assert hold.remaining() == pytest.approx(0.00765 - 0.0001)
    burst_after(0.04)  # lapsed; a longer pause, still under longest: capped at longest
    assert hold.holds == 3 and hold.hold == pytest.approx(0.05)
    burst_after(1.2)  # spaced loads: back to the base, no more polling than a fixed hold
    assert hold.holds == 4 and hold.hold == 0.002
    assert hold.describe()["lengthened"] == 3 and hold.describe()["longest"] == 0.05

    # A poller's lone request every 10 ms: after the first (which follows a
    # load), each pays the base hold, no more.
    burst_after(0.01, answers=1)
    for _ in range(20):
        burst_after(0.01, answers=1)
        assert hold.hold == 0.002
    assert hold.lengthened == 4

    # Bursts every 10 ms for longer than LENGTHENED_FOR: lengthened, then
    # cut back to the base, and not lengthened again while they go on.
    burst_after(1.0)
    burst_after(0.01)
    assert hold.hold == pytest.approx(0.01515)
    taken, started = hold.holds, now[0]
    for _ in range(int(2 * LENGTHENED_FOR / 0.0103)):
        burst_after(0.01)  # each pause within the hold: one hold, until cut
        if hold.holds != taken:
            break
    assert hold.holds == taken + 1  # cut back, lapsed, taken again
    assert LENGTHENED_FOR < now[0] - started < LENGTHENED_FOR + 0.05
    assert hold.hold == 0.002  # kept so long: back to the base
    for _ in range(10):
        burst_after(0.01)
        assert hold.hold == 0.002
    burst_after(0.2)  # a real pause: the next bursts may lengthen it again
    burst_after(0.01)
    assert hold.hold == pytest.approx(0.01515)

    fixed = BurstHold(0.002, device=str(device), clock=lambda: now[0])  # longest 0: fixed
    for _ in range(2):
        now[0] += 0.004
        fixed.let_go_if_over()
        for _ in range(MIN_BURST):
            fixed.answered()
    assert fixed.hold == 0.002 and fixed.lengthened == 0 and fixed.holds == 2


def kernel_limit() -> int:
    fd = os.open(DEVICE, os.O_RDONLY)  # a reader's own request asks for nothing
    try:
        return struct.unpack("=i", os.read(fd, 4))[0]
    finally:
        os.close(fd)


def wait_state(m, state: str, timeout: float = 10) -> dict:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while True:
        cpu = m.stat()["fuse"]["cpu_latency"]
        if cpu["state"] == state or time.monotonic() > deadline:
            return cpu
        time.sleep(0.1)


@pytest.mark.skipif(
    os.geteuid() != 0 or not REAL_DEVICE.exists(), reason="needs root and the PM QoS device"
)
def test_mount_holds_while_used(mounts) -> None:  # type: ignore[no-untyped-def]
    before = kernel_limit()
    m = mounts("held")
    m.mount(env={"CKPTFS_FUSE_CPU_LATENCY_HOLD": "2", "CKPTFS_FUSE_BURST_LATENCY_HOLD": "0"})
    payload = os.urandom(3 * 4096 + 5)
    (m.mnt / "f").write_bytes(payload)
    assert (m.mnt / "f").read_bytes() == payload
    assert kernel_limit() == 0  # read right after a request: well within the hold
    cpu = wait_state(m, "idle")  # the control socket is not a FUSE request
    assert cpu["state"] == "idle" and cpu["holds"] >= 1 and cpu["held_seconds"] >= 2
    if before != 0:  # nothing else on the machine holds it at 0
        assert kernel_limit() == before
    assert "idle CPUs sleep as usual, no recent request" in m.cli("stat", str(m.mnt)).stdout
    assert not (m.mnt / "g-missing").exists()  # a LOOKUP
    assert kernel_limit() == 0  # the lookup above was a request: taken again
    assert m.stat()["fuse"]["cpu_latency"]["holds"] == cpu["holds"] + 1
    m.umount()
    if before != 0:
        assert kernel_limit() == before  # the daemon is gone and its request with it

    off = mounts("off")
    off.mount(env={"CKPTFS_FUSE_BURST_LATENCY_HOLD": "0"})  # cpu_latency_hold's default: off
    (off.mnt / "g").write_bytes(payload)
    assert (off.mnt / "g").read_bytes() == payload
    if before != 0:
        assert kernel_limit() == before
    assert off.stat()["fuse"]["cpu_latency"]["state"] == "off"
    off.umount()


@pytest.mark.skipif(
    os.geteuid() != 0 or not REAL_DEVICE.exists(), reason="needs root and the PM QoS device"
)
def test_a_burst_of_small_requests_holds_for_a_moment(mounts) -> None:  # type: ignore[no-untyped-def]
    """fuse.burst_latency_hold (default 2 ms): taken when a request is
    answered inline (here: read-only opens of a cached file), let go soon
    after the last; other requests (a write) do not take it."""
    before = kernel_limit()
    m = mounts("burst")
    m.mount()
    (m.mnt / "f").write_bytes(os.urandom(4096))
    time.sleep(0.2)  # past the hold, if the close took it
    if before != 0:
        assert kernel_limit() == before
    held_at_open = []
    for _ in range(20):
        os.close(os.open(m.mnt / "f", os.O_RDONLY))  # answered inline
        held_at_open.append(kernel_limit() == 0)
    assert any(held_at_open)
    # Loads of a kind, 10 ms apart (three opens each): the bursts after the
    # first find a hold fitted to the pause before them.
    for _ in range(3):
        time.sleep(0.01)
        for _ in range(3):
            os.close(os.open(m.mnt / "f", os.O_RDONLY))
    assert m.stat()["fuse"]["burst_latency"]["lengthened"] >= 1
    assert "held longer for" in m.cli("stat", str(m.mnt)).stdout
    time.sleep(0.2)
    burst = m.stat()["fuse"]["burst_latency"]
    assert burst["state"] == "idle" and burst["holds"] >= 1
    assert burst["base"] == 0.002 and burst["longest"] == 0.05  # the defaults
    assert burst["held_seconds"] < 1.0  # moments, not the whole test
    if before != 0:
        assert kernel_limit() == before
    requests = m.stat()["fuse"]["requests"]
    assert requests["fast"] >= 20 and requests["spun"] >= 0  # shown (timing-bound: not counted on)
    assert "found by the request thread while it spun" in m.cli("stat", str(m.mnt)).stdout
    m.umount()
