"""The peers config (validation, defaults, cluster hash) and heartbeat membership.

Membership tests run real nodes on loopback in one trio.run under a deadline:
each node has its own transport server and Membership, with short heartbeat
and timeout so that deaths are declared in well under a second.
"""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import trio
from ckptfs.fs.config import ConfigError
from ckptfs.peer.config import (
    Address,
    PeersConfig,
    parse_address,
    parse_duration,
    parse_peers,
    ssl_contexts,
)
from ckptfs.peer.membership.membership import HEARTBEAT, Membership, Status
from ckptfs.peer.transport.transport import Request, Response, serve
from ports import free_ports
from waits import run_bounded, until

SECRET = b"membership-test-secret-0123456789"
HEARTBEAT_S = 0.1
TIMEOUT_S = 1.0
SETTLE = 3.0  # bound on waits that a loaded machine may stretch


# ------------------------------------------------------------------ config


@pytest.fixture
def secret(tmp_path: Path) -> Path:
    path = tmp_path / "secret"
    path.write_bytes(SECRET + b"\n")
    path.chmod(0o600)
    return path


def raw_peers(secret: Path, **overrides: Any) -> dict[str, Any]:
    raw: dict[str, Any] = {
        "nodes": {"n1": "10.0.0.1:7070", "n2": "10.0.0.2:7070", "n3": "10.0.0.3:7070"},
        "secret_file": str(secret),
    }
    raw.update(overrides)
    return {k: v for k, v in raw.items() if v is not None}


def parse(secret: Path, node: str = "n1", **overrides: Any) -> PeersConfig:
    config = parse_peers(raw_peers(secret, **overrides), node)
    assert config is not None
    return config


def test_defaults_and_ring_buddies(secret: Path) -> None:
    config = parse(secret, node="n2")
    assert config.node == "n2"
    assert config.listen == Address("0.0.0.0", 7070)
    assert list(config.nodes) == ["n1", "n2", "n3"]
    assert config.nodes["n3"] == Address("10.0.0.3", 7070)
    assert dict(config.buddies) == {"n1": "n2", "n2": "n3", "n3": "n1"}
    assert config.buddy == "n3" and config.mirrored_for() == ("n1",)
    assert config.peers == ("n1", "n3")
    assert (config.timeout, config.heartbeat, config.tls) == (5.0, 1.0, None)
    assert config.secret == SECRET  # the editor's newline is not part of it
    assert "membership-test-secret" not in repr(config)
    assert parse_peers(None, "n1") is None and parse_peers({}, "n1") is None


def test_explicit_values(secret: Path) -> None:
    config = parse(
        secret,
        node="n3",
        listen="[::]:7171",
        buddies={"n1": "n3"},  # the others keep the ring default
        timeout="2s",
        heartbeat="250ms",
    )
    assert config.listen == Address("::", 7171) and str(config.listen) == "[::]:7171"
    assert dict(config.buddies) == {"n1": "n3", "n2": "n3", "n3": "n1"}
    assert config.mirrored_for() == ("n1", "n2")
    assert (config.timeout, config.heartbeat) == (2.0, 0.25)


def test_addresses_are_normalized() -> None:
    assert parse_address("[0:0::1]:80", "k") == Address("::1", 80)
    assert str(parse_address("[0:0::1]:80", "k")) == "[::1]:80"
    assert parse_address(" Node-1.Example.COM:7070 ", "k") == Address("node-1.example.com", 7070)
    assert parse_duration(3, "k") == 3.0 and parse_duration("1.5", "k") == 1.5


