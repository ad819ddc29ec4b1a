"""Multi-node features (membership, buddy mirroring, peer reads, takeover).

Not built yet: the single-node filesystem in ``ckptfs.fs`` records holders in
every manifest and keeps per-file state so that these features can attach.
"""
