"""The fetcher's verdict over several holders (peer/reads/reads.py), without sockets:
the connections are stand-ins that answer as a holder's ReadServer would."""

from __future__ import annotations

from typing import Any

import pytest
import trio
from ckptfs.fs.read.remoteread import WriterMovedOn
from ckptfs.peer.reads.reads import MOVED_ON, HolderMovedOn, PeerFetcher, PeerReadError
from ckptfs.peer.transport.transport import Response


class Conn:
    def __init__(self, answer: Response | Exception) -> None:
        self.answer = answer
        self.closed = False

    async def request(self, kind: str, meta: dict[str, Any], **kw: Any) -> Response:
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer


def fetcher(answers: dict[str, Response | Exception]) -> tuple[PeerFetcher, list[str]]:
    addresses = {name: ("127.0.0.1", 1) for name in answers}
    f = PeerFetcher(None, addresses, timeout=1, is_alive=lambda _name: True)  # type: ignore[arg-type]
    forgotten: list[str] = []

    async def connection(client: Any, name: str, **kw: Any) -> Conn:
        return Conn(answers[name])

    async def forget(name: str) -> None:
        forgotten.append(name)

    f.dialer.connection = connection  # type: ignore[method-assign]
    f.dialer.forget = forget  # type: ignore[method-assign]
    return f, forgotten


def fetch(f: PeerFetcher, holders: list[str]) -> bytes | memoryview:
    return trio.run(f.fetch, holders, "f1", "v1", 0, 10)


def test_a_holder_changing_the_file_makes_the_failure_moved_on_whatever_the_others_say():
    refused = Response.fail("f1@v1 is not held here: its writer here is changing it",
                            meta={MOVED_ON: True})  # fmt: skip
    f, forgotten = fetcher({"n1": OSError(111, "connection refused"), "n2": refused})
    with pytest.raises(HolderMovedOn) as err:
        fetch(f, ["n1", "n2"])
    assert isinstance(err.value, WriterMovedOn) and isinstance(err.value, PeerReadError)
    assert "n1: " in str(err.value) and "n2: " in str(err.value)
    # An answer is not a broken connection: only n1's is dropped.
    assert forgotten == ["n1"]


def test_holders_that_only_do_not_hold_it_fail_plainly():
    f, forgotten = fetcher({"n1": Response.fail("f1@v1 is not held here")})
    with pytest.raises(PeerReadError) as err:
        fetch(f, ["n1"])
    assert not isinstance(err.value, WriterMovedOn)
    assert forgotten == []
