"""Mutual authentication of two ckptfs nodes over a fresh connection.

Both nodes hold the same cluster secret K (bytes, at least 16). Neither sends
it: each proves it knows K with an HMAC-SHA256 over a transcript that binds
both sides' fresh random nonces, both node names, both cluster hashes and the
prover's role. The handshake frames (see wire.py) all use request id 0 and
carry no payload; the client is the side that dialled:

    client                                          server
    1. HELLO {"node": C, "nonce": hex(Nc), "cluster": Hc}  ->
                       <-  2. HELLO {"node": S, "nonce": hex(Ns), "cluster": Hs}
       S must be the node the client meant to dial, and Ns != Nc
    3. PROOF {"proof": hex(HMAC(K, T("client")))}          ->
                              the server checks the client's proof
                       <-  4. PROOF {"proof": hex(HMAC(K, T("server")))}
       the client checks the server's proof, then compares Hc with Hs
    5. READY {}                                            ->
                              the server compares Hc with Hs
       from here on the connection carries REQUEST/RESPONSE/CANCEL frames;
       the client sends requests right after READY, without waiting

    T(role) = the concatenation, each field as a 2-byte big-endian length and
              then its bytes, of: b"ckptfs-peer-auth-v1", role (b"client" or
              b"server"), C, S, Nc, Ns, Hc, Hs (names and hashes UTF-8,
              nonces the 32 raw bytes).

Whichever side refuses sends ERROR {"error": reason} and closes. A bad
client proof is answered only "authentication failed" (a frame that breaks
the wire format gets the protocol error's message). Cluster hashes are
compared only once both proofs have verified, so a mismatch is reported only
between nodes that share the secret, and never hides a wrong secret; it is
refused by both sides, each logging the two hashes. Proofs compare with
hmac.compare_digest. Each handshake has one deadline (default 5 s) covering
every receive.

What this does and does not give: a replayed or reflected proof never
verifies (fresh nonces of both sides, role bound). The HELLOs, names and
cluster hashes included, travel before any proof and in clear unless TLS is
used. K proves membership of the cluster, not identity: any holder of K could
claim any node name. The server therefore hands the name a client's HELLO
claims to ``on_hello`` before anything else (server.py passes identity.py's
check: the name must be a configured node's, from that node's address); a
refusal there is told to the client with its reason. Without TLS the frames
after the handshake are not protected from an active attacker on the path;
pass an ssl.SSLContext to the transport for that.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import re
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol

import trio
from ckptfs.peer.config import MIN_SECRET_BYTES
from ckptfs.peer.transport.wire import FrameType, PeerError

log = logging.getLogger("ckptfs.peer")

HANDSHAKE_TIMEOUT = 5.0
NONCE_BYTES = 32
MAX_NODE_NAME = 255  # bytes of UTF-8
MAX_CLUSTER_HASH = 128  # characters
LABEL = b"ckptfs-peer-auth-v1"
REFUSE_SEND_TIMEOUT = 1.0
_HEX = re.compile(r"[0-9a-f]*")


class AuthError(PeerError):
    """The handshake failed or was refused (one-line message)."""


class ControlChannel(Protocol):
    """What the handshake needs from a connection (transport's channel)."""

    async def send_control(self, ftype: FrameType, meta: dict[str, Any]) -> None: ...

    async def receive_control(self) -> tuple[FrameType, dict[str, Any]]: ...


class _Refusal(Exception):
    """Internal: refuse with `message` locally, and tell the peer `tell_peer`."""

    def __init__(self, message: str, tell_peer: str | None) -> None:
        super().__init__(message)
        self.tell_peer = tell_peer


def check_node_name(name: object) -> str:
    if not isinstance(name, str) or not name or not name.isprintable():
        raise ValueError(f"node name must be a non-empty printable string, not {name!r:.80}")
    if len(name.encode("utf-8")) > MAX_NODE_NAME:
        raise ValueError(f"node name is over {MAX_NODE_NAME} bytes: {name!r:.80}")
    return name


def check_cluster_hash(value: object) -> str:
    if not isinstance(value, str) or not value or not value.isprintable():
        raise ValueError(f"cluster hash must be a non-empty printable string, not {value!r:.80}")
    if len(value) > MAX_CLUSTER_HASH:
        raise ValueError(f"cluster hash is over {MAX_CLUSTER_HASH} characters")
    return value


def check_secret(secret: object) -> bytes:
    if not isinstance(secret, bytes | bytearray | memoryview):
        raise ValueError(f"the cluster secret must be bytes, not {type(secret).__name__}")
    if len(secret) < MIN_SECRET_BYTES:
        # A short secret could be guessed offline from one recorded handshake.
        raise ValueError(f"the cluster secret must be at least {MIN_SECRET_BYTES} bytes")
    return bytes(secret)


def one_line(text: object, limit: int = 300) -> str:
    """`text` made safe for a log line or an ERROR frame: printable, bounded."""
    flat = " ".join(str(text).split())
    flat = "".join(c if c.isprintable() else "?" for c in flat)
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


def _hex_field(meta: dict[str, Any], key: str, size: int) -> bytes:
    value = meta.get(key)
    # Checked by hand: bytes.fromhex would also accept spaces and upper case.
    if not isinstance(value, str) or len(value) != 2 * size or not _HEX.fullmatch(value):
        raise ValueError(f"{key!r} must be {2 * size} lowercase hex digits")
    return bytes.fromhex(value)


@dataclass(frozen=True, slots=True)
class Hello:
    node: str
    nonce: bytes
    cluster: str

    def to_meta(self) -> dict[str, Any]:
        return {"node": self.node, "nonce": self.nonce.hex(), "cluster": self.cluster}

    @classmethod
    def from_meta(cls, meta: dict[str, Any], sender: str) -> Hello:
        try:
            node = check_node_name(meta.get("node"))
            nonce = _hex_field(meta, "nonce", NONCE_BYTES)
            cluster = check_cluster_hash(meta.get("cluster"))
        except ValueError as exc:
            raise _Refusal(f"malformed HELLO from {sender}: {exc}", "malformed HELLO") from None
        return cls(node, nonce, cluster)


def transcript(role: bytes, client: Hello, server: Hello) -> bytes:
    """What a proof signs (see the module docstring for the layout)."""
    fields = (
        LABEL,
        role,
        client.node.encode("utf-8"),
        server.node.encode("utf-8"),
        client.nonce,
        server.nonce,
        client.cluster.encode("utf-8"),
        server.cluster.encode("utf-8"),
    )
    return b"".join(len(f).to_bytes(2, "big") + f for f in fields)


def make_proof(secret: bytes, role: bytes, client: Hello, server: Hello) -> bytes:
    return hmac.new(secret, transcript(role, client, server), hashlib.sha256).digest()


async def _expect(channel: ControlChannel, wanted: FrameType, sender: str) -> dict[str, Any]:
    ftype, meta = await channel.receive_control()
    if ftype is FrameType.ERROR:
        raise _Refusal(f"{sender} refused: {one_line(meta.get('error'))}", None)
    if ftype is not wanted:
        raise _Refusal(f"{sender} sent {ftype.name} instead of {wanted.name}", "unexpected frame")
    return meta


def _proof_of(meta: dict[str, Any], sender: str) -> bytes:
    try:
        return _hex_field(meta, "proof", hashlib.sha256().digest_size)
    except ValueError as exc:
        raise _Refusal(f"malformed PROOF from {sender}: {exc}", "malformed PROOF") from None


def _mismatch(here: str, ours: str, there: str, theirs: str) -> str:
    return f"cluster hash mismatch: {here} has {ours}, {there} has {theirs}"


async def _client_steps(
    channel: ControlChannel, node: str, expect_node: str, secret: bytes, cluster_hash: str
) -> str:
    mine = Hello(node, secrets.token_bytes(NONCE_BYTES), cluster_hash)
    await channel.send_control(FrameType.HELLO, mine.to_meta())
    theirs = Hello.from_meta(await _expect(channel, FrameType.HELLO, "server"), "server")
    if theirs.node != expect_node:
        raise _Refusal(
            f"reached node {theirs.node!r}, expected {expect_node!r}",
            f"wrong node: dialled {expect_node!r}, reached {theirs.node!r}",
        )
    if theirs.nonce == mine.nonce:
        raise _Refusal(f"server {theirs.node!r} reflected our nonce", "reflected nonce")
    proof = make_proof(secret, b"client", mine, theirs)
    await channel.send_control(FrameType.PROOF, {"proof": proof.hex()})
    server = f"server {theirs.node!r}"
    got = _proof_of(await _expect(channel, FrameType.PROOF, server), server)
    if not hmac.compare_digest(got, make_proof(secret, b"server", mine, theirs)):
        raise _Refusal(f"{server} failed to prove it knows the cluster secret", "bad proof")
    if theirs.cluster != mine.cluster:
        reason = _mismatch(f"client {node!r}", mine.cluster, server, theirs.cluster)
        log.warning("refusing peer connection: %s", reason)
        raise _Refusal(reason, reason)
    await channel.send_control(FrameType.READY, {})
    return theirs.node


# Called with the node a client's HELLO claims; raises AuthError to refuse it.
HelloCheck = Callable[[str], Awaitable[None]]


async def _server_steps(
    channel: ControlChannel,
    node: str,
    secret: bytes,
    cluster_hash: str,
    on_hello: HelloCheck | None = None,
) -> str:
    theirs = Hello.from_meta(await _expect(channel, FrameType.HELLO, "client"), "client")
    if on_hello is not None:
        try:
            await on_hello(theirs.node)
        except AuthError as exc:
            raise _Refusal(str(exc), str(exc)) from None
    mine = Hello(node, secrets.token_bytes(NONCE_BYTES), cluster_hash)
    await channel.send_control(FrameType.HELLO, mine.to_meta())
    client = f"client claiming to be {theirs.node!r}"
    got = _proof_of(await _expect(channel, FrameType.PROOF, client), client)
    if not hmac.compare_digest(got, make_proof(secret, b"client", theirs, mine)):
        # Nothing more precise is told to a peer that has not proved it holds the secret.
        message = f"{client} failed to prove it knows the cluster secret"
        raise _Refusal(message, "authentication failed")
    proof = make_proof(secret, b"server", theirs, mine)
    await channel.send_control(FrameType.PROOF, {"proof": proof.hex()})
    client = f"client {theirs.node!r}"
    mismatch = _mismatch(f"server {node!r}", mine.cluster, client, theirs.cluster)
    try:
        await _expect(channel, FrameType.READY, client)
    except _Refusal:
        if theirs.cluster == mine.cluster:
            raise
        # The client saw the mismatch first and refused; log our own view of it.
        raise _Refusal(mismatch, None) from None
    if theirs.cluster != mine.cluster:
        raise _Refusal(mismatch, mismatch)  # only a faulty client says READY here
    return theirs.node


async def _refuse(channel: ControlChannel, reason: str) -> None:
    with trio.move_on_after(REFUSE_SEND_TIMEOUT):
        try:
            await channel.send_control(FrameType.ERROR, {"error": one_line(reason)})
        except PeerError:
            pass  # the peer may already be gone; we are closing anyway


async def _run(
    channel: ControlChannel, steps: Callable[[], Awaitable[str]], what: str, timeout: float
) -> str:
    try:
        with trio.fail_after(timeout):
            return await steps()
    except _Refusal as exc:
        if exc.tell_peer is not None:
            await _refuse(channel, exc.tell_peer)
        raise AuthError(one_line(exc)) from None
    except trio.TooSlowError:
        raise AuthError(f"{what} timed out after {timeout:g}s") from None
    except AuthError:
        raise
    except PeerError as exc:
        # A protocol error (e.g. another protocol version): say why before closing.
        await _refuse(channel, f"handshake failed: {exc}")
        raise AuthError(one_line(f"{what} failed: {exc}")) from exc


async def client_handshake(
    channel: ControlChannel,
    *,
    node: str,
    expect_node: str,
    secret: bytes,
    cluster_hash: str,
    timeout: float = HANDSHAKE_TIMEOUT,
) -> str:
    """Authenticate as the dialling side; returns the server's node name."""
    steps = partial(_client_steps, channel, node, expect_node, check_secret(secret), cluster_hash)
    return await _run(channel, steps, f"handshake with {expect_node!r}", timeout)


async def server_handshake(
    channel: ControlChannel,
    *,
    node: str,
    secret: bytes,
    cluster_hash: str,
    timeout: float = HANDSHAKE_TIMEOUT,
    on_hello: HelloCheck | None = None,
) -> str:
    """Authenticate as the accepting side; returns the client's node name.
    ``on_hello`` may refuse the name the client claims (see the module docstring)."""
    steps = partial(_server_steps, channel, node, check_secret(secret), cluster_hash, on_hello)
    return await _run(channel, steps, "handshake", timeout)
