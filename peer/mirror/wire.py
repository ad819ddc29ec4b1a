"""What a writer and its buddy say to each other in mirroring.

The request types (:data:`ROUTES`), the buddy's refusal while it does not
hold the writer alive, the most pages one request may carry, the digest each
page is checked against at the buddy (:func:`page_digest`) and the check of
a mirrored file's path (:func:`checked_path`).
"""

from __future__ import annotations

import xxhash
from ckptfs.peer.transport.auth import one_line

PAGE = "mirror.page"
COMMIT = "mirror.commit"
RENAME = "mirror.rename"
DROP = "mirror.drop"
ROUTES = (PAGE, COMMIT, RENAME, DROP)
# The buddy's refusal while its membership does not hold the writer alive
# (yet: it is told of a restart one heartbeat later than the writer is).
NOT_ALIVE = "is not alive to this node"
MAX_BATCH_PAGES = 64  # what a buddy accepts in one request


def checked_path(value: object) -> str:
    """A mirrored file's path: relative, inside the mount, no empty, ``.`` or
    ``..`` component (ValueError otherwise)."""
    if (
        not isinstance(value, str)
        or not value
        or value.startswith("/")
        or "\0" in value
        or any(part in ("", ".", "..") for part in value.split("/"))
    ):
        raise ValueError(f"bad path {one_line(repr(value), 100)}")
    return value


def page_digest(data: memoryview | bytes, page: int, gen: int) -> int:
    """What a mirrored page is checked against at the buddy: xxh3-64 of its
    bytes, seeded with its page number and generation so that damaged
    metadata does not pass either."""
    return xxhash.xxh3_64_intdigest(data, seed=((page << 32) ^ gen) & 0xFFFF_FFFF_FFFF_FFFF)
