"""Peer frames: the byte layout nodes exchange, and its limits. Pure: no I/O.

Every message between two nodes is one frame. A frame is a fixed 28-byte
header, then a UTF-8 JSON object (the "meta"), then an optional binary payload.
All integers are unsigned and big-endian (``struct`` format ``!4sBBHQIQ``):

    offset  size  field
         0     4  magic, the bytes ``CKPF``
         4     1  protocol version, 1
         5     1  frame type (``FrameType``)
         6     2  flags, must be 0 in version 1
         8     8  request id; 0 for connection-level frames (handshake, ERROR)
        16     4  meta length M, 2 <= M <= 65536 (``MAX_META``)
        20     8  payload length P, P <= max_payload (default 64 MiB)
        28     M  meta: a JSON object, UTF-8, no NaN or Infinity
      28+M     P  payload: opaque bytes

The header alone says how long the frame is, so a receiver knows before
reading any more whether it will accept the frame, and where the next one
starts. A frame that breaks any rule above (bad magic or version, unknown
type, nonzero flags, lengths over the limits, meta that is not a JSON object,
a stream that ends inside a frame) raises ``ProtocolError``: the connection
it came from cannot be trusted to be in step any more and is dropped.

Frame types, and the meta each carries (unknown keys are ignored):

    1 HELLO     handshake: {"node", "nonce", "cluster"}          (see auth.py)
    2 PROOF     handshake: {"proof"}
    3 READY     handshake: {}
    4 ERROR     {"error": one line}; the sender closes the connection after it
    5 REQUEST   {"type": str, "meta": object}; payload = request payload
    6 RESPONSE  {"meta": object} or {"meta": object, "error": one line}
    7 CANCEL    {}, no payload; the client gave up on the request with this id

Handshake frames and ERROR use request id 0 and carry no payload. Every
REQUEST (id >= 1, unique among the requests in flight on its connection) gets
exactly one RESPONSE with the same id, also when it was cancelled.
"""

from __future__ import annotations

import enum
import json
import struct
from dataclasses import dataclass
from typing import Any

MAGIC = b"CKPF"
VERSION = 1
HEADER = struct.Struct("!4sBBHQIQ")
HEADER_SIZE = HEADER.size  # 28
MAX_META = 64 * 1024
MIN_META = 2  # "{}"
DEFAULT_MAX_PAYLOAD = 64 * 1024 * 1024
MAX_REQUEST_ID = (1 << 64) - 1

Buffer = bytes | bytearray | memoryview


class PeerError(Exception):
    """Base of every error the peer transport raises."""


class ProtocolError(PeerError):
    """A frame broke the wire format; its connection is no longer usable."""


class FrameType(enum.IntEnum):
    HELLO = 1
    PROOF = 2
    READY = 3
    ERROR = 4
    REQUEST = 5
    RESPONSE = 6
    CANCEL = 7


@dataclass(frozen=True, slots=True)
class Header:
    type: FrameType
    request_id: int
    meta_len: int
    payload_len: int

    @property
    def frame_len(self) -> int:
        return HEADER_SIZE + self.meta_len + self.payload_len


@dataclass(frozen=True, slots=True)
class Frame:
    header: Header
    meta: dict[str, Any]
    payload: memoryview


