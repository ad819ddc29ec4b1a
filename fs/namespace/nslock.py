"""The namespace lock: orders backing-store updates that depend on a path.

A rename or unlink changes what a path means, so it runs alone (exclusive).
Writing a manifest at a path (a create, a publish) only needs that path to
keep its meaning and no other writer at the same path, so such writes take
the lock shared plus a per-path lock. Without this, every create and every
close on a mount waited for each other's backing-store round trip, and a
directory of small files was written one manifest at a time.

A lookup reads a name and binds it to an inode; a rename must not fall
between the two. Lookups do not take the lock (they would wait behind every
publish a queued rename waits for): they read ``generation`` before their
read and bind only if it is unchanged after it (``stable_since``), else read
again; after a few tries they take it shared (``reading``).

A rename onto a name is in flight from the moment its request arrives
(``replacing``), before it may take the lock: a read-only open of the file
at that name then waits for it (FileSystem.open), so that a process loading
a checkpoint while it is replaced does not read the old file through its
first open and the new one through its second (torch.load(mmap=True)).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager

import trio


class NamespaceLock:
    def __init__(self) -> None:
        self._writer = trio.Lock()  # FIFO among exclusive holders
        self._closed = False  # an exclusive holder is waiting or running
        self._reopened = trio.Event()
        self._sharers = 0
        self._idle = trio.Event()
        self._paths: dict[str, tuple[trio.Lock, int]] = {}
        # Odd while an exclusive holder changes the namespace; bumped as it
        # starts and as it ends.
        self.generation = 0
        # Paths renames in flight are moving a file onto: how many, and the
        # event set when the last of them ends.
        self._replacing: dict[str, tuple[int, trio.Event]] = {}

    @contextmanager
    def replacing(self, path: str) -> Iterator[None]:
        """A rename onto ``path`` is in flight for the body, whatever its outcome."""
        renames, ended = self._replacing.get(path, (0, trio.Event()))
        self._replacing[path] = (renames + 1, ended)
        try:
            yield
        finally:
            renames, ended = self._replacing[path]
            if renames == 1:
                del self._replacing[path]
                ended.set()
            else:
                self._replacing[path] = (renames - 1, ended)

    def any_replacing(self) -> bool:
        return bool(self._replacing)

    def replacement_of(self, path: str) -> trio.Event | None:
        """Set once no rename onto ``path`` is in flight; None if none is now."""
        got = self._replacing.get(path)
        return None if got is None else got[1]

    @asynccontextmanager
    async def exclusive(self) -> AsyncIterator[None]:
        async with self._writer:
            # New sharers wait from now on, so a stream of publishes cannot
            # starve a rename.
            self._closed = True
            try:
                while self._sharers:
                    await self._idle.wait()
                self.generation += 1
                try:
                    yield
                finally:
                    self.generation += 1
            finally:
                self._closed = False
                self._reopened.set()
                self._reopened = trio.Event()

    def stable_since(self, generation: int) -> bool:
        """Whether no exclusive holder ran at any time since ``generation`` was read."""
        return generation % 2 == 0 and self.generation == generation

    @asynccontextmanager
    async def reading(self) -> AsyncIterator[None]:
        """No rename or unlink runs until this ends. Must not wait inside for
        a publish (it may be queued behind the rename that waits for this)."""
        while self._closed:
            await self._reopened.wait()
        self._sharers += 1
        try:
            yield
        finally:
            self._sharers -= 1
            if not self._sharers:
                self._idle.set()
                self._idle = trio.Event()

    @asynccontextmanager
    async def shared(self, path_of: Callable[[], str]) -> AsyncIterator[str]:
        """Yields the path, read once no rename can run any more."""
        async with self.reading():
            path = path_of()
            lock, users = self._paths.get(path, (None, 0))
            if lock is None:
                lock = trio.Lock()
            self._paths[path] = (lock, users + 1)
            try:
                async with lock:
                    yield path
            finally:
                lock, users = self._paths[path]
                if users == 1:
                    del self._paths[path]
                else:
                    self._paths[path] = (lock, users - 1)