NODES = {"n1": "10.0.0.1:7070", "n2": "10.0.0.2:7070", "n3": "10.0.0.3:7070"}
BAD_CONFIGS: dict[str, tuple[dict[str, Any], str, str, str]] = {
    # name: (overrides, node, key named, words in the message)
    "no port": ({"nodes": {**NODES, "n2": "10.0.0.2"}}, "n1", "peers.nodes.n2", "host:port"),
    "port range": ({"nodes": {**NODES, "n3": "h:70000"}}, "n1", "peers.nodes.n3", "1..65535"),
    "port zero": ({"nodes": {**NODES, "n3": "h:0"}}, "n1", "peers.nodes.n3", "1..65535"),
    "port text": ({"nodes": {**NODES, "n3": "h:http"}}, "n1", "peers.nodes.n3", "number"),
    "bare ipv6": ({"nodes": {**NODES, "n3": "::1:7070"}}, "n1", "peers.nodes.n3", "[addr]"),
    "bad ipv6": ({"nodes": {**NODES, "n3": "[::g]:7070"}}, "n1", "peers.nodes.n3", "IPv6"),
    "bad host": ({"nodes": {**NODES, "n3": "a b:7070"}}, "n1", "peers.nodes.n3", "host name"),
    "yaml number": ({"nodes": {**NODES, "n3": 7070}}, "n1", "peers.nodes.n3", "host:port"),
    "same address": (
        {"nodes": {**NODES, "n3": "10.0.0.1:7070"}},
        "n1",
        "peers.nodes.n3",
        "same address",
    ),
    "bad name": ({"nodes": {**NODES, "n 4": "h:1"}}, "n1", "peers.nodes", "bad node name"),
    "one node": ({"nodes": {"n1": "h:1"}}, "n1", "peers.nodes", "at least two"),
    "no nodes": ({"nodes": None}, "n1", "peers.nodes", "required"),
    "nodes list": ({"nodes": ["n1", "n2"]}, "n1", "peers.nodes", "mapping"),
    "bad listen": ({"listen": "0.0.0.0"}, "n1", "peers.listen", "host:port"),
    "listen range": ({"listen": "0.0.0.0:65536"}, "n1", "peers.listen", "1..65535"),
    "not listed": ({}, "n9", "node", "'n9' is not in peers.nodes"),
    "unknown buddy": ({"buddies": {"n1": "n9"}}, "n1", "peers.buddies.n1", "unknown buddy 'n9'"),
    "unknown node": ({"buddies": {"n9": "n1"}}, "n1", "peers.buddies.n9", "unknown node"),
    "own buddy": ({"buddies": {"n2": "n2"}}, "n1", "peers.buddies.n2", "its own buddy"),
    "unknown key": ({"bogus": 1}, "n1", "peers.bogus", "unknown key"),
    "timeout": ({"timeout": "-1"}, "n1", "peers.timeout", "seconds"),
    "timeout zero": ({"timeout": 0}, "n1", "peers.timeout", "positive"),
    "heartbeat": ({"heartbeat": "soon"}, "n1", "peers.heartbeat", "seconds"),
    "heartbeat slow": ({"heartbeat": 5, "timeout": 5}, "n1", "peers.heartbeat", "shorter"),
    "no secret": ({"secret_file": None}, "n1", "peers.secret_file", "required"),
    "missing secret": ({"secret_file": "/nonexistent/s"}, "n1", "peers.secret_file", "not exist"),
    "tls no key": ({"tls": {"cert": "/etc/hostname"}}, "n1", "peers.tls.key", "required"),
    "tls key": ({"tls": {"crt": "x"}}, "n1", "peers.tls.crt", "unknown key"),
}


@pytest.mark.parametrize("case", sorted(BAD_CONFIGS))
def test_bad_config_is_a_one_line_error_naming_the_key(secret: Path, case: str) -> None:
    overrides, node, key, words = BAD_CONFIGS[case]
    with pytest.raises(ConfigError) as info:
        parse_peers(raw_peers(secret, **overrides), node)
    message = str(info.value)
    assert info.value.key == key, message
    assert message.startswith(f"config key '{key}': ") and "\n" not in message
    assert words in message, message


@pytest.mark.parametrize(
    ("mode", "content", "words"),
    [
        (0o640, SECRET, "accessible by group or others (mode 640)"),
        (0o602, SECRET, "mode 602"),
        (0o620, SECRET, "mode 620"),
        (0o600, b"", "is empty"),
        (0o600, b"\n\n", "is empty"),
        (0o600, b"short", "at least 16"),
    ],
)
def test_secret_file_checks(tmp_path: Path, mode: int, content: bytes, words: str) -> None:
    path = tmp_path / "secret"
    path.write_bytes(content)
    path.chmod(mode)
    with pytest.raises(ConfigError) as info:
        parse_peers(raw_peers(path), "n1")
    assert info.value.key == "peers.secret_file" and words in str(info.value)


