"""Real daemons against a hostile peer: a secret holder that claims another
node's name, a node that forges mirrors of another node's file, reads of
what a node does not hold, and a flood of silent connections.

The nodes are told apart by address: n1 is 127.0.0.1, n2 127.0.0.2, n3
127.0.0.3 (all of 127/8 is loopback). The test itself holds the cluster
secret and plays the hostile parts over raw frames.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import trio
from ckptfs.fs.store.manifest import Manifest, read_manifest
from ckptfs.peer.config import PeersConfig, parse_peers
from ckptfs.peer.mirror.wire import page_digest
from ckptfs.peer.transport import auth
from ckptfs.peer.transport.auth import AuthError
from ckptfs.peer.transport.transport import Request, Response, serve
from ckptfs.peer.transport.wire import FrameType
from mounts import Mount, free_port
from peerwire import RawPeer
from waits import wait_for

SECRET = "correct horse battery staple 0123456789"
ADDRESSES = {"n1": "127.0.0.1", "n2": "127.0.0.2", "n3": "127.0.0.3"}
PEER_LOGS = ["refused peer connection", "lost connection to peer", "dropped connection from peer"]


def cluster(tmp_path: Path, ports: dict[str, int]) -> tuple[Path, dict[str, Any]]:
    """The config file of nodes at ADDRESSES (ring buddies: n1 -> n2 -> n3 -> n1)."""
    secret = tmp_path / "secret"
    secret.write_text(SECRET + "\n")
    secret.chmod(0o600)
    nodes = {name: f"{ADDRESSES[name]}:{port}" for name, port in ports.items()}
    raw = {"secret_file": str(secret), "nodes": nodes, "timeout": 1.5, "heartbeat": 0.2}
    path = tmp_path / "cluster.yaml"
    path.write_text(json.dumps({"peers": raw}) + "\n")  # JSON is YAML
    return path, raw


def peers_alive(m: Mount) -> dict[str, bool]:
    return {p["name"]: p["alive"] for p in m.stat()["peers"]}


async def in_thread(fn: Callable[..., Any], *args: Any) -> Any:
    return await trio.to_thread.run_sync(partial(fn, *args))


async def raw_as(config: PeersConfig, node: str, source: str, to: str) -> RawPeer:
    """A connection to node ``to`` from IP ``source``, authenticated as ``node``."""
    host, port = config.nodes[to]
    raw = RawPeer(await trio.open_tcp_stream(host, port, local_address=source))
    await auth.client_handshake(
        raw, node=node, expect_node=to, secret=config.secret, cluster_hash=config.cluster_hash
    )
    return raw


async def ask(raw: RawPeer, rid: int, rtype: str, meta: dict, payload: bytes = b"") -> dict:
    """One request over a raw connection; the response's meta, its error in "error"."""
    await raw.send_frame(FrameType.REQUEST, rid, {"type": rtype, "meta": meta}, payload)
    frame = await raw.receive_frame()
    assert frame is not None and frame.header.type is FrameType.RESPONSE, frame
    return {**frame.meta["meta"], "error": frame.meta.get("error"),
            "payload": bytes(frame.payload)}  # fmt: skip


def forged_commit(m: Manifest, path: str, data: bytes) -> tuple[dict, dict, bytes]:
    """The page and commit requests that mirror ``data`` as ``m``'s version,
    claiming ``m.holders`` (the PAGE meta, the COMMIT meta, its body)."""
    page = {"mid": "forged", "file_id": m.file_id, "wait": True,
            "pages": [[0, 5, len(data), page_digest(data, 0, 5)]]}  # fmt: skip
    body = {
        "manifest": m.to_bytes().decode(),
        "path": path,
        "uid": 0,
        "gid": 0,
        "ram": [[0, 5, len(data)]],
        "spilled": [],
        "base": [],
        "base_end": 0,
        "floor": 5,
    }
    return page, {"mid": "forged"}, json.dumps(body).encode()


async def fake_node(config: PeersConfig, *, task_status: trio.TaskStatus[None]) -> None:
    """Node n1 as the test plays it: answers heartbeats, nothing else."""

    async def handler(peer: str, request: Request) -> Response:
        if request.type == "heartbeat":
            return Response(meta={"node": "n1", "incarnation": "fake", "time": time.time()})
        return Response.fail("the fake n1 serves heartbeats only")

    host, port = config.nodes["n1"]
    await serve(host, port, node="n1", secret=config.secret, cluster_hash=config.cluster_hash,
                handler=handler, task_status=task_status)  # fmt: skip


