"""The daemon's control endpoint: one JSON request line, one JSON reply line.

Served on a Unix socket only root can reach (mode 0600). One connection's
failure never affects another's or the daemon; every receive is bounded.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import trio

log = logging.getLogger("ckptfs.control")
MAX_REQUEST = 1 << 16
Handler = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]


async def serve(
    path: Path,
    handlers: dict[str, Handler],
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    path.unlink(missing_ok=True)
    sock = trio.socket.socket(trio.socket.AF_UNIX, trio.socket.SOCK_STREAM)
    await sock.bind(str(path))
    os.chmod(path, 0o600)
    sock.listen(16)
    listener = trio.SocketListener(sock)
    try:
        async with trio.open_nursery() as nursery:
            task_status.started()
            while True:
                stream = await listener.accept()
                nursery.start_soon(_session, stream, handlers)
    finally:
        path.unlink(missing_ok=True)


async def _session(stream: trio.abc.Stream, handlers: dict[str, Handler]) -> None:
    async with stream:
        try:
            with trio.fail_after(10):
                request = await _read_line(stream)
            op = request.get("op")
            handler = handlers.get(op) if isinstance(op, str) else None
            if handler is None:
                reply: dict[str, Any] = {"ok": False, "error": f"unknown request {op!r}"}
            else:
                reply = await handler(request)
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