def test_secret_file_may_be_owner_only_and_read_only(tmp_path: Path) -> None:
    path = tmp_path / "secret"
    path.write_bytes(SECRET)
    path.chmod(0o400)
    assert parse(path).secret == SECRET


def test_cluster_hash_is_stable_and_shape_dependent(secret: Path, tmp_path: Path) -> None:
    base = parse(secret).cluster_hash
    # The same on every node, whatever its own name, listen address or timing.
    assert parse(secret, node="n3", listen="127.0.0.1:9", timeout=9).cluster_hash == base
    other_secret = tmp_path / "other"
    other_secret.write_bytes(b"another-secret-0123456789")
    other_secret.chmod(0o600)
    assert parse(other_secret).cluster_hash == base
    # A fixed value: nodes running different versions must still agree.
    assert base == "eb14551ee2fca482664ec72e8e42f407"
    # Listing order alone does not matter when the buddies stay the same ...
    ring = {"n1": "n2", "n2": "n3", "n3": "n1"}
    reordered = {k: NODES[k] for k in ("n1", "n3", "n2")}
    assert parse(secret, nodes=reordered, buddies=ring).cluster_hash == base
    # ... but a new order makes another default ring, and so another hash;
    rotated = {k: NODES[k] for k in ("n3", "n1", "n2")}  # (a rotation is the same ring)
    assert parse(secret, nodes=rotated).cluster_hash == base
    assert parse(secret, nodes=reordered).cluster_hash != base
    changed = [
        parse(secret, nodes={**NODES, "n4": "10.0.0.4:7070"}),
        parse(secret, nodes={**NODES, "n3": "10.0.0.3:7071"}),
        parse(secret, buddies={"n1": "n3", "n3": "n2", "n2": "n1"}),
    ]
    hashes = {c.cluster_hash for c in changed}
    assert len(hashes) == 3 and base not in hashes


def test_tls_contexts(secret: Path, tmp_path: Path) -> None:
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("openssl is not installed")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [openssl, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1"]
        + ["-nodes", "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=n1"],
        check=True,
        capture_output=True,
        timeout=30,
    )
    config = parse(secret, tls={"cert": str(cert), "key": str(key), "ca": str(cert)})
    contexts = ssl_contexts(config)
    assert contexts is not None
    server, _client = contexts
    assert server.verify_mode.name == "CERT_REQUIRED"  # with a ca: mutual TLS
    assert ssl_contexts(parse(secret)) is None

    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate\n")
    bad = parse(secret, tls={"cert": str(garbage), "key": str(key)})
    with pytest.raises(ConfigError) as info:
        ssl_contexts(bad)
    assert info.value.key == "peers.tls.cert" and "\n" not in str(info.value)


# ------------------------------------------------------------------ membership


def cluster(names: list[str], ports: list[int]) -> dict[str, str]:
    return {name: f"127.0.0.1:{port}" for name, port in zip(names, ports, strict=True)}


class Node:
    """One node: its config, its Membership and a server that can be stopped."""

    def __init__(self, secret: Path, name: str, nodes: dict[str, str]) -> None:
        raw = {"nodes": nodes, "secret_file": str(secret), "timeout": TIMEOUT_S}
        config = parse_peers({**raw, "heartbeat": HEARTBEAT_S}, name)
        assert config is not None
        self.config = config
        self.name = name
        self.events: list[tuple[str, str]] = []
        self.membership = Membership(
            config,
            on_alive=lambda peer: self.events.append(("alive", peer)),
            on_dead=lambda peer: self.events.append(("dead", peer)),
        )
        self.hang_heartbeats = False
        self._server_scope: trio.CancelScope | None = None
        self._server_done = trio.Event()

    async def handler(self, peer: str, request: Request) -> Response:
        if request.type != HEARTBEAT:
            return Response.fail(f"unknown request type {request.type!r}")
        if self.hang_heartbeats:  # a stalled daemon: connected, never answers
            await trio.sleep_forever()
        return await self.membership.handle_heartbeat(peer, request)

    async def _serve(self, task_status: trio.TaskStatus[list[trio.SocketListener]]) -> None:
        try:
            with trio.CancelScope() as self._server_scope:
                await serve(
                    "127.0.0.1",
                    self.config.nodes[self.name].port,
                    node=self.name,
                    secret=self.config.secret,
                    cluster_hash=self.config.cluster_hash,
                    handler=self.handler,
                    task_status=task_status,
                )
        finally:
            self._server_done.set()

    async def start_server(self, nursery: trio.Nursery) -> None:
        self._server_done = trio.Event()
        await nursery.start(self._serve)

    async def stop_server(self) -> None:
        """Close the listener and every accepted connection, and wait for it."""
        assert self._server_scope is not None
        self._server_scope.cancel()
        await self._server_done.wait()

    async def start(self, nursery: trio.Nursery) -> None:
        await self.start_server(nursery)
        await nursery.start(self.membership.run)