def test_peers_refuse_claimed_names_forged_mirrors_and_reads_of_what_they_do_not_hold(
    mounts, tmp_path
):
    """n2 and n3 are real; n1 is the test (it mirrors to n2, its buddy).

    - A secret holder at n3's address claiming n1, or claiming a node that
      is not configured, is refused by the handshake; n3 itself, not n2's
      writer, has its mirror commit refused; neither changes anything.
    - n1 mirrors to n2 a page and a commit claiming the file id and version
      of x.pt, pending on n3: n2 reads x.pt from n3, never n1's bytes; a
      peer read of that version that names n3 as its writer is "not held"
      at n2, as is any version n2 does not hold.
    - n1 dies: n2 does not take its forged mirror over as x.pt.
    """
    ports = {name: free_port() for name in ADDRESSES}
    path, raw_config = cluster(tmp_path, ports)
    config = parse_peers(raw_config, "n1")
    assert config is not None
    n2, n3 = mounts("n2"), mounts("n3")
    # Pending for the whole test (1 MiB chunks at 32 KiB/s); the forgery is one page.
    genuine = os.urandom(3 << 20)
    forged = os.urandom(200_000)
    for m in (n2, n3):
        m.allowed_log += PEER_LOGS + ["is dead", "not taking over"]

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            scope = trio.CancelScope()

            async def run_fake(task_status: trio.TaskStatus[None]) -> None:
                with scope:
                    await fake_node(config, task_status=task_status)

            await nursery.start(run_fake)
            await in_thread(n2.mount, "--config", str(path), "--node", "n2")
            # Slow to flush, durability local: x.pt stays pending, held by n3 alone.
            slow = {"CKPTFS_FLUSH_BANDWIDTH": "32KiB", "CKPTFS_CHUNK_SIZE": "1MiB",
                    "CKPTFS_DURABILITY": "local"}  # fmt: skip
            await in_thread(partial(n3.mount, "--config", str(path), "--node", "n3", env=slow))
            for m in (n2, n3):
                await in_thread(wait_for, lambda m=m: all(peers_alive(m).values()), 30, "alive")

            # Names: only from their own address, only configured ones.
            for node, source in [("n1", "127.0.0.3"), ("n9", "127.0.0.1"), ("n2", "127.0.0.1")]:
                with pytest.raises(AuthError):
                    await raw_as(config, node, source, "n2")
            assert "node 'n1' is not accepted from 127.0.0.3" in n2.log()
            assert "'n9' is not a node of this cluster" in n2.log()

            await in_thread((n3.mnt / "x.pt").write_bytes, genuine)
            real = read_manifest(n3.backing / "x.pt")
            assert real is not None and real.state == "pending" and real.holders == ["n3"]

            # n3 is not a writer n2 mirrors for.
            as_n3 = await raw_as(config, "n3", "127.0.0.3", "n2")
            claim = Manifest(real.file_id, real.version, real.size, real.mode, real.mtime_ns,
                             "pending", ["n3", "n2"])  # fmt: skip
            page, commit, body = forged_commit(claim, "x.pt", forged)
            answer = await ask(as_n3, 1, "mirror.page", page, forged)
            assert "not n3's buddy" in str(answer["error"])
            answer = await ask(as_n3, 2, "mirror.commit", commit, body)
            assert "not n3's buddy" in str(answer["error"])
            assert (await in_thread(n2.stat))["mirroring"]["mirrors"] == 0

            # n1, n2's writer, forges n3's file: held as n1's mirror at most.
            as_n1 = await raw_as(config, "n1", "127.0.0.1", "n2")
            claim.holders = ["n1", "n2"]
            page, commit, body = forged_commit(claim, "x.pt", forged)
            assert (await ask(as_n1, 1, "mirror.page", page, forged))["held"] == [0]
            assert (await ask(as_n1, 2, "mirror.commit", commit, body))["missing"] == []
            assert await in_thread((n2.mnt / "x.pt").read_bytes) == genuine
            read = {"file_id": real.file_id, "version": real.version, "offset": 0,
                    "length": 1000, "writer": "n3"}  # fmt: skip
            answer = await ask(as_n1, 3, "read", read)
            assert "not held here" in str(answer["error"]) and answer["payload"] == b""
            answer = await ask(as_n1, 4, "read", {**read, "file_id": "f" * 16})
            assert "not held here" in str(answer["error"])

            # n1 dies: its mirror is not flushed as x.pt.
            scope.cancel()
            await trio.aclose_forcefully(as_n1.stream)
            await trio.aclose_forcefully(as_n3.stream)
            await in_thread(wait_for, lambda: "peer n1 dead: took over" in n2.log(), 30, "n1 dead")
            assert "peer n1 dead: took over 0 mirrored file(s)" in n2.log()
            assert "not taking over x.pt" in n2.log()
            now = read_manifest(n3.backing / "x.pt")
            assert now is not None and now.version == real.version and now.holders == ["n3"]
            assert await in_thread((n2.mnt / "x.pt").read_bytes) == genuine
            nursery.cancel_scope.cancel()

    try:
        trio.run(main)
    finally:
        for m in (n2, n3):
            if m.pid is not None:
                m.kill()  # x.pt would keep a clean unmount waiting


