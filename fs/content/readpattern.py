"""Where a file's readers are in it: its recent read streams, kept on the
file (CachedFile.read_pattern), so that read-ahead (fs/read/readahead.py)
sees a reader moving through it in order."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

MIB = 1 << 20
MAX_STREAMS = 16  # per file: 8 ranks reading one file, and some room
NEAR = 4 * MIB  # a read this close to where a stream left off continues it
_ticks = itertools.count()


@dataclass
class Stream:
    next_off: int  # where this stream's next read is expected
    run: int = 0  # bytes read in order so far
    reads: int = 1
    frontier: int = 0  # read-ahead has been started up to here
    tick: int = 0  # last use, for replacing the stalest stream


@dataclass
class ReadPattern:
    """A file's recent read streams (kept on its CachedFile)."""

    streams: list[Stream] = field(default_factory=list)

    def observe(self, off: int, end: int) -> Stream | None:
        """Record a read of [off, end); the stream it continues, if it is sequential."""
        for s in self.streams:
            if s.next_off - NEAR <= off <= s.next_off + NEAR:
                s.run += end - off
                s.reads += 1
                s.next_off = max(s.next_off, end)
                s.tick = next(_ticks)
                return s
        stream = Stream(next_off=end, run=end - off, frontier=end, tick=next(_ticks))
        if len(self.streams) >= MAX_STREAMS:
            self.streams.remove(min(self.streams, key=lambda s: s.tick))
        self.streams.append(stream)
        return None
