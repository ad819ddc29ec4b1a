"""The daemon's control endpoint: one JSON request line, one JSON reply line.

Served on a Unix socket that every local user may connect to (mode 0666).
Who may do what is decided per request from the peer's credentials
(SO_PEERCRED, set by the kernel, so it cannot be forged): anyone may ``ping``
and ``stat`` (which shows each caller only its own files, fs/daemon/statview.py);
``flush``, ``evict``, ``unmount`` and ``holds`` are for root and the mount's
owner.

Connections are bounded at accept, by their peer's uid: root has slots no
other user can take, every other uid (the mount's owner included) a few of
its own, and users that are neither root nor an owner share a pool. A
connection over its bound is told why and closed at once, so a user's flood
of idle connections costs that user only. Every connection has a deadline
counted from its accept for its request and another for its reply. An accept
that fails (the descriptor limit, EMFILE/ENFILE) is logged, at most once a
minute, and tried again after a short pause: the daemon goes on. One
connection's failure never affects another's or the daemon.
"""

from __future__ import annotations

import json
import logging
import math
import os
import socket
import struct
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio
from ckptfs import __version__

log = logging.getLogger("ckptfs.control")
MAX_REQUEST = 1 << 16
# Deadlines, counted from the accept: the whole request line must have
# arrived by REQUEST_TIMEOUT; the reply, once ready, must be taken within
# REPLY_TIMEOUT (a client that never reads it would otherwise keep its slot).
REQUEST_TIMEOUT = 5.0
REPLY_TIMEOUT = 10.0
# Connections open at once. Root's are its own; each other uid has at most
# USER_CONNECTIONS; uids that are neither root nor an owner of the mount have
# SHARED_CONNECTIONS between them, so no flood reaches the owners' or root's.
ROOT_CONNECTIONS = 32
USER_CONNECTIONS = 16
SHARED_CONNECTIONS = 128
# Pending connects the kernel queues for us; the accept loop drains them at
# once (over-limit ones are refused, not left waiting), so this only has to
# cover a burst.
BACKLOG = 128
ACCEPT_RETRY_FIRST = 0.05  # seconds; doubled after each failure in a row
ACCEPT_RETRY_MAX = 1.0
LOG_INTERVAL = 60.0  # at most one line per this many seconds per kind of trouble

Handler = Callable[[dict[str, Any], "Peer"], Awaitable[dict[str, Any]]]


@dataclass(frozen=True)
class Route:
    handler: Handler  # called with the request and the caller's credentials
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


class Slots:
    """Connections open now, by uid; decides at accept whether one more may stay."""

    def __init__(self, owners: set[int]) -> None:
        self.owners = owners
        self.held: Counter[int] = Counter()
        self.shared = 0  # held by uids that are neither root nor an owner

    def take(self, uid: int) -> str | None:
        """Count a new connection of ``uid``: None, or why it may not stay."""
        if uid == 0:
            if self.held[0] >= ROOT_CONNECTIONS:
                return f"too many control connections from root (at most {ROOT_CONNECTIONS})"
        elif self.held[uid] >= USER_CONNECTIONS:
            return f"too many control connections from uid {uid} (at most {USER_CONNECTIONS})"
        elif uid not in self.owners:
            if self.shared >= SHARED_CONNECTIONS:
                return (
                    f"too many control connections from users (at most {SHARED_CONNECTIONS}"
                    " together; root and the mount's owner have their own)"
                )
            self.shared += 1
        self.held[uid] += 1
        return None

    def give(self, uid: int) -> None:
        self.held[uid] -= 1
        if not self.held[uid]:
            del self.held[uid]
        if uid != 0 and uid not in self.owners:
            self.shared -= 1


class Throttled:
    """A log line at most once per LOG_INTERVAL, saying how many were left out."""

    def __init__(self, level: int) -> None:
        self.level = level
        self.last = -math.inf
        self.left_out = 0

    def log(self, message: str, *args: object) -> None:
        now = trio.current_time()
        if now - self.last < LOG_INTERVAL:
            self.left_out += 1
            return
        more = f" ({self.left_out} more like it since the last report)" if self.left_out else ""
        log.log(self.level, message + more, *args)
        self.last, self.left_out = now, 0


