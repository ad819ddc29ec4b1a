"""The ``peers`` section of the mount config: parsed, validated, frozen.

    peers:
      listen: 0.0.0.0:7070          # default: 0.0.0.0 (or ::) and this node's port
      nodes: {n1: 10.0.0.1:7070, n2: 10.0.0.2:7070, n3: 10.0.0.3:7070}
      buddies: {n1: n2}             # default: a ring in the order of nodes
      secret_file: /etc/ckptfs/secret
      timeout: 5                    # seconds without an answer: the peer is dead
      heartbeat: 1                  # seconds between heartbeats, < timeout
      tls: {cert: ..., key: ..., ca: ...}   # optional; cert and key together

``parse_peers(raw, node)`` runs once at mount. Every problem raises the
project's ConfigError, one line naming the key (``peers.nodes.n2``,
``peers.secret_file``, ...), so a bad cluster config never gets as far as a
running daemon.

Addresses are ``host:port`` (IPv6 as ``[addr]:port``), port 1..65535. Node
names follow the rule of the ``node`` key. A node missing from ``buddies``
gets the ring default (the next node in ``nodes``, the last wraps to the
first). The secret file must be a non-empty regular file with no permission
bits for group or others; trailing whitespace (an editor's newline) is not
part of the secret, and at least 16 bytes must remain.

The cluster hash covers the node names, their addresses and the resolved
buddies, sorted, so the listing order alone does not change it. Nodes whose
hashes differ refuse each other at the handshake (see auth.py): a node with a
stale node list never joins, and never mirrors to a buddy that disagrees
about who its buddy is.
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import os
import re
import ssl
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, NamedTuple

from ckptfs.fs.configerror import ConfigError

MIN_SECRET_BYTES = 16  # of the cluster secret

DEFAULT_TIMEOUT = 5.0
DEFAULT_HEARTBEAT = 1.0
SECTION = "peers"
KEYS = ("listen", "nodes", "buddies", "secret_file", "timeout", "heartbeat", "tls")
TLS_KEYS = ("cert", "key", "ca")
# The same rule as the top-level `node` key (fs/config.py), so any name that
# is valid there is valid here.
_NODE_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_HOSTNAME = re.compile(r"[A-Za-z0-9_]([A-Za-z0-9_.-]{0,252})")
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s)?\s*$")
_CLUSTER_HASH_LABEL = "ckptfs-cluster-v1"


class Address(NamedTuple):
    """A normalized host and port; ``str()`` gives ``host:port`` back."""

    host: str
    port: int

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


@dataclass(frozen=True)
class TLSFiles:
    cert: Path
    key: Path
    ca: Path | None


@dataclass(frozen=True)
class PeersConfig:
    """The validated ``peers`` section, as seen by node `node`.

    `nodes` keeps the configured order (the ring order); `buddies` maps every
    node to its buddy. Both are read-only mappings.
    """

    node: str
    listen: Address
    nodes: Mapping[str, Address] = field(hash=False)
    buddies: Mapping[str, str] = field(hash=False)
    secret_file: Path
    secret: bytes = field(repr=False)  # never in a log line or a traceback
    timeout: float
    heartbeat: float
    cluster_hash: str
    tls: TLSFiles | None = None

    @property
    def buddy(self) -> str:
        """The node that mirrors this node's files."""
        return self.buddies[self.node]

    @property
    def peers(self) -> tuple[str, ...]:
        """Every other node, in the configured order."""
        return tuple(name for name in self.nodes if name != self.node)

    def mirrored_for(self) -> tuple[str, ...]:
        """The nodes whose files this node mirrors (whose buddy it is)."""
        return tuple(name for name, buddy in self.buddies.items() if buddy == self.node)


# ---------------------------------------------------------------- values


def parse_address(value: Any, key: str) -> Address:
    """``host:port`` or ``[v6addr]:port`` with port 1..65535, host normalized."""
    if not isinstance(value, str):
        # YAML turns some unquoted values into numbers (7070, or 1:20 as base 60).
        raise ConfigError(key, f"expected host:port, got {value!r}")
    text = value.strip()
    host, sep, port_text = text.rpartition(":")
    if not sep or not host or not port_text:
        raise ConfigError(key, f"expected host:port, got {value!r}")
    return Address(_host(host, value, key), _port(port_text, value, key))


def _host(host: str, value: str, key: str) -> str:
    if host.startswith("[") and host.endswith("]"):
        try:
            return ipaddress.IPv6Address(host[1:-1]).compressed
        except ValueError:
            raise ConfigError(key, f"bad IPv6 address in {value!r}") from None
    if ":" in host:
        raise ConfigError(key, f"write an IPv6 address as [addr]:port, got {value!r}")
    if not _HOSTNAME.fullmatch(host):
        raise ConfigError(key, f"bad host name in {value!r}")
    return host.lower()  # host names are case-insensitive; one spelling for the hash