async def wait_all(nodes: list[Node], peer: str, *, alive: bool, timeout: float) -> None:
    for node in nodes:
        reached = await node.membership.wait_until(peer, alive=alive, timeout=timeout)
        state = "alive" if alive else "dead"
        assert reached, f"{node.name} does not see {peer} {state}: {node.membership.stats()}"


def refused_by_hash(node: Node, peer: str) -> bool:
    return "cluster hash mismatch" in (node.membership.peer(peer).last_error or "")


def refusals(caplog: pytest.LogCaptureFixture) -> int:
    """Connections a server refused for a cluster hash mismatch, per its log."""
    return sum(
        "refused peer connection" in m and "cluster hash mismatch" in m
        for m in (r.getMessage() for r in caplog.records)
    )


def last_event(node: Node, peer: str) -> tuple[str, str] | None:
    return next((e for e in reversed(node.events) if e[1] == peer), None)


# A loaded machine can stall the shared event loop past the timeout, and then a
# peer is (rightly) declared dead and alive again. The tests below assert the
# transitions they cause and never the absence of unrelated ones.


def test_three_nodes_dead_and_alive_again(secret: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="ckptfs.peer")
    names = ["n1", "n2", "n3"]
    ports = free_ports(3)
    nodes = [Node(secret, name, cluster(names, ports)) for name in names]
    n1, n2, n3 = nodes
    # An impostor at n3's address, as "n3", but with a different node list.
    impostor = Node(secret, "n3", cluster([*names, "n4"], [*ports, free_ports(1)[0]]))
    assert impostor.config.cluster_hash != n3.config.cluster_hash

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            for node in nodes:
                await node.start(nursery)
            for node in nodes:
                others = [n for n in nodes if n is not node]
                await wait_all(others, node.name, alive=True, timeout=SETTLE)
            assert n1.membership.alive_nodes() == names
            assert {("alive", "n2"), ("alive", "n3")} <= set(n1.events)

            stats = n1.membership.stats()
            json.dumps(stats)
            assert stats["node"] == "n1" and stats["buddy"] == "n2"
            assert [p["name"] for p in stats["peers"]] == ["n2", "n3"]
            for peer, port in zip(stats["peers"], ports[1:], strict=True):
                assert peer["address"] == f"127.0.0.1:{port}" and peer["alive"]
                assert 0 <= peer["last_heartbeat_age"] < SETTLE and peer["failures"] == 0

            # n3's server goes away: n1 and n2 declare it dead after the timeout.
            stopped = trio.current_time()
            await n3.stop_server()
            await wait_all([n1, n2], "n3", alive=False, timeout=TIMEOUT_S + SETTLE)
            elapsed = trio.current_time() - stopped
            assert TIMEOUT_S - 2 * HEARTBEAT_S <= elapsed <= TIMEOUT_S + SETTLE, elapsed
            for node in (n1, n2):
                assert last_event(node, "n3") == ("dead", "n3")
                assert "n3" not in node.membership.alive_nodes()
                assert node.membership.connection("n3") is None
                peer = next(p for p in node.membership.stats()["peers"] if p["name"] == "n3")
                assert peer["alive"] is False and peer["state"] == "dead"
            # n3 still reaches the others: liveness is per direction.
            await wait_all([n3], "n1", alive=True, timeout=SETTLE)

            # A node with another node list at n3's address is refused, never alive.
            before = {node.name: len(node.events) for node in (n1, n2)}
            await impostor.start_server(nursery)
            # Several attempts each, all refused: the impostor never counts as alive.
            await until(
                lambda: (
                    refused_by_hash(n1, "n3")
                    and refused_by_hash(n2, "n3")
                    and refusals(caplog) >= 6
                ),
                "refusals by the impostor",
                3 * SETTLE,
            )
            await impostor.stop_server()
            for node in (n1, n2):
                assert ("alive", "n3") not in node.events[before[node.name] :]
                assert node.membership.peer("n3").status is Status.DEAD

            # The real n3 comes back: alive again on both, with on_alive.
            await n3.start_server(nursery)
            await wait_all([n1, n2], "n3", alive=True, timeout=TIMEOUT_S + SETTLE)
            for node in (n1, n2):
                assert last_event(node, "n3") == ("alive", "n3")
            nursery.cancel_scope.cancel()

    run_bounded(main)
    messages = [r.getMessage() for r in caplog.records]
    # Both sides of a refused handshake say why.
    assert any("refusing peer connection: cluster hash mismatch" in m for m in messages)
    assert any("peer 'n3'" in m and "is dead" in m for m in messages)