def encode_meta(meta: dict[str, Any]) -> bytes:
    """The JSON bytes of `meta`; ValueError if it cannot be a frame's meta."""
    if not isinstance(meta, dict):
        raise ValueError(f"frame meta must be a dict, not {type(meta).__name__}")
    try:
        text = json.dumps(meta, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
        data = text.encode("utf-8")
    except (TypeError, ValueError, RecursionError) as exc:
        raise ValueError(f"frame meta is not encodable as JSON: {exc}") from None
    if len(data) > MAX_META:
        raise ValueError(f"frame meta is {len(data)} bytes, over the limit of {MAX_META}")
    return data


def encode_head(
    ftype: FrameType,
    request_id: int,
    meta: dict[str, Any],
    payload_len: int,
    *,
    max_payload: int = DEFAULT_MAX_PAYLOAD,
) -> bytes:
    """Fixed header plus meta: everything of a frame but its payload.

    The payload is sent separately (scatter/gather or sendfile) so that large
    payloads are never copied into one buffer with their header.
    """
    if not 0 <= request_id <= MAX_REQUEST_ID:
        raise ValueError(f"request id {request_id} out of range")
    if not 0 <= payload_len <= max_payload:
        raise ValueError(f"payload of {payload_len} bytes is over the limit of {max_payload}")
    data = encode_meta(meta)
    return HEADER.pack(MAGIC, VERSION, ftype, 0, request_id, len(data), payload_len) + data


def encode_frame(
    ftype: FrameType,
    request_id: int,
    meta: dict[str, Any],
    payload: Buffer = b"",
    *,
    max_payload: int = DEFAULT_MAX_PAYLOAD,
) -> bytes:
    """A whole frame in one buffer. Copies the payload: for small frames only."""
    view = memoryview(payload).cast("B")
    head = encode_head(ftype, request_id, meta, len(view), max_payload=max_payload)
    return head + view.tobytes()


def decode_header(data: Buffer, *, max_payload: int = DEFAULT_MAX_PAYLOAD) -> Header:
    """Parse and check the fixed header at the start of `data`."""
    if len(data) < HEADER_SIZE:
        raise ProtocolError(f"truncated frame header: {len(data)} of {HEADER_SIZE} bytes")
    magic, version, ftype, flags, request_id, meta_len, payload_len = HEADER.unpack_from(data)
    if magic != MAGIC:
        raise ProtocolError(f"bad magic {bytes(magic)!r} (not a ckptfs peer)")
    if version != VERSION:
        raise ProtocolError(f"unsupported protocol version {version} (this node speaks {VERSION})")
    try:
        frame_type = FrameType(ftype)
    except ValueError:
        raise ProtocolError(f"unknown frame type {ftype}") from None
    if flags:
        raise ProtocolError(f"unknown flags {flags:#06x}")
    if not MIN_META <= meta_len <= MAX_META:
        raise ProtocolError(f"meta length {meta_len} outside {MIN_META}..{MAX_META}")
    if payload_len > max_payload:
        raise ProtocolError(f"payload length {payload_len} over the limit of {max_payload}")
    return Header(frame_type, request_id, meta_len, payload_len)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def decode_meta(data: Buffer) -> dict[str, Any]:
    """Parse a frame's meta: a UTF-8 JSON object."""
    try:
        text = str(data, "utf-8")
        # parse_constant: Python's json accepts NaN/Infinity, which no peer sends.
        meta = json.loads(text, parse_constant=_reject_constant)
    except UnicodeDecodeError:
        raise ProtocolError("frame meta is not valid UTF-8") from None
    except ValueError as exc:
        raise ProtocolError(f"frame meta is not valid JSON: {exc}") from None
    except RecursionError:
        # A 64 KiB meta of nested brackets exhausts the parser's recursion limit.
        raise ProtocolError("frame meta is nested too deeply") from None
    if not isinstance(meta, dict):
        raise ProtocolError(f"frame meta is a JSON {type(meta).__name__}, not an object")
    return meta


def decode_frame(data: Buffer, *, max_payload: int = DEFAULT_MAX_PAYLOAD) -> Frame:
    """Parse exactly one whole frame held in memory (the payload is not copied)."""
    view = memoryview(data).cast("B")
    header = decode_header(view, max_payload=max_payload)
    if len(view) < header.frame_len:
        raise ProtocolError(f"truncated frame: {len(view)} of {header.frame_len} bytes")
    if len(view) > header.frame_len:
        raise ProtocolError(f"{len(view) - header.frame_len} bytes after the end of the frame")
    meta_end = HEADER_SIZE + header.meta_len
    meta = decode_meta(view[HEADER_SIZE:meta_end])
    return Frame(header, meta, view[meta_end:])
