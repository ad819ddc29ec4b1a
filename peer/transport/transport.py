"""Authenticated request/response connections between ckptfs nodes.

A node runs one server (``serve``) and dials its peers (``PeerClient`` or
``connect``). A connection starts with optional TLS (``trio.SSLStream``, when
an ``ssl.SSLContext`` is given), then the handshake of auth.py, then carries
frames (wire.py) until either side closes it:

* The client sends REQUEST frames with ids 1, 2, 3, ... (never reused on a
  connection). Meta ``{"type": str, "meta": object}``, payload = the
  request's payload.
* The server answers every REQUEST with exactly one RESPONSE of the same id,
  in any order: ``{"meta": object}`` on success, ``{"meta": object, "error":
  one line}`` on failure (the handler said so, raised, or was cancelled).
* A client that stops waiting for a request (timeout or cancellation) sends
  CANCEL with its id; the server cancels the handler and still answers, with
  an error. The client reads and drops that late response.
* Either side may send ERROR (id 0) with a reason just before it closes the
  connection because of a protocol error.

Concurrency: one connection carries many requests at once. The client keeps
at most ``max_concurrent_requests`` requests unanswered (a request given up
on still counts until its late response arrives), and the server runs at
most that many handlers per connection, each in its own task; a server
reading one more request waits for a handler to finish before it reads the
request's payload (TCP backpressure). Frames are sent whole, one at a time
per connection, in the order their senders took the connection's send lock.

Deadlines: waiting for the next frame is unbounded (idle connections are
fine; heartbeats are requests), but once a frame's first byte has arrived its
header and meta must follow within ``frame_timeout``, and its payload within
``frame_timeout + length / min_rate`` from when its reading starts. Sends of
a frame have the same bound. A frame, once its first byte is sent, is sent
whole even if the request that sent it times out: cutting it short would put
the stream out of step. Requests time out after ``request_timeout`` unless
the caller says otherwise, raising PeerTimeout without harming the other
requests on the connection. A peer that breaks a deadline or the protocol
loses the connection; every request still pending on it fails with
ConnectionClosed, which names the reason.

Where each part lives (this module names those that most callers use):

* wire.py: the frame format; auth.py: the handshake; identity.py: which
  address may claim which node;
* messages.py: Request, Response, Placement and their envelopes;
* channel.py: frames over one stream, their deadlines, and how payloads
  are copied;
* client.py: PeerClient, PeerConnection and ``connect``: dialing, and many
  requests over one connection;
* server.py: ``serve``, and the bounds on each authenticated peer node;
* admission.py: the bounds on connections before they are authenticated;
* serverconn.py: one authenticated peer's requests, each in its own task;
* limits.py: Limits and PeerBudget; errors.py: what a request or connect raises;
* dialer.py: connections of one's own to each peer, dialed on demand.
"""

from ckptfs.peer.transport.client import PeerClient
from ckptfs.peer.transport.messages import Request, Response
from ckptfs.peer.transport.server import serve

__all__ = ["PeerClient", "Request", "Response", "serve"]
