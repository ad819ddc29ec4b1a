"""Bytes made up for the tests, the same for the same seed."""

from __future__ import annotations

import json
import random
import struct


def rand(size: int, seed: int) -> bytes:
    """``size`` random bytes, the same for the same ``seed``."""
    return random.Random(seed).randbytes(size)


def safetensors_bytes(tensors: dict[str, bytes], metadata: dict[str, str] | None = None) -> bytes:
    """A safetensors file written by hand (the package is not a dependency)."""
    header: dict[str, object] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name, blob in tensors.items():
        header[name] = {
            "dtype": "U8",
            "shape": [len(blob)],
            "data_offsets": [offset, offset + len(blob)],
        }
        offset += len(blob)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)  # the format pads the header to 8 bytes
    return struct.pack("<Q", len(raw)) + raw + b"".join(tensors.values())
