"""Progress of a wait for the store: ``ckptfs umount`` and ``flush --wait``.

The wait is one control request that returns when everything is durable (or
it gives up). While it runs in a thread, this polls the daemon's stat and
shows the bytes left to store:
- on a terminal, a tqdm bar (bytes stored of bytes to store, rate, ETA);
- otherwise (a Slurm epilog, a systemd stop, a log), a line every
  LOG_EVERY seconds, so that a long drain is visibly alive in the log;
- in both cases one summary line at the end.

tqdm rather than code of our own: it keeps the rate's smoothing, the units
and the terminal width right. ``bars`` renders per-file bars for
``stat --watch`` with the same library, without a live display.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TextIO

from ckptfs.tools.control import ControlError
from ckptfs.tools.statfmt import human, shown
from tqdm import tqdm

# Binary units, as the rest of the CLI's sizes (statfmt.human): tqdm writes
# its prefix before the unit, so the unit "iB" with 1024 makes "MiB".
UNIT = 1024
# tqdm's default, with the unit after the counts ("4.00/16.0MiB", not "16.0M").
BAR = (
    "{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt}{unit} "
    "[{elapsed}<{remaining}, {rate_fmt}]"
)
POLL = 0.5  # seconds between stat requests on a terminal
LOG_EVERY = 5.0  # seconds between lines off a terminal
NOT_DURABLE = ("dirty", "mirrored", "flushing")

Stat = Callable[[], dict[str, Any]]


def left_to_store(reply: dict[str, Any], whole_mount: bool) -> int:
    """Bytes not yet in the store: the whole mount's (``progress``, which
    counts every user's files), or those of the files the reply lists (the
    asker's own, under the path asked about)."""
    if whole_mount:
        return int(reply["progress"]["to_store"])
    return sum(
        max(0, f["size"] - (f["flushed_bytes"] if f["state"] == "flushing" else 0))
        for f in [*reply.get("files", []), *reply.get("taken_over", [])]
        if f["state"] in NOT_DURABLE
    )


class Progress:
    """Shows the bytes left while ``wait`` (the blocking request) runs."""

    def __init__(
        self, what: str, where: Path, stat: Stat, whole_mount: bool, out: TextIO | None = None
    ) -> None:
        self.what = f"{what} {where}"  # the lines' and the summary's
        self.short = what  # the bar's: a path would leave it no room
        self.stat = stat
        self.whole_mount = whole_mount
        self.out = out or sys.stderr
        self.terminal = self.out.isatty()

    def run(self, wait: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        done = threading.Event()
        result: dict[str, Any] = {}

        def waiter() -> None:
            try:
                result["reply"] = wait()
            except BaseException as exc:  # re-raised in the caller's thread
                result["error"] = exc
            finally:
                done.set()

        start = time.monotonic()
        # The wait first: a daemon slow to answer a stat must not delay it.
        threading.Thread(target=waiter, name="ckptfs-wait", daemon=True).start()
        first = self._left()
        if self.terminal:
            self._bar(first, done)
        else:
            self._lines(first, done, start)
        if "error" in result:
            raise result["error"]
        self._summary(first, time.monotonic() - start, result["reply"])
        return result["reply"]

    def _left(self) -> int | None:
        """Bytes left now; None if the daemon did not say (it is going away)."""
        try:
            reply = self.stat()
        except (ControlError, OSError, ValueError):  # the daemon went away: no display
            return None
        if not reply.get("ok"):
            return None
        try:
            return left_to_store(reply, self.whole_mount)
        except (KeyError, TypeError):  # a daemon of another version: no display either
            return None

    def _bar(self, first: int | None, done: threading.Event) -> None:
        total = first or 0
        with tqdm(total=total, unit="iB", unit_scale=True, unit_divisor=UNIT, file=self.out,
                  desc=self.short, **shape(self.out), leave=False,
                  bar_format=BAR) as bar:  # fmt: skip
            while not done.wait(POLL):
                left = self._left()
                if left is None:
                    continue
                if left > bar.total - bar.n:  # new bytes to store arrived meanwhile
                    bar.total = bar.n + left
                bar.update(max(0, bar.total - left - bar.n))

    def _lines(self, first: int | None, done: threading.Event, start: float) -> None:
        while not done.wait(LOG_EVERY):
            left = self._left()
            if left is None:
                continue
            elapsed = time.monotonic() - start
            stored = max(0, (first or 0) - left)
            rate = stored / elapsed if elapsed > 0 else 0.0
            eta = f", about {left / rate:.0f}s left" if rate > 0 and left else ""
            print(f"{self.what}: {human(left)} left to store, {human(rate)}/s{eta}",
                  file=self.out, flush=True)  # fmt: skip

    def _summary(self, first: int | None, elapsed: float, reply: dict[str, Any]) -> None:
        if not reply.get("ok") or not first:
            return  # nothing was left to store: nothing to sum up
        rate = f" ({human(first / elapsed)}/s)" if elapsed > 0 and first else ""
        print(f"{self.what}: {human(first)} stored in {elapsed:.1f}s{rate}",
              file=self.out, flush=True)  # fmt: skip


def shape(out: TextIO) -> dict[str, int]:
    """tqdm's ncols and nrows: the terminal's, or 80x24 where it says 0 (a
    pty nobody sized), at which tqdm would draw nothing at all."""
    try:
        size = os.get_terminal_size(out.fileno())
    except (OSError, ValueError):
        return {"ncols": 80, "nrows": 24}
    return {"ncols": size.columns or 80, "nrows": size.lines or 24}


def bars(files: Iterable[dict[str, Any]], width: int = 80) -> list[str]:
    """For ``stat --watch``: a bar per file being flushed (bytes stored of
    its size), and a line per file being mirrored (the buddy acknowledges a
    file's pages as a whole, so there is no fraction to show)."""
    lines = []
    for f in files:
        if f["state"] == "dirty" and f.get("mirror") == "streaming":
            lines.append(f"mirroring {shown(f['path'])}: {human(f['size'])} to the buddy")
            continue
        if f["state"] != "flushing":
            continue
        done = min(f["flushed_bytes"], f["size"])
        label = "flushing"
        lines.append(tqdm.format_meter(done, max(f["size"], 1), 0, ncols=width,
                                       prefix=f"{label} {shown(f['path'])}", unit="iB",
                                       unit_scale=True, unit_divisor=UNIT,
                                       bar_format="{desc}: {percentage:3.0f}%|{bar}| "
                                       "{n_fmt}/{total_fmt}{unit}"))  # fmt: skip
    return lines


@contextmanager
def gc_progress(out: TextIO) -> Iterator[Callable[[str], None] | None]:
    """For ``ckptfs gc`` on a terminal: counters of the manifests read and
    of the store's files looked at (neither total is known before the walk
    ends). None off a terminal: gc's report says it all at the end."""
    if not out.isatty():
        yield None
        return
    # leave=True: the final counts stay above the report.
    manifests = tqdm(desc="manifests read", unit="", file=out, position=0, **shape(out))
    chunks = tqdm(desc="store files looked at", unit="", file=out, position=1, **shape(out))
    bars = {"manifest": manifests, "chunk": chunks}
    try:
        yield lambda what: bars[what].update()
    finally:
        chunks.close()
        manifests.close()
