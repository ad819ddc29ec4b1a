"""Buddy mirroring: a closed file is in two nodes' RAM before close() returns.

The writer's side is :mod:`.client` (MirrorClient), the buddy's side, which
holds the mirrors and takes them over when their writer dies, is
:mod:`.server` (MirrorServer); what they say to each other is :mod:`.wire`.
"""
