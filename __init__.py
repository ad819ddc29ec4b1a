"""ckptfs: a POSIX FUSE filesystem for checkpoints of large-model training.

The repository root is this package: ``ckptfs.fs`` (filesystem, cache, store,
flusher), ``ckptfs.peer`` (multi-node features) and ``ckptfs.tools`` (CLI).
"""

__version__ = "0.1.0"
