"""TCP ports for the servers a test starts (peers, metrics, rendezvous).

A port the kernel hands out for ``bind(0)`` comes from the ephemeral range,
the same range every outgoing connection takes its local port from. Between
the test closing its probe socket and the daemon binding the port, a peer
connection of another test (the suite runs on several xdist workers) can
take it, and the daemon fails with EADDRINUSE. So the ports come from below
the ephemeral range, where no connection lands by itself, each worker from
its own slice of it, and this process never hands one out twice.
"""

from __future__ import annotations

import os
import random
import socket
from pathlib import Path

_SLICE = 5000  # ports per worker; the suite takes a few hundred
_LOWEST = 10000  # above the well-known and registered ports most servers use
_given: set[int] = set()


def _slice() -> range:
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")  # "gw3"; unset in one process
    index = int(worker[2:]) if worker[2:].isdigit() else 0
    start = _LOWEST + index * _SLICE
    if start + _SLICE > low:
        raise AssertionError(f"no port slice for worker {worker} below the ephemeral range {low}")
    return range(start, start + _SLICE)


def free_port() -> int:
    """A port no process listens on or is connected from now, not handed to
    an earlier caller in this process, and outside the ephemeral range."""
    candidates = [p for p in _slice() if p not in _given]
    if not candidates:  # all given once: the earliest tests are long over
        _given.clear()
        candidates = list(_slice())
    for port in random.sample(candidates, min(len(candidates), 300)):
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("0.0.0.0", port))  # the daemons listen on every address
            except OSError:
                continue
        _given.add(port)
        return port
    raise AssertionError("no free port left in this worker's slice")


def free_ports(n: int) -> list[int]:
    return [free_port() for _ in range(n)]
