"""What the cache raises to its callers."""

from __future__ import annotations

import errno


class FileLost(OSError):
    """The bytes of a file are gone: its holders and the backing store lack them."""

    def __init__(self, message: str) -> None:
        super().__init__(errno.EIO, message)


class HoldersFailed(OSError):
    """No holder served bytes of a file pending on other nodes. Either it is
    lost, or its writer moved on (published it as durable, or rewrote,
    replaced or removed it): only its manifest tells, which the caller reads
    (Filesystem.read), then :meth:`Cache.declare_lost` if it is lost."""

    def __init__(self, path: str, version: str, reason: str, *, moved_on: bool = False) -> None:
        super().__init__(errno.EIO, f"{path}: {reason}")
        self.version = version
        self.reason = reason
        # A holder said its writer is changing the file (WriterMovedOn).
        self.moved_on = moved_on
