"""Who may speak as which node: the claimed name checked against the config.

The handshake (auth.py) proves that a peer holds the cluster secret, which
every node holds: it proves membership of the cluster, not which node the
peer is. A server therefore admits a connection as node N only if

* N is one of ``peers.nodes``, and not the server itself, and
* the connection comes from an IP address configured for N: the host of N's
  entry in ``peers.nodes``, or every address that host name resolves to.

Nodes dial from their configured address (PeerClient's ``local_address``,
set from this node's entry when it is an IP address), so a cluster whose
nodes are on separate hosts, or on separate loopback addresses of one host
(127.0.0.1, 127.0.0.2, ...), tells every node apart. Nodes that share an
address (several daemons on 127.0.0.1 with different ports) are not told
apart from each other by it: each of them can speak as any of the others.

So a holder of the secret can speak as node N only from N's address: as root
on N's host, or as something that can send from N's address (a user of N's
host, or of a shared address, who read the secret; an attacker who can
forge source addresses on the network and complete a TCP handshake). The
secret must be guarded as that host's root account is (docs/SECURITY.md).

The check runs once the client's HELLO names its node, before any proof is
made or checked: a connection from the wrong address costs no HMAC and
takes none of that node's handshake slots (admission.py).
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Mapping
from dataclasses import dataclass

import trio
from ckptfs.peer.config import Address, PeersConfig
from ckptfs.peer.transport.auth import AuthError, one_line

RESOLVE_TTL = 60.0  # seconds a host name's addresses are used before they are looked up again
RESOLVE_TIMEOUT = 5.0

IP = ipaddress.IPv4Address | ipaddress.IPv6Address


class IdentityError(AuthError):
    """A connection claims a node it may not speak as (one line)."""


def normalize_ip(text: str) -> IP | None:
    """The IP address in ``text`` (an IPv4-mapped IPv6 address as IPv4), or None."""
    try:
        ip = ipaddress.ip_address(text.split("%", 1)[0])  # drop an IPv6 zone
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


@dataclass
class _Resolved:
    ips: frozenset[IP]
    until: float


class NodeIdentities:
    """The identity check of a server that is node ``own`` among ``nodes``."""

    def __init__(self, own: str, nodes: Mapping[str, Address]) -> None:
        self.own = own
        self.nodes = dict(nodes)
        self._resolved: dict[str, _Resolved] = {}

    @classmethod
    def of(cls, config: PeersConfig) -> NodeIdentities:
        return cls(config.node, config.nodes)

    async def check(self, name: str, source: str) -> None:
        """Raise IdentityError unless a connection from IP ``source`` may be node ``name``."""
        if name == self.own:
            raise IdentityError(f"a peer claims to be this node ({name!r})")
        address = self.nodes.get(name)
        if address is None:
            raise IdentityError(f"{name!r} is not a node of this cluster (peers.nodes)")
        ip = normalize_ip(source)
        allowed = await self.addresses_of(name)
        if ip is None or ip not in allowed:
            shown = ", ".join(sorted(str(a) for a in allowed)) or "none resolved"
            raise IdentityError(
                f"node {name!r} is not accepted from {one_line(source, 64)}: "
                f"its configured address is {address.host} ({shown})"
            )

    async def addresses_of(self, name: str) -> frozenset[IP]:
        """The IP addresses node ``name`` may connect from."""
        host = self.nodes[name].host
        literal = normalize_ip(host)
        if literal is not None:
            return frozenset({literal})
        cached = self._resolved.get(host)
        now = trio.current_time()
        if cached is not None and now < cached.until:
            return cached.ips
        try:
            ips = await _resolve(host)
        except OSError:
            # A failed look-up keeps the last good answer for one more period.
            if cached is None:
                return frozenset()
            ips = cached.ips
        self._resolved[host] = _Resolved(ips, now + RESOLVE_TTL)
        return ips


async def _resolve(host: str) -> frozenset[IP]:
    with trio.move_on_after(RESOLVE_TIMEOUT):
        infos = await trio.socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
        return frozenset(ip for *_, sockaddr in infos if (ip := normalize_ip(sockaddr[0])))
    raise OSError(f"looking up {host} took over {RESOLVE_TIMEOUT:g}s")


def source_address(config: PeersConfig) -> str | None:
    """The address this node dials from: its own entry's host when that is an
    IP address (a host name: the system chooses, by its routes)."""
    host = config.nodes[config.node].host
    ip = normalize_ip(host)
    if ip is None or ip.is_unspecified:
        return None
    return str(ip)