def flood(port: int, source: str, count: int, stop: threading.Event) -> int:
    """Keep ``count`` silent connections from ``source`` to 127.0.0.1:``port``,
    opening a new one for each that is closed or refused, until ``stop``;
    returns how many were opened."""
    opened = 0

    async def one() -> None:
        nonlocal opened
        while not stop.is_set():
            sock = trio.socket.socket()
            try:
                await sock.bind((source, 0))
                await sock.connect(("127.0.0.1", port))
                opened += 1
                while not stop.is_set():
                    with trio.move_on_after(0.2):
                        if not await sock.recv(1):
                            break
            except OSError:
                await trio.sleep(0.01)  # not listening yet
            finally:
                sock.close()

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            for _ in range(count):
                nursery.start_soon(one)

    trio.run(main)
    return opened


def cut_connections(source: str, dest: str, port: int) -> None:
    """Abort every TCP connection from ``source`` to ``dest``:``port`` (ss -K)."""
    subprocess.run(["ss", "-K", "src", source, "dst", dest, "dport", "=", str(port)],
                   capture_output=True, timeout=10, check=True)  # fmt: skip


def test_a_flood_of_silent_connections_from_a_nodes_address_kills_no_heartbeat(mounts, tmp_path):
    """Hundreds of silent connections to each node from n1's own address,
    renewed as they are closed, from before the nodes start: they connect
    to each other all the same, again each time their connections are cut,
    and nobody is declared dead."""
    ports = {"n1": free_port(), "n2": free_port()}
    path, _ = cluster(tmp_path, ports)
    n1, n2 = mounts("n1"), mounts("n2")
    stop = threading.Event()
    opened: list[int] = []
    threads = [
        threading.Thread(target=lambda p=p: opened.append(flood(p, "127.0.0.1", 300, stop)))
        for p in ports.values()
    ]
    for t in threads:
        t.start()
    try:
        time.sleep(0.5)
        n1.mount("--config", str(path), "--node", "n1")
        n2.mount("--config", str(path), "--node", "n2")
        for m in (n1, n2):
            wait_for(lambda m=m: all(peers_alive(m).values()), 30, "alive through the flood")
        # (A node mounted first may have called the other dead before it started.)
        logged = {m.mnt: len(m.log()) for m in (n1, n2)}
        # For four times the peers' timeout, their connections to each other
        # are cut again and again: every heartbeat connection is dialled
        # afresh through the flood, and nobody is declared dead.
        until = time.monotonic() + 6.0
        while time.monotonic() < until:
            cut_connections("127.0.0.1", "127.0.0.2", ports["n2"])
            cut_connections("127.0.0.2", "127.0.0.1", ports["n1"])
            for _ in range(3):
                time.sleep(0.2)
                for m in (n1, n2):
                    assert all(peers_alive(m).values()), m.stat()["peers"]
        assert "lost connection to peer" in n1.log() + n2.log()  # they were cut
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    assert sum(opened) > 1000, opened  # it was a flood
    for m in (n1, n2):
        m.allowed_log += PEER_LOGS + ["more refused peer connections", "is dead"]
        assert "is dead" not in m.log()[logged[m.mnt] :]
        assert "connections in the handshake" in m.log()
    n1.umount()
    n2.umount()
