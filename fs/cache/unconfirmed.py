"""Journal records of a crashed daemon that recovery could not check.

Recovery (recovery.py) keeps a record here, with its arena slots claimed,
when the store did not answer for its manifest. It leaves in one of two
ways: adopted (``Cache.confirm``: its manifest names it pending) or found
stale (``Cache.discard_unconfirmed``). ``confirm_later`` asks the store
again on a growing pause, or at once when a ``flush --wait`` or ``umount``
wants the files under a path durable (``ask_now``).

Two kept records may list the same slot: a record may be dropped lazily
once its version is durable or replaced (docs/STATES.md), and its slots
reused by a newer one. At most one of them is the slot's owner; so a slot
goes back to the arena only when no kept record lists it, and adopting one
record lets go of every other that shares a slot with it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import trio
from ckptfs.fs.cache.journal import Key


def slots_of(record: dict[str, Any]) -> set[int]:
    return {int(entry[0]) for entry in record["dirty"].values()}


class Unconfirmed:
    def __init__(self) -> None:
        self._records: dict[Key, dict[str, Any]] = {}
        # Records let go because one sharing a slot was adopted: their journal
        # records go first, then the slots only they listed (confirm_later).
        self.letting_go: list[tuple[Key, dict[str, Any], set[int]]] = []
        self._ask = trio.Event()
        self._changed = trio.Event()

    def __len__(self) -> int:
        return len(self._records)

    def __contains__(self, key: object) -> bool:
        return key in self._records

    def get(self, key: Key) -> dict[str, Any] | None:
        return self._records.get(key)

    def items(self) -> list[tuple[Key, dict[str, Any]]]:
        return list(self._records.items())

    def paths(self) -> Iterator[tuple[str, int]]:
        """(path, owner uid) of each record."""
        for r in self._records.values():
            yield str(r.get("path", "?")), int(r.get("uid", 0))

    def add(self, key: Key, record: dict[str, Any]) -> None:
        """Keep ``record`` (or replace the one kept for ``key``)."""
        self._records[key] = record

    def pop(self, key: Key) -> tuple[dict[str, Any], set[int]]:
        """Let go of ``key``: its record, and the slots of it that no other
        kept record lists (those may go back to the arena)."""
        record = self._records.pop(key)
        others = set().union(*(slots_of(r) for r in self._records.values()))
        self._changed.set()
        self._changed = trio.Event()
        return record, slots_of(record) - others

    def let_go_sharing(self, adopted: dict[str, Any]) -> list[dict[str, Any]]:
        """Let go of the kept records that list a slot the just adopted
        record lists (that slot is its version's); returns them."""
        mine = slots_of(adopted)
        gone = []
        for key in [k for k, r in self._records.items() if slots_of(r) & mine]:
            record, free = self.pop(key)
            self.letting_go.append((key, record, free - mine))
            gone.append(record)
        if gone:
            self.ask_now()
        return gone

    def busy(self) -> bool:
        """Records kept, or let go and not yet dropped."""
        return bool(self._records or self.letting_go)

    def ask_now(self) -> None:
        self._ask.set()

    async def pause(self, seconds: float) -> None:
        """Until ``seconds`` pass or someone asks for a look now."""
        with trio.move_on_after(seconds):
            await self._ask.wait()
        self._ask = trio.Event()

    async def settled(self, wanted: Callable[[str], bool]) -> bool:
        """Until no record's path is ``wanted``; asks for a look at once.
        Whether there was one to wait for."""
        waited = False
        while any(wanted(path) for path, _ in self.paths()):
            waited = True
            changed = self._changed
            self.ask_now()
            await changed.wait()
        return waited
