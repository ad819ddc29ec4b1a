"""The RAM budget: one tmpfs file cut into fixed-size slots.

Why one pre-faulted file rather than a tmpfs file per cached file: on this
kind of VM, memory touched for the first time is written at 150-600 MB/s while
overwriting pages that already exist runs at ~5 GB/s. Slots are reused (LIFO,
so the warmest first) and never given back to the kernel, and a background
pass writes zeros into slots that were never touched, so a checkpoint does not
pay the first-touch cost. Because the file lives in tmpfs it also survives a
daemon restart, which is how dirty data outlives a daemon crash.
"""

from __future__ import annotations

import os
from collections import deque
from pathlib import Path

SLOT_SIZE = 1 << 20  # one FUSE request; see docs/DESIGN-NOTES.md
_ZEROS = bytes(SLOT_SIZE)


class Arena:
    def __init__(self, path: Path, capacity: int, slot_size: int = SLOT_SIZE) -> None:
        self.path = path
        self.slot_size = slot_size
        self.nslots = max(1, capacity // slot_size)
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        # Keep a larger existing arena: its slots may hold dirty data of a
        # previous daemon that is about to be adopted.
        current = os.fstat(self.fd).st_size
        self.nslots = max(self.nslots, current // slot_size)
        os.ftruncate(self.fd, self.nslots * slot_size)
        # Free list: appendright on release, pop from the right on allocation
        # (warm slots first); the never-touched end on the left is what the
        # pre-fault pass takes, and it hands them back on the right.
        self._free: deque[int] = deque(range(self.nslots - 1, -1, -1))
        self._prefaulting = 0

    @property
    def capacity(self) -> int:
        return self.nslots * self.slot_size

    @property
    def used_slots(self) -> int:
        return self.nslots - len(self._free) - self._prefaulting

    def claim(self, slots: set[int]) -> None:
        """Mark slots adopted from a previous daemon as in use."""
        self._free = deque(s for s in self._free if s not in slots)

    def alloc(self) -> int | None:
        return self._free.pop() if self._free else None

    def release(self, slot: int) -> None:
        self._free.append(slot)

    def write(self, slot: int, offset: int, data: bytes | memoryview) -> None:
        os.pwrite(self.fd, data, slot * self.slot_size + offset)

    def zero(self, slot: int, start: int, end: int) -> None:
        if end > start:
            os.pwrite(self.fd, memoryview(_ZEROS)[: end - start], slot * self.slot_size + start)

    def read(self, slot: int, offset: int, length: int) -> bytes:
        return os.pread(self.fd, length, slot * self.slot_size + offset)

    # Pre-faulting: the event loop takes a batch of untouched slots out of the
    # free list (so no writer can get them meanwhile), a thread zero-fills the
    # ones that are holes, and the loop hands them back.
    def take_prefault_batch(self, count: int) -> list[int]:
        batch: list[int] = []
        while self._free and len(batch) < count:
            batch.append(self._free.popleft())
        self._prefaulting += len(batch)
        return batch

    def prefault(self, batch: list[int]) -> int:
        """Zero-fill the slots of ``batch`` that are holes (blocking); return bytes touched."""
        touched = 0
        for slot in batch:
            start = slot * self.slot_size
            if self._is_backed(start):
                continue
            os.pwrite(self.fd, _ZEROS[: self.slot_size], start)
            touched += self.slot_size
        return touched

    def return_prefault_batch(self, batch: list[int]) -> None:
        self._prefaulting -= len(batch)
        self._free.extend(batch)

    def _is_backed(self, start: int) -> bool:
        try:
            data = os.lseek(self.fd, start, os.SEEK_DATA)
        except OSError:  # ENXIO: only holes from here on
            return False
        if data != start:
            return False
        return os.lseek(self.fd, start, os.SEEK_HOLE) >= start + self.slot_size

    def close(self) -> None:
        os.close(self.fd)
