"""The errors a request or a connect raises, besides wire.py's PeerError and
ProtocolError (their base and the protocol's) and auth.py's AuthError."""

from __future__ import annotations

from ckptfs.peer.transport.wire import PeerError


class PeerTimeout(PeerError):
    """A request (or a connect) got no answer in time."""


class ConnectionClosed(PeerError):
    """The connection is closed or was lost; the message says why."""


class PeerUnreachable(PeerError):
    """No TCP connection could be made to the peer."""


class RemoteError(PeerError):
    """Raised by Response.check() for an error response."""
