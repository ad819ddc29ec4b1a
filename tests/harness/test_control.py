"""The control socket's serve loop without FUSE: connection bounds, deadlines
and accept errors (fs/daemon/control.py). Mount-level checks are in
test_control_users.py."""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import trio
from ckptfs import __version__
from ckptfs.fs.daemon import control
from hostile import flood

USER, OTHER = 65534, 65533


async def ok(*_: Any) -> dict[str, Any]:
    return {"ok": True}


async def big(*_: Any) -> dict[str, Any]:
    return {"ok": True, "data": "x" * (2 << 20)}  # more than a socket buffer holds


# Every reply of the daemon names its version (a CLI says when it differs).
OK = {"ok": True, "version": __version__}

ROUTES = {
    "ping": control.Route(ok, privileged=False),
    "big": control.Route(big, privileged=False),
    "flush": control.Route(ok, privileged=True),
}


@contextmanager
def serving(owners: frozenset[int] = frozenset()) -> Iterator[Path]:
    """control.serve on a socket every user may reach, in a thread of its own;
    stopped (and any error it raised re-raised) at the end."""
    root = Path(tempfile.mkdtemp(prefix="ckptfs-control-", dir="/tmp"))
    root.chmod(0o755)
    path = root / "c.sock"
    state: dict[str, Any] = {}
    started = threading.Event()

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            state["token"] = trio.lowlevel.current_trio_token()
            state["cancel"] = nursery.cancel_scope.cancel
            await nursery.start(control.serve, path, ROUTES, set(owners))
            started.set()

    def run() -> None:
        try:
            trio.run(main)
        except BaseException as exc:  # handed to the test below
            state["error"] = exc
        finally:
            started.set()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        assert started.wait(10), "the control socket did not start"
        assert "error" not in state, state.get("error")
        yield path
    finally:
        if "token" in state and thread.is_alive():
            try:
                trio.from_thread.run_sync(state["cancel"], trio_token=state["token"])
            except trio.RunFinishedError:
                pass
        thread.join(10)
        shutil.rmtree(root, ignore_errors=True)
    assert not thread.is_alive(), "the serve loop did not stop"
    if "error" in state:
        raise AssertionError(f"the serve loop died: {state['error']!r}") from state["error"]


def connect(path: Path, timeout: float) -> socket.socket:
    """A connection; a full backlog (EAGAIN at once with a timeout set) is
    tried again until ``timeout``."""
    deadline = time.monotonic() + timeout
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    while True:
        try:
            s.connect(str(path))
            return s
        except BlockingIOError:
            if time.monotonic() > deadline:
                s.close()
                raise
            time.sleep(0.001)


def ask(path: Path, op: str = "ping", timeout: float = 30) -> tuple[dict[str, Any], float]:
    """One request as this process's user (root): the reply and how long it took."""
    start = time.monotonic()
    with connect(path, timeout) as s:
        s.sendall(json.dumps({"op": op}).encode() + b"\n")
        data = b""
        while not data.endswith(b"\n"):
            piece = s.recv(1 << 16)
            if not piece:
                break
            data += piece
    return json.loads(data), time.monotonic() - start


ASK_AS = r"""
import json, os, socket, sys, time
path, uid, op = sys.argv[1], int(sys.argv[2]), sys.argv[3]
os.setgroups([]); os.setgid(uid); os.setuid(uid)
start = time.monotonic()
try:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(20)
        while True:
            try:
                s.connect(path)
                break
            except BlockingIOError:  # a full backlog: try again
                time.sleep(0.001)
        s.sendall(json.dumps({"op": op}).encode() + b"\n")
        data = b""
        while not data.endswith(b"\n"):
            piece = s.recv(65536)
            if not piece:
                break
            data += piece
    reply = json.loads(data)
except (OSError, ValueError) as exc:
    reply = {"client_error": repr(exc)}
print(json.dumps({"reply": reply, "seconds": time.monotonic() - start}))
"""


