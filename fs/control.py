"""The daemon's control endpoint: one JSON request line, one JSON reply line.

Served on a Unix socket that every local user may connect to (mode 0666).
Who may do what is decided per request from the peer's credentials
(SO_PEERCRED, set by the kernel, so it cannot be forged): anyone may ``ping``
and ``stat``; ``flush``, ``evict`` and ``unmount`` are for root and the
mount's owner. One connection's failure never affects another's or the
daemon; every receive is bounded.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import struct
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

log = logging.getLogger("ckptfs.control")
MAX_REQUEST = 1 << 16
MAX_CONNECTIONS = 64
Handler = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]


@dataclass(frozen=True)
class Route:
    handler: Handler
    privileged: bool  # root or the mount's owner only


@dataclass(frozen=True)
class Peer:
    pid: int
    uid: int
    gid: int


def peer_of(sock: trio.socket.SocketType) -> Peer:
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", raw)
    return Peer(pid, uid, gid)


async def serve(
    path: Path,
    routes: dict[str, Route],
    owners: set[int],
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``routes``; privileged ones only for uid 0 and ``owners``."""
    path.unlink(missing_ok=True)
    sock = trio.socket.socket(trio.socket.AF_UNIX, trio.socket.SOCK_STREAM)
    await sock.bind(str(path))
    os.chmod(path, 0o666)
    sock.listen(16)
    listener = trio.SocketListener(sock)
    limit = trio.CapacityLimiter(MAX_CONNECTIONS)
    try:
        async with trio.open_nursery() as nursery:
            task_status.started()
            while True:
                stream = await listener.accept()
                nursery.start_soon(_session, stream, routes, owners, limit)
    finally:
        path.unlink(missing_ok=True)


async def _session(
    stream: trio.SocketStream,
    routes: dict[str, Route],
    owners: set[int],
    limit: trio.CapacityLimiter,
) -> None:
    async with stream, limit:
        try:
            peer = peer_of(stream.socket)
            with trio.fail_after(10):
                request = await _read_line(stream)
            op = request.get("op")
            route = routes.get(op) if isinstance(op, str) else None
            if route is None:
                reply: dict[str, Any] = {"ok": False, "error": f"unknown request {op!r}"}
            elif route.privileged and peer.uid != 0 and peer.uid not in owners:
                log.info("refused %r from uid %d (pid %d): not root or the mount's owner",
                         op, peer.uid, peer.pid)  # fmt: skip
                reply = {
                    "ok": False,
                    "error": f"permission denied: '{op}' is for root and the mount's owner",
                    "denied": True,
                }
            else:
                reply = await route.handler(request)
        except (trio.TooSlowError, ValueError) as exc:
            reply = {"ok": False, "error": f"bad request: {exc}"}
        except OSError as exc:
            reply = {"ok": False, "error": str(exc)}
        except Exception as exc:
            log.exception("control request failed")
            reply = {"ok": False, "error": f"internal error: {exc}"}
        try:
            await stream.send_all(json.dumps(reply).encode() + b"\n")
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # the client went away; nothing to undo


async def _read_line(stream: trio.abc.ReceiveStream) -> dict[str, Any]:
    data = b""
    while not data.endswith(b"\n"):
        piece = await stream.receive_some(4096)
        if not piece:
            break
        data += piece
        if len(data) > MAX_REQUEST:
            raise ValueError("request too large")
    request = json.loads(data)
    if not isinstance(request, dict):
        raise ValueError("request must be a JSON object")
    return request