def _port(text: str, value: str, key: str) -> int:
    if not text.isdigit() or not text.isascii():
        raise ConfigError(key, f"port must be a number, got {value!r}")
    port = int(text)
    if not 1 <= port <= 65535:
        raise ConfigError(key, f"port must be 1..65535, got {value!r}")
    return port


def parse_duration(value: Any, key: str) -> float:
    """Seconds: a number, ``"2s"`` or ``"500ms"``; must be positive."""
    if isinstance(value, bool):
        raise ConfigError(key, f"expected seconds, got {value!r}")
    if isinstance(value, int | float):
        seconds = float(value)
    else:
        m = _DURATION.match(str(value))
        if not m:
            raise ConfigError(key, f"expected seconds like 5, 2s or 500ms, got {value!r}")
        seconds = float(m.group(1)) / (1000 if m.group(2) == "ms" else 1)
    if not 0 < seconds < float("inf"):
        raise ConfigError(key, f"expected a positive number of seconds, got {value!r}")
    return seconds


def _node_name(value: Any, key: str) -> str:
    if not isinstance(value, str) or not _NODE_NAME.fullmatch(value):
        raise ConfigError(key, f"bad node name {value!r}: use letters, digits, '_', '.', '-'")
    return value


def _mapping(value: Any, key: str) -> dict[Any, Any]:
    if not isinstance(value, dict):
        raise ConfigError(key, f"expected a mapping, got {value!r:.80}")
    return value


def _existing_file(value: Any, key: str) -> Path:
    if not isinstance(value, str | os.PathLike) or not str(value):
        raise ConfigError(key, f"expected a path, got {value!r}")
    path = Path(value)
    if not path.is_file():
        raise ConfigError(key, f"{path} does not exist or is not a regular file")
    return path


# ---------------------------------------------------------------- sections


def _parse_nodes(value: Any) -> dict[str, Address]:
    key = f"{SECTION}.nodes"
    nodes: dict[str, Address] = {}
    seen: dict[Address, str] = {}
    for name, address in _mapping(value, key).items():
        name = _node_name(name, key)
        where = parse_address(address, f"{key}.{name}")
        if where in seen:
            raise ConfigError(f"{key}.{name}", f"same address {where} as node {seen[where]!r}")
        nodes[name], seen[where] = where, name
    if len(nodes) < 2:
        raise ConfigError(key, f"needs at least two nodes, got {len(nodes)}")
    return nodes


def ring_buddies(names: list[str]) -> dict[str, str]:
    """Each node's buddy is the next one; the last one's is the first."""
    return {name: names[(i + 1) % len(names)] for i, name in enumerate(names)}


def _parse_buddies(value: Any, nodes: Mapping[str, Address]) -> dict[str, str]:
    key = f"{SECTION}.buddies"
    buddies = ring_buddies(list(nodes))
    for name, buddy in _mapping({} if value is None else value, key).items():
        if name not in nodes:
            raise ConfigError(f"{key}.{name}", f"unknown node {name!r} (not in {SECTION}.nodes)")
        if not isinstance(buddy, str) or buddy not in nodes:
            raise ConfigError(f"{key}.{name}", f"unknown buddy {buddy!r} (not in {SECTION}.nodes)")
        if buddy == name:
            raise ConfigError(f"{key}.{name}", "a node cannot be its own buddy")
        buddies[name] = buddy
    return buddies


def read_secret(value: Any) -> tuple[Path, bytes]:
    """The secret file's path and contents, after checking its permissions."""
    key = f"{SECTION}.secret_file"
    if value is None:
        raise ConfigError(key, f"required when {SECTION}.nodes is set")
    path = _existing_file(value, key)
    mode = path.stat().st_mode
    if mode & (stat.S_IRGRP | stat.S_IWGRP | stat.S_IROTH | stat.S_IWOTH):
        # Anyone who can read it can join the cluster; anyone who can write it
        # can lock this node out.
        raise ConfigError(
            key, f"{path} is accessible by group or others (mode {mode & 0o777:o}); chmod 600 it"
        )
    try:
        secret = path.read_bytes().rstrip(b" \t\r\n")
    except OSError as exc:
        raise ConfigError(key, f"cannot read {path}: {exc.strerror}") from None
    if not secret:
        raise ConfigError(key, f"{path} is empty")
    if len(secret) < MIN_SECRET_BYTES:
        raise ConfigError(key, f"{path} holds {len(secret)} bytes, at least {MIN_SECRET_BYTES}")
    return path, secret