def ask_as(path: Path, uid: int, op: str = "ping") -> tuple[dict[str, Any], float]:
    """One request as ``uid`` (a child that drops from root before connecting)."""
    proc = subprocess.run(
        [sys.executable, "-c", ASK_AS, str(path), str(uid), op],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    return out["reply"], out["seconds"]


def test_a_users_idle_connections_leave_root_owners_and_other_users_served() -> None:
    with serving(owners=frozenset({OTHER})) as path, flood(str(path), USER, 300):
        time.sleep(0.5)  # the flood renews what the daemon closes
        for _ in range(5):
            reply, seconds = ask(path, timeout=5)
            assert reply == OK and seconds < 2.0, (reply, seconds)
            reply, seconds = ask(path, "flush", timeout=5)
            assert reply == OK and seconds < 2.0, (reply, seconds)
        # The mount's owner is an ordinary user, and so is a third user.
        reply, seconds = ask_as(path, OTHER, "flush")
        assert reply == OK and seconds < 2.0, (reply, seconds)
        reply, seconds = ask_as(path, 65532)
        assert reply == OK and seconds < 2.0, (reply, seconds)
        # The flooding user itself is told why, at once.
        reply, seconds = ask_as(path, USER)
        assert reply.get("busy") is True and seconds < 2.0, (reply, seconds)
        assert reply["version"] == __version__  # no false "older daemon" note
        assert f"uid {USER}" in reply["error"], reply


def test_an_idle_connection_is_closed_at_a_deadline_counted_from_accept() -> None:
    with serving() as path:
        conns = []
        try:
            start = time.monotonic()
            for _ in range(120):  # more than there are slots
                conns.append(connect(path, 30))
            for s in conns:
                while s.recv(1 << 16):  # a refusal or a timeout reply, then EOF
                    pass
            waited = time.monotonic() - start
        finally:
            for s in conns:
                s.close()
        assert waited < control.REQUEST_TIMEOUT + 2, waited
        reply, seconds = ask(path, timeout=5)
        assert reply == OK and seconds < 2.0


def test_a_client_that_does_not_read_its_reply_gives_its_slot_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(control, "REPLY_TIMEOUT", 1.0)
    with serving() as path:
        readers = []
        try:
            for _ in range(70):  # more than root's slots
                s = connect(path, 30)
                s.sendall(b'{"op": "big"}\n')
                readers.append(s)
            time.sleep(control.REPLY_TIMEOUT + 1.5)
            reply, seconds = ask(path, timeout=5)
            assert reply == OK and seconds < 2.0, (reply, seconds)
        finally:
            for s in readers:
                s.close()


@pytest.mark.parametrize("code", [errno.EMFILE, errno.ENFILE, errno.ENOBUFS])
def test_accept_errors_are_logged_rate_limited_and_serving_goes_on(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, code: int
) -> None:
    failing_until = time.monotonic() + 2.0

    real = trio.SocketListener

    class Failing(trio.abc.Listener[trio.SocketStream]):
        """A listener whose accept fails, as at the descriptor limit, for 2 s."""

        def __init__(self, sock: trio.socket.SocketType) -> None:
            self.inner = real(sock)

        async def accept(self) -> trio.SocketStream:
            await trio.lowlevel.checkpoint()
            if time.monotonic() < failing_until:
                raise OSError(code, os.strerror(code))
            return await self.inner.accept()

        async def aclose(self) -> None:
            await self.inner.aclose()

    monkeypatch.setattr(trio, "SocketListener", Failing)
    caplog.set_level(logging.INFO, logger="ckptfs.control")
    with serving() as path:
        reply, seconds = ask(path, timeout=10)  # waits in the backlog meanwhile
        assert reply == OK
        assert time.monotonic() >= failing_until
    logged = [r for r in caplog.records if os.strerror(code) in r.getMessage()]
    assert 1 <= len(logged) <= 2, [r.getMessage() for r in logged]
    assert all(r.levelno == logging.ERROR for r in logged)


def test_a_request_that_arrives_in_pieces_within_the_deadline_is_answered() -> None:
    with serving() as path, connect(path, 10) as s:
        for piece in (b'{"op"', b': "pi', b'ng"}\n'):
            s.sendall(piece)
            time.sleep(0.2)
        assert json.loads(s.recv(1 << 16)) == OK


def test_the_client_waits_for_room_in_a_full_connection_queue(tmp_path: Path) -> None:
    from ckptfs.tools.control import exchange

    path = tmp_path / "c.sock"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen(0)
    fillers = []
    answered = threading.Event()

    def answer_later() -> None:
        """Accept after a while; answer whoever sends a request line."""
        time.sleep(0.5)
        server.settimeout(0.2)
        deadline = time.monotonic() + 10
        while not answered.is_set() and time.monotonic() < deadline:
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            conn.settimeout(0.2)
            try:
                if conn.recv(1 << 16).endswith(b"\n"):
                    conn.sendall(b'{"ok": true}\n')
                    answered.set()
            except TimeoutError:
                pass
            fillers.append(conn)

    try:
        while len(fillers) < 100:  # fill the queue: connects then answer EAGAIN at once
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.setblocking(False)
            fillers.append(s)
            try:
                s.connect(str(path))
            except BlockingIOError:
                break
        thread = threading.Thread(target=answer_later, daemon=True)
        thread.start()
        assert exchange(path, {"op": "ping"}, timeout=10) == b'{"ok": true}\n'
        thread.join(10)
    finally:
        answered.set()
        for s in fillers:
            s.close()
        server.close()
