"""Multi-node features: membership (heartbeats, who is alive), buddy
mirroring and takeover (mirror), reads from peers (reads), and the
authenticated transport they share (transport).

Empty on purpose: ``ckptfs.peer.config`` is imported by every CLI command
(through the config), which must not pay for trio and the transport.
"""