class AcceptFailures:
    """Failed accepts in a row: how long to wait before the next, and the log."""

    def __init__(self) -> None:
        self.streak = 0
        self.report = Throttled(logging.ERROR)

    def failed(self, exc: OSError) -> float:
        self.streak += 1
        # EMFILE/ENFILE leave the connection queued: retrying at once would spin.
        self.report.log("control socket: accept failed: %s; trying again shortly", exc)
        return min(ACCEPT_RETRY_MAX, ACCEPT_RETRY_FIRST * 2 ** (self.streak - 1))

    def succeeded(self) -> None:
        if self.streak:
            log.info("control socket: accepting again after %d failure(s)", self.streak)
            self.streak = 0


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
    sock.listen(BACKLOG)
    listener = trio.SocketListener(sock)
    try:
        async with trio.open_nursery() as nursery:
            task_status.started()
            await _accept_loop(listener, nursery, routes, owners)
    finally:
        path.unlink(missing_ok=True)


async def _accept_loop(
    listener: trio.abc.Listener[trio.SocketStream],
    nursery: trio.Nursery,
    routes: dict[str, Route],
    owners: set[int],
) -> None:
    slots = Slots(owners)
    failures = AcceptFailures()
    refusals = Throttled(logging.WARNING)
    while True:
        try:
            stream = await listener.accept()
        except OSError as exc:
            await trio.sleep(failures.failed(exc))
            continue
        failures.succeeded()
        deadline = trio.current_time() + REQUEST_TIMEOUT
        try:
            peer = peer_of(stream.socket)
        except OSError:
            stream.socket.close()  # gone before we asked who it was
            continue
        refusal = slots.take(peer.uid)
        if refusal is not None:
            refusals.log(
                "control socket: refused a connection of uid %d (pid %d): %s",
                peer.uid,
                peer.pid,
                refusal,
            )
            _refuse(stream, refusal)
            continue
        nursery.start_soon(_session, stream, peer, routes, owners, slots, deadline)


def _refuse(stream: trio.SocketStream, reason: str) -> None:
    """Tell the client why and close, without waiting: the reply is small and
    a new connection's buffer is empty, so the write either fits or is dropped."""
    reply = {"ok": False, "busy": True, "error": reason, "version": __version__}
    line = json.dumps(reply).encode() + b"\n"
    try:
        os.write(stream.socket.fileno(), line)
    except OSError:
        pass  # the client already went away
    stream.socket.close()


async def _session(
    stream: trio.SocketStream,
    peer: Peer,
    routes: dict[str, Route],
    owners: set[int],
    slots: Slots,
    deadline: float,
) -> None:
    async with stream:
        try:
            reply = await _answer(stream, peer, routes, owners, deadline)
            # Every reply names the daemon's version, so that a CLI newer or
            # older than the daemon it talks to can say so.
            reply["version"] = __version__
            with trio.move_on_after(REPLY_TIMEOUT):
                await stream.send_all(json.dumps(reply).encode() + b"\n")
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # the client went away; nothing to undo
        finally:
            # Before the close: a client that saw its reply end may connect again.
            slots.give(peer.uid)


async def _answer(
    stream: trio.SocketStream,
    peer: Peer,
    routes: dict[str, Route],
    owners: set[int],
    deadline: float,
) -> dict[str, Any]:
    try:
        with trio.fail_at(deadline):
            request = await _read_line(stream)
        op = request.get("op")
        route = routes.get(op) if isinstance(op, str) else None
        if route is None:
            return {"ok": False, "error": f"unknown request {op!r}"}
        if route.privileged and peer.uid != 0 and peer.uid not in owners:
            log.info("refused %r from uid %d (pid %d): not root or the mount's owner",
                     op, peer.uid, peer.pid)  # fmt: skip
            return {
                "ok": False,
                "error": f"permission denied: '{op}' is for root and the mount's owner",
                "denied": True,
            }
        return await route.handler(request, peer)
    except trio.TooSlowError:
        return {"ok": False, "error": f"bad request: not received within {REQUEST_TIMEOUT:g}s"}
    except ValueError as exc:
        return {"ok": False, "error": f"bad request: {exc}"}
    except OSError as exc:
        return {"ok": False, "error": str(exc)}
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        raise  # the client went away: nobody to answer
    except Exception as exc:
        log.exception("control request failed")
        return {"ok": False, "error": f"internal error: {exc}"}


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
