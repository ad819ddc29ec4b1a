"""Requests and responses: what a caller sends and gets back, what a
server's handler is given and returns (Request, Response, Placement, Handler,
Placer), and their envelopes in the meta of REQUEST and RESPONSE frames."""

from __future__ import annotations

import os
import stat
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ckptfs.peer.transport.auth import one_line
from ckptfs.peer.transport.errors import RemoteError
from ckptfs.peer.transport.limits import PeerBudget
from ckptfs.peer.transport.wire import Buffer, ProtocolError

MAX_REQUEST_TYPE = 128
EMPTY = memoryview(b"")

PayloadFile = tuple[int, int, int]  # (fd, offset, length)
# One range of a file, or several sent one after another as one payload.
FileRanges = PayloadFile | Sequence[PayloadFile]


@dataclass(slots=True)
class Placement:
    """Where a request's payload is received instead of a pooled buffer (a
    server's ``placer`` decides, from the request's type and meta, before the
    payload is read): ``views`` are filled in order, and their lengths add up
    to the payload's. The handler finds it as ``Request.placement`` and may
    take what was received; ``release`` is called once the request is done
    (or its payload never arrived) and frees whatever was not taken.
    ``owner`` is the placer's own record of it, for the handler."""

    views: list[memoryview]
    release: Callable[[], object]
    owner: object = None


@dataclass(slots=True)
class Request:
    type: str
    meta: dict[str, Any]
    payload: memoryview
    id: int = 0
    placement: Placement | None = None  # then the payload is in its views, not `payload`
    # The peer's buffer budget: a handler that buffers a reply takes its bytes
    # from it and gives them back once the reply is sent (None: unbounded).
    budget: PeerBudget | None = None


@dataclass(slots=True)
class Response:
    """A handler's answer; on the client, what came back.

    ``payload_file`` sends (fd, offset, length) of a regular file instead of
    ``payload`` (or several such ranges, one after another); ``release``
    (server side) is called once the response has been sent or abandoned,
    e.g. to close that fd or unpin cache pages. Received payloads are always
    memoryviews.
    """

    meta: dict[str, Any] = field(default_factory=dict)
    payload: Buffer = b""
    error: str | None = None
    payload_file: FileRanges | None = None
    release: Callable[[], object] | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @classmethod
    def fail(cls, error: str, meta: dict[str, Any] | None = None) -> Response:
        return cls(meta=meta or {}, error=one_line(error) or "error")

    def check(self) -> Response:
        """Self, or RemoteError if this is an error response."""
        if self.error is not None:
            raise RemoteError(self.error)
        return self


Handler = Callable[[str, Request], Awaitable[Response]]
# (peer node, request type, request meta, payload size) -> where to receive it, or None.
Placer = Callable[[str, str, dict[str, Any], int], Placement | None]


# ---------------------------------------------------------------- envelopes


def request_envelope(rtype: str, meta: dict[str, Any] | None) -> dict[str, Any]:
    if not isinstance(rtype, str) or not 0 < len(rtype) <= MAX_REQUEST_TYPE:
        raise ValueError(f"request type must be a string of 1..{MAX_REQUEST_TYPE} characters")
    return {"type": rtype, "meta": {} if meta is None else meta}


def parse_request(meta: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    rtype, inner = meta.get("type"), meta.get("meta", {})
    if not isinstance(rtype, str) or not 0 < len(rtype) <= MAX_REQUEST_TYPE:
        raise ProtocolError("REQUEST without a valid type")
    if not isinstance(inner, dict):
        raise ProtocolError("REQUEST meta is not an object")
    return rtype, inner


def response_envelope(response: Response) -> dict[str, Any]:
    envelope: dict[str, Any] = {"meta": response.meta}
    if response.error is not None:
        envelope["error"] = one_line(response.error) or "error"
    return envelope


def parse_response(meta: dict[str, Any]) -> tuple[dict[str, Any], str | None]:
    inner, error = meta.get("meta", {}), meta.get("error")
    if not isinstance(inner, dict):
        raise ProtocolError("RESPONSE meta is not an object")
    if error is not None and not isinstance(error, str):
        raise ProtocolError("RESPONSE error is not a string")
    return inner, None if error is None else one_line(error) or "error"


def outgoing(
    payload: Buffer, payload_file: FileRanges | None
) -> tuple[memoryview, int, list[PayloadFile]]:
    """The payload as bytes to send, the frame's payload length, and the file
    ranges to send instead of bytes."""
    view = memoryview(payload).cast("B")
    if payload_file is None:
        return view, len(view), []
    if len(view):
        raise ValueError("give payload or payload_file, not both")
    ranges = [payload_file] if isinstance(payload_file[0], int) else list(payload_file)
    total = 0
    for fd, offset, length in ranges:  # type: ignore[misc]
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError("payload_file must be a regular file")
        if offset < 0 or length < 0 or offset + length > st.st_size:
            raise ValueError(f"payload_file range {offset}+{length} is outside the file")
        total += length
    return view, total, ranges  # type: ignore[return-value]