def _parse_tls(value: Any) -> TLSFiles | None:
    key = f"{SECTION}.tls"
    if value is None:
        return None
    raw = _mapping(value, key)
    for sub in raw:
        if sub not in TLS_KEYS:
            raise ConfigError(f"{key}.{sub}", "unknown key")
    if not raw:
        return None
    for needed in ("cert", "key"):
        if raw.get(needed) is None:
            raise ConfigError(f"{key}.{needed}", "required when TLS is configured")
    ca = raw.get("ca")
    return TLSFiles(
        cert=_existing_file(raw["cert"], f"{key}.cert"),
        key=_existing_file(raw["key"], f"{key}.key"),
        ca=None if ca is None else _existing_file(ca, f"{key}.ca"),
    )


def _default_listen(own: Address) -> Address:
    # Listen on every interface at the port the other nodes dial.
    return Address("::" if ":" in own.host else "0.0.0.0", own.port)


def cluster_hash(nodes: Mapping[str, Address], buddies: Mapping[str, str]) -> str:
    """A stable digest of the cluster's shape: names, addresses, buddies."""
    shape = {
        "label": _CLUSTER_HASH_LABEL,
        "nodes": sorted([name, str(address)] for name, address in nodes.items()),
        "buddies": sorted([name, buddy] for name, buddy in buddies.items()),
    }
    data = json.dumps(shape, separators=(",", ":"), sort_keys=True).encode()
    return hashlib.sha256(data).hexdigest()[:32]


def parse_peers(raw: Mapping[str, Any] | None, node: str) -> PeersConfig | None:
    """Validate the ``peers`` section for this `node`; None when no peers are set.

    Reads the secret file. Raises ConfigError (one line naming the key).
    """
    if not raw:
        return None
    raw = _mapping(raw, SECTION)
    for sub in raw:
        if sub not in KEYS:
            raise ConfigError(f"{SECTION}.{sub}", "unknown key")
    if raw.get("nodes") is None:
        raise ConfigError(f"{SECTION}.nodes", f"required when {SECTION} is set")
    nodes = _parse_nodes(raw["nodes"])
    if node not in nodes:
        listed = ", ".join(nodes)
        raise ConfigError("node", f"this node {node!r} is not in {SECTION}.nodes ({listed})")
    buddies = _parse_buddies(raw.get("buddies"), nodes)
    listen = raw.get("listen")
    timeout = parse_duration(raw.get("timeout", DEFAULT_TIMEOUT), f"{SECTION}.timeout")
    heartbeat = parse_duration(raw.get("heartbeat", DEFAULT_HEARTBEAT), f"{SECTION}.heartbeat")
    if heartbeat >= timeout:
        # With fewer than one heartbeat per timeout, a healthy peer flaps dead.
        raise ConfigError(
            f"{SECTION}.heartbeat", f"must be shorter than {SECTION}.timeout ({timeout:g}s)"
        )
    secret_file, secret = read_secret(raw.get("secret_file"))
    return PeersConfig(
        node=node,
        listen=(
            _default_listen(nodes[node])
            if listen is None
            else parse_address(listen, f"{SECTION}.listen")
        ),
        nodes=MappingProxyType(nodes),
        buddies=MappingProxyType(buddies),
        secret_file=secret_file,
        secret=secret,
        timeout=timeout,
        heartbeat=heartbeat,
        cluster_hash=cluster_hash(nodes, buddies),
        tls=_parse_tls(raw.get("tls")),
    )


def ssl_contexts(config: PeersConfig) -> tuple[ssl.SSLContext, ssl.SSLContext] | None:
    """(server, client) TLS contexts for transport.serve / PeerClient, or None.

    Both load this node's cert and key. With a ``ca``, the client checks
    servers against it and the server requires client certificates from it
    (mutual TLS); without one, the client uses the system's trust store. The
    client checks the server's certificate against the host in ``nodes``, so
    certificates must name that host (or IP address).
    """
    tls = config.tls
    if tls is None:
        return None
    cafile = None if tls.ca is None else str(tls.ca)
    try:
        server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=cafile)
        client = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=cafile)
    except (ssl.SSLError, OSError) as exc:
        raise ConfigError(f"{SECTION}.tls.ca", f"cannot load {tls.ca}: {_one_line(exc)}") from None
    if tls.ca is not None:
        server.verify_mode = ssl.CERT_REQUIRED
    for context in (server, client):
        try:
            context.load_cert_chain(tls.cert, tls.key)
        except (ssl.SSLError, OSError) as exc:
            problem = f"cannot load {tls.cert} with key {tls.key}: {_one_line(exc)}"
            raise ConfigError(f"{SECTION}.tls.cert", problem) from None
    return server, client


def _one_line(exc: Exception) -> str:
    """An ssl error's text for a one-line ConfigError."""
    return " ".join(str(exc).split())[:300]