def test_node_with_another_node_list_never_joins(secret: Path) -> None:
    names = ["n1", "n2"]
    ports = free_ports(3)
    nodes = [Node(secret, name, cluster(names, ports[:2])) for name in names]
    stranger = Node(secret, "n4", cluster([*names, "n4"], ports))

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            for node in [*nodes, stranger]:
                await node.start(nursery)
            await wait_all(nodes, "n1", alive=True, timeout=SETTLE)
            await wait_all(nodes, "n2", alive=True, timeout=SETTLE)
            # Never answered: unknown -> dead after the timeout, with on_dead.
            dead = {("dead", "n1"), ("dead", "n2")}
            await until(lambda: dead <= set(stranger.events), "deaths", TIMEOUT_S + SETTLE)
            await until(lambda: refused_by_hash(stranger, "n1"), "refusals", 3 * SETTLE)
            assert set(stranger.events) == dead
            assert stranger.membership.alive_nodes() == ["n4"]
            for node in nodes:  # n4 is no peer of theirs: not even listed
                assert "n4" not in [p["name"] for p in node.membership.stats()["peers"]]
                assert "n4" not in node.membership.alive_nodes()
            nursery.cancel_scope.cancel()

    run_bounded(main)


def test_stalled_peer_is_declared_dead_without_hanging(secret: Path) -> None:
    names = ["n1", "n2"]
    ports = free_ports(2)
    nodes = [Node(secret, name, cluster(names, ports)) for name in names]
    n1, n2 = nodes

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            for node in nodes:
                await node.start(nursery)
            await wait_all([n1], "n2", alive=True, timeout=SETTLE)
            # n2 accepts requests but never answers (like a SIGSTOPped daemon).
            n2.hang_heartbeats = True
            stalled = trio.current_time()
            await wait_all([n1], "n2", alive=False, timeout=TIMEOUT_S + SETTLE)
            assert trio.current_time() - stalled <= TIMEOUT_S + SETTLE
            assert last_event(n1, "n2") == ("dead", "n2")
            # Heartbeats go on, each bounded by the timeout, and fail.
            failures = n1.membership.peer("n2").failures
            await until(
                lambda: n1.membership.peer("n2").failures >= failures + 2, "failures", 3 * TIMEOUT_S
            )
            assert "timed out" in (n1.membership.peer("n2").last_error or "")
            n2.hang_heartbeats = False
            await wait_all([n1], "n2", alive=True, timeout=TIMEOUT_S + SETTLE)
            assert last_event(n1, "n2") == ("alive", "n2")
            nursery.cancel_scope.cancel()

    run_bounded(main)


def test_heartbeat_from_a_non_peer_is_refused(secret: Path) -> None:
    node = Node(secret, "n1", cluster(["n1", "n2"], [1, 2]))

    async def main() -> None:
        request = Request(HEARTBEAT, {}, memoryview(b""))
        response = await node.membership.handle_heartbeat("n7", request)
        assert not response.ok and "not a peer" in (response.error or "")
        response = await node.membership.handle_heartbeat("n2", request)
        assert response.ok and response.meta["node"] == "n1"

    run_bounded(main)
