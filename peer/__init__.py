"""Multi-node features (membership, buddy mirroring, peer reads, takeover).

Built so far: the authenticated peer transport that these features will use:
``wire`` (the frame format), ``auth`` (the handshake between two nodes) and
``transport`` (servers, clients, concurrent requests over one connection).
The single-node filesystem in ``ckptfs.fs`` records holders in every manifest
and keeps per-file state so that the features above can attach.
"""

from ckptfs.peer.transport.auth import AuthError
from ckptfs.peer.transport.client import PeerConnection, connect
from ckptfs.peer.transport.errors import (
    ConnectionClosed,
    PeerTimeout,
    PeerUnreachable,
    RemoteError,
)
from ckptfs.peer.transport.limits import Limits
from ckptfs.peer.transport.transport import PeerClient, Request, Response, serve
from ckptfs.peer.transport.wire import PeerError, ProtocolError

__all__ = [
    "AuthError",
    "ConnectionClosed",
    "Limits",
    "PeerClient",
    "PeerConnection",
    "PeerError",
    "PeerTimeout",
    "PeerUnreachable",
    "ProtocolError",
    "RemoteError",
    "Request",
    "Response",
    "connect",
    "serve",
]
