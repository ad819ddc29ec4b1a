"""ckptfs's FUSE session: the kernel's requests, read from /dev/fuse and
answered by a request thread or on the trio loop.

Why not pyfuse3's loop: there every request, however small, runs through
two task steps and a lock handed between its reader tasks, about 20-45 µs of
the daemon's CPU on this VM, and pyfuse3 cannot set FOPEN_NOFLUSH.
``torch.load(mmap=True)`` sends three requests between its two opens (OPEN,
Python's ``isatty`` IOCTL, OPEN), so that was most of the window in which a
replace of the path tears the load (issue 13, docs/PERFORMANCE.md).

Who reads (``ReadMode``, one reader at a time):

- THREAD: the request thread waits in poll(2) on /dev/fuse and answers what
  needs no await by itself: INIT and IOCTL (ckptfs has none: ENOTTY, what
  ``isatty`` gets on any file), which need no state, and the operations with
  an *off-loop* fast path (``Handlers.off_loop``: a read-only open of a file
  the cache can serve, a reader's release that drops nothing, a getattr that
  needs no store access). It runs those only while the loop waits for I/O:
  the loop holds the state lock at every other moment (``_LoopHoldsState``),
  and the thread takes it without waiting or not at all. So a small request
  costs one wake-up of a thread that goes back to sleep as soon as it has
  written the reply, instead of a turn of the loop before and after. An
  open whose manifest check is due (close-to-open), a lookup of a name whose
  file or directory we hold, and a stat that needs the store (``Handlers.off_loop_checked``,
  ``CheckedPath``): the thread lets go of the lock, reads the entry itself
  (none while the store is unhealthy) and answers with the lock taken again,
  if no rename ran meanwhile and (open, lookup) the manifest still names our
  copy's version; else the loop answers it. Nobody reads /dev/fuse while it
  reads the store, so a timer bounds that (storecall.py): if the read runs
  past ``STORE_CALL_WAIT`` the loop takes the reading (``Handed.TAKEN``) and
  the thread's request, which a worker answers at once, and gives the
  reading back only once the read has returned.
- LOOP: anything else (a request without an off-loop path, a fast path that
  declined, the state lock taken) goes to the loop with the reading itself:
  the thread parks, and worker tasks read, as below, until no request came
  for ``LOOP_IDLE``; then the thread reads again. A save's WRITEs thus never
  pay a hand-over each.

On the loop:

- Worker tasks take turns reading, one at a time (the read lock). The reader
  reads before it waits, so a burst costs no wake-up of the loop per request.
- INTERRUPT (no reply) marks the request it names, if a handler still has it
  and its caller was sent a stop signal: the waits that may end early then
  end (interrupts.py).
- An operation with a *fast path* (``Handlers.fast``: those above, and a
  release that drops a file, forget) is answered by the reader inline, with
  no task. A fast path is synchronous, and declines (returns None) before it
  changes anything when the answer needs an await.
- Any other request is run by the worker that read it (or took it from the
  thread), after it hands the reading to the next worker (one is started if
  none waits, up to ``workers``). So each request's handler starts (runs up
  to its first await) before the next request is read, as pyfuse3 did: the
  thread gives the reading away with the request and gets it back only once
  the loop is idle. The kernel does not promise that a writer's RELEASE, a
  background request, comes before a later request of the same caller;
  nothing here relies on it (while it is on its way the file still has its
  writer, and fast paths answer from our copy). With every worker busy,
  reading stops and the kernel holds the rest.

After an answer of its own the request thread yields the CPU
(sched_yield): the scheduler often wakes the caller onto the waker's CPU,
and the caller should run before the thread's bookkeeping. Then, with
``fuse.request_spin`` (off by default), it reads again and again for that
long rather than wait in poll(2) at once, unless the yield ran another task
(its caller, on this CPU: spinning beside it only delays it) or there is a
single CPU: a caller's next request often comes within tens of microseconds
(torch.load's IOCTL follows its OPEN by about 15 µs) and a wake-up from
poll(2) costs 8-20 µs on a VM. Measured, that helps a tight loop of
torch.load(mmap=True) (20% narrower window) and hurts loads 0.1 s apart and
a zipfile reader's reopen, hence off. (A yield at each turn of the spin
measured worse still: every reopen 100 µs late.)

After a fast or stateless answer the reader keeps a short PM QoS hold
(``fuse.burst_latency_hold``, cpulatency.BurstHold), because a caller's next
request usually follows within microseconds and on a VM a halted CPU takes
30-70 µs to wake; the reader lets it go when its wait for the next request
runs out.
"""

from __future__ import annotations

import enum
import errno
import logging
import math
import os
import queue
import select
import threading
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import trio

from . import fuseabi as abi
from . import interrupts
from .cpulatency import BurstHold
from .fuseabi import Op
from .storecall import ReadingTaken, StoreCallWatch

try:
    from . import _fastreader
except ImportError:  # not built (a source tree run without its install): Python reads
    _fastreader = None  # type: ignore[assignment]

log = logging.getLogger("ckptfs.fuse")

Payload = bytes | memoryview
Reply = Payload | Sequence[Payload]
SlowHandler = Callable[["Request"], Awaitable[Reply | None]]
FastHandler = Callable[["Request"], Reply | None]

READ = int(Op.READ)
NO_REPLY = frozenset(int(op) for op in (Op.FORGET, Op.BATCH_FORGET, Op.INTERRUPT, Op.NOTIFY_REPLY))
# Bodies larger than this keep their read buffer until handled (a WRITE's
# data); smaller ones are copied out so that reading goes on in the buffer.
KEEP_BUFFER_OVER = 64 << 10
BUFFERS = 16  # spare read buffers of BUFFER_SIZE (1 MiB + a page), pre-faulted
PAGE = os.sysconf("SC_PAGE_SIZE")
YIELD_EVERY = 8  # requests the reader answers in a row before other tasks run
STOP_POLL = 0.2  # seconds between looks for a stop signal after another signal
# The loop reads while requests that need it keep coming (a save's WRITEs);
# this long without a request, the request thread reads again.
LOOP_IDLE = 0.005
THREAD_JOIN = 5.0  # seconds to wait for the request thread at the end
# A store call of the request thread's own (a due manifest check) may hold up
# the reading this long before the loop takes it over (storecall.py): a local
# or NFS stat takes well under a millisecond while the store is healthy. After
# one ran that long, the thread makes none for STORE_CALL_COOLDOWN.
STORE_CALL_WAIT = 0.02
STORE_CALL_COOLDOWN = 1.0
# Bound once: every request goes through them.
IN_HEADER_UNPACK = abi.IN_HEADER.unpack_from
IN_HEADER_SIZE = abi.IN_HEADER.size
OUT_HEADER_PACK = abi.OUT_HEADER.pack
OUT_HEADER_SIZE = abi.OUT_HEADER.size


class Handed(enum.Enum):
    """What the loop's reader gets from the request thread besides a request."""

    GONE = "the connection is gone"
    TAKEN = "the loop took the reading: the thread's store call overran"
    FAILED = "the request thread failed: the loop reads for good"


class ReadMode(enum.Enum):
    THREAD = "thread"  # the request thread reads /dev/fuse
    LOOP = "loop"  # the loop's worker tasks read it


class _LoopHoldsState(trio.abc.Instrument):
    """The loop holds ``lock`` except while it waits for I/O: the request
    thread runs an off-loop fast path only then, with every task parked at an
    await, as a fast path on the loop runs between two task steps. Installed
    only while the thread reads: without it the loop holds the lock
    throughout, and a save's many turns of the loop pay nothing for it."""

    def __init__(self, lock: threading.Lock) -> None:
        self.lock = lock
        # Set while the loop waits for the lock: the thread then takes it no
        # more (a lock is not fair, and a stream of READs from RAM would let
        # the thread take it again and again before the loop's thread wakes).
        # The compiled reader reads it too (fs/_fastreader.c).
        self.loop_waits = False
        # The compiled reader, if it runs, and who adopts the handles it gave out.
        self.fast: Any = None
        self.adopt: Callable[[list[tuple[int, int, int, int, int, float]]], None] | None = None
        self.adopt_seen: Callable[[list[tuple[int, bool, float]]], None] | None = None

    def before_io_wait(self, timeout: float) -> None:
        self.lock.release()

    def after_io_wait(self, timeout: float) -> None:
        self.loop_waits = True
        try:
            self.lock.acquire()
        finally:
            self.loop_waits = False
        self.took_back()

    def took_back(self) -> None:
        """The loop holds the lock again and may change any state: the
        compiled reader's handles become the filesystem's first, then its
        open tickets lapse."""
        fast = self.fast
        if fast is not None:
            self._adopt_pending()
            fast.invalidate()

    def try_take(self) -> bool:
        """For the request thread: the lock, unless the loop holds it or
        waits for it; with it, the state, the compiled reader's handles
        included."""
        if self.loop_waits or not self.lock.acquire(blocking=False):
            return False
        if self.fast is not None:
            self._adopt_pending()
        return True

    def _adopt_pending(self) -> None:
        if not self.fast.pending:
            return
        seen: list[tuple[int, bool, float]] = []
        opened: list[tuple[int, int, int, int, int, float]] = []
        try:
            assert self.adopt_seen is not None and self.adopt is not None
            seen = self.fast.drain_seen()
            self.adopt_seen(seen)
            opened = self.fast.drain()
            self.adopt(opened)
        except Exception:  # a bug; raised here, it would remove this instrument
            log.exception("adopting the compiled reader's answers %r, %r failed", seen, opened)


class FuseError(Exception):
    """A request's answer is this errno."""

    def __init__(self, err: int) -> None:
        super().__init__(err, os.strerror(err))
        self.errno = err


class _Unmounted(Exception):
    """The connection is gone (read(2) said ENODEV)."""


@dataclass(slots=True)
class Request:
    op: int
    unique: int
    nodeid: int
    uid: int
    gid: int
    pid: int  # the caller's thread id (0 for a RELEASE the kernel sends itself)
    body: memoryview
    buffer: bytearray | None = None  # a read buffer to give back once handled


@dataclass
class Handlers:
    """What a session dispatches to: per opcode, an async handler (run by a
    worker task) and optionally a fast path (synchronous, run by the reader)."""

    slow: dict[int, SlowHandler]
    fast: dict[int, FastHandler] = field(default_factory=dict)
    # Fast paths the request thread may run: they touch nothing of trio's
    # (no event, no task, no channel), only the filesystem's tables.
    off_loop: dict[int, FastHandler] = field(default_factory=dict)
    # Off-loop paths tried when the op's off-loop fast path declined.
    off_loop_checked: dict[int, CheckedPath] = field(default_factory=dict)
    writeback_cache: bool = False
    # The compiled reader's (fs/_fastreader.c): given its tickets once it runs
    # (issued after the thread's answers, state lock held), adopting the
    # handles of the read-only opens it answered: [(fh, ino, uid, gid, pid,
    # checked_at)], and what its LOOKUPs and GETATTRs leave the filesystem to
    # know: [(ino, lookup, checked_at)].
    use_tickets: Callable[[Any], None] | None = None
    adopt_opens: Callable[[list[tuple[int, int, int, int, int, float]]], None] | None = None
    adopt_seen: Callable[[list[tuple[int, bool, float]]], None] | None = None
    # Told when the compiled reader answered requests (from the request thread).
    compiled_answers: Callable[[], None] | None = None
    # After each answer of the request thread, its reply written, the state lock held.
    after_thread_answer: Callable[[], None] | None = None


@dataclass(frozen=True)
class CheckedPath:
    """An off-loop answer that needs one short backing-store read first
    (an open whose manifest check is due): ``plan`` (state lock held) says
    what to read, or None; ``read`` reads it with the lock let go (a
    blocking call, bounded by the session's StoreCallWatch; None: not now);
    ``finish`` (the lock held again) answers with it, or declines (None) if
    the state moved meanwhile."""

    plan: Callable[[Request], Any]
    read: Callable[[Any], Any]
    finish: Callable[[Request, Any, Any], Reply | None]


@dataclass
class Counters:
    """Each field is bumped by one thread only, the loop's or the request
    thread's (``+=`` is no atomic step: two bumpers would lose counts);
    :func:`describe` adds up what both count of one kind."""

    # The loop's
    fast: int = 0  # answered by a fast path, inline, on the loop
    declined: int = 0  # had a fast path that declined: handled by a worker
    handled: int = 0  # handled by a worker (the async handler)
    stateless: int = 0  # INIT, IOCTL, unknown opcodes, on the loop
    taken: int = 0  # readings the loop took from the thread, held up in the store
    thread_failures: int = 0  # the request thread failed (a bug): the loop reads for good
    interrupts: int = 0  # INTERRUPTs for a stop signal, of a request a handler still had
    signals_ignored: int = 0  # INTERRUPTs for another signal (see interrupts.py)
    workers: int = 0  # worker tasks started so far
    # The request thread's
    thread: int = 0  # answered by a fast path by the request thread
    checked: int = 0  # of which after a store read of its own (CheckedPath)
    # (The compiled reader counts its own answers: describe() adds them.)
    thread_stateless: int = 0  # INIT, IOCTL, unknown opcodes, by the thread
    spun: int = 0  # read by the request thread while it spun after an answer
    thread_waits: int = 0  # the request thread's waits in poll(2)


class Session:
    """One mount's FUSE connection: ``fd`` is its /dev/fuse descriptor."""

    def __init__(
        self,
        fd: int,
        handlers: Handlers,
        *,
        workers: int,
        buffers: int = BUFFERS,
        burst: BurstHold | None = None,
        request_thread: bool = True,
        spin: float = 0.0,
        compiled: bool = True,
    ) -> None:
        os.set_blocking(fd, False)  # readers wait in poll(2) or the loop, not in read(2)
        self.fd = fd
        self.handlers = handlers
        # Plain int keys: a request's opcode is an int, and an IntEnum key
        # makes each lookup compare through the enum.
        self._fast = {int(op): fn for op, fn in handlers.fast.items()}
        self._slow = frozenset(int(op) for op in handlers.slow)
        self._off_loop = {int(op): fn for op, fn in handlers.off_loop.items()}
        self._off_loop_checked = {int(op): p for op, p in handlers.off_loop_checked.items()}
        self._burst = burst
        # Spinning only helps when the caller can run meanwhile.
        self.spin = spin if len(os.sched_getaffinity(0)) > 1 else 0.0
        # The request thread's compiled reader (fs/_fastreader.c), made with
        # the thread; not with a spin (the Python reader's alone).
        self.compiled = compiled and _fastreader is not None and not self.spin
        if compiled and _fastreader is None:
            log.warning(
                "the compiled FUSE reader (fs/_fastreader.c) is not built; "
                "pip install -e . builds it: the request thread reads in Python"
            )
        self.fast_reader: Any = None
        self.counters = Counters()
        self._max_workers = workers
        self._idle_workers = 0  # waiting for the read lock, or reading
        self._read_lock = trio.Lock()
        self._read_buf = _prefaulted(abi.BUFFER_SIZE)  # the read lock holder's
        self._buffers: queue.SimpleQueue[bytearray] = queue.SimpleQueue()
        for _ in range(buffers):
            self._buffers.put(_prefaulted(abi.BUFFER_SIZE))
        self._stopping = False
        self._reading: set[trio.CancelScope] = set()  # cancelled at the end
        self._workers: trio.Nursery | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._in_flight: dict[int, interrupts.InFlight] = {}  # by unique, while handled
        self.mode = ReadMode.THREAD if request_thread else ReadMode.LOOP
        self._state_lock = threading.Lock()  # the loop's, except while it waits for I/O
        self._holds_state = _LoopHoldsState(self._state_lock)
        self._sharing = False  # _holds_state installed
        # Whether the loop's epoll still lists /dev/fuse (see _stop_polling).
        self._polled = False
        self._thread: RequestThread | None = None
        # Set at INIT: the kernel drops cached pages a direct write overwrites,
        # so pages may be pushed (kernelpages.py) and AUTO_INVAL_DATA is off.
        self.direct_writes_drop_pages = False
        self._store_watch: StoreCallWatch | None = None  # the thread's store calls
        # The request the thread gave the reading away with, or why the
        # reader reads (Handed); one at a time, so never more than one here.
        self._handed_send, self._handed_recv = trio.open_memory_channel[Request | Handed](1)

    # ----- the session's life ------------------------------------------------------------
    async def run(self) -> None:
        """Serve until the mount goes away or :meth:`terminate`; returns once
        every request being handled has been answered."""
        self._token = trio.lowlevel.current_trio_token()
        self._state_lock.acquire()
        try:
            if self.mode is ReadMode.THREAD and not self._stopping:
                try:
                    self._store_watch = StoreCallWatch(STORE_CALL_WAIT, STORE_CALL_COOLDOWN)
                except OSError as exc:  # no timerfd: no thread that could hang the reading
                    log.warning("no timer for the FUSE request thread (%s): the loop reads", exc)
                    self.mode = ReadMode.LOOP
            if self._store_watch is not None:
                self._thread = RequestThread(self)
                if self.compiled:
                    self._start_compiled(self._thread)
                self._share_state(True)
                self._thread.start()
            try:
                async with trio.open_nursery() as workers:
                    self._workers = workers
                    if not self._stopping:
                        self._add_worker()
                        if self._store_watch is not None:
                            workers.start_soon(self._watch_store_calls, self._store_watch)
            finally:
                self._workers = None
        finally:
            # The thread first: until it has ended it may take the lock
            # whenever the loop waits for I/O (here too, while it joins).
            await self._end_thread()
            self._share_state(False)
            self._holds_state.took_back()  # handles the thread gave out last
            self._holds_state.fast = None  # (a reference cycle through the reader)
            self._state_lock.release()
            if self._burst is not None:
                self._burst.release()  # the readers' hold: nobody reads any more

    def _start_compiled(self, thread: RequestThread) -> None:
        """The compiled reader for ``thread``, with the filesystem's hooks."""
        handlers = self.handlers
        if (
            handlers.adopt_opens is None
            or handlers.adopt_seen is None
            or handlers.use_tickets is None
        ):
            return  # a dispatch table without them: the Python reader
        self.fast_reader = _fastreader.Reader(
            self.fd, thread.wake_fd, self._state_lock, self._holds_state
        )
        self._holds_state.fast = self.fast_reader
        self._holds_state.adopt = handlers.adopt_opens
        self._holds_state.adopt_seen = handlers.adopt_seen
        handlers.use_tickets(self.fast_reader)

    async def _end_thread(self) -> None:
        thread, self._thread = self._thread, None
        if thread is None:
            return
        thread.stop()
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(thread.join, THREAD_JOIN)
        if thread.is_alive():
            # Held up in the store: its timer stays open (it disarms it on
            # return; a closed number could be another file's by then).
            log.error("the FUSE request thread did not end within %gs", THREAD_JOIN)
        elif self._store_watch is not None:
            self._store_watch.close()

    def terminate(self) -> None:
        """Stop reading requests (from any thread); :meth:`run` returns once
        the requests being handled are answered."""
        self._stopping = True
        if self._token is None:
            return
        try:
            if trio.lowlevel.current_trio_token() is self._token:
                self._stop_reading()
                return
        except RuntimeError:
            pass  # not in trio
        try:
            self._token.run_sync_soon(self._stop_reading)
        except trio.RunFinishedError:
            pass

    def abort(self) -> None:
        """Stop reading and cancel the handlers still running (on the loop):
        :meth:`run` returns at once. Their callers get no reply here; the
        kernel fails their requests when the connection closes."""
        self._stop_reading()
        if self._workers is not None:
            self._workers.cancel_scope.cancel()

    def _stop_reading(self) -> None:
        self._stopping = True
        for scope in self._reading:
            scope.cancel()
        if self._thread is not None:
            # A store call of the thread's still running: its request is the
            # loop's from now on, so the thread, whenever the call returns,
            # touches no state of a session that is ending.
            assert self._store_watch is not None
            self._store_watch.take_if_overrun(self._take_reading, now=True)
            self._thread.stop()

    def close(self) -> None:
        """Close the connection: open files of the mount then get ENOTCONN."""
        fd, self.fd = self.fd, -1
        if fd < 0:
            return  # closed already: the number may be another file's by now
        try:
            os.close(fd)
        except OSError:
            pass

    # ----- workers ------------------------------------------------------------------------
    def _add_worker(self) -> None:
        assert self._workers is not None
        self.counters.workers += 1
        self._workers.start_soon(self._worker)

    async def _worker(self) -> None:
        while not self._stopping:
            req = None
            self._idle_workers += 1
            try:
                with trio.CancelScope() as scope:
                    self._reading.add(scope)
                    try:
                        async with self._read_lock:
                            req = await self._next_request()
                    finally:
                        self._reading.discard(scope)
            finally:
                self._idle_workers -= 1
            if req is None:
                self._stop_reading()  # the connection is gone, or terminate()
                return
            if not self._idle_workers and self.counters.workers < self._max_workers:
                self._add_worker()  # someone must read while this one works
            await self._handle(req)

    async def _next_request(self) -> Request | None:
        """The next request that needs a worker (the others are answered on
        the way), its body safe from the next read; None once the connection
        is gone. Only the holder of the read lock reads, into ``_read_buf``,
        or takes what the request thread gives the loop."""
        served = 0
        while not self._stopping:
            # What the thread handed over first, also in LOOP mode: the loop
            # took the reading while this reader awaited something else (a
            # checkpoint, below), and its Handed.TAKEN must not stay there.
            try:
                received: Request | Handed | None = self._handed_recv.receive_nowait()
            except trio.WouldBlock:
                received = None
            read_here = received is None and self.mode is ReadMode.LOOP
            if read_here:
                try:
                    n = self._read(self._read_buf)
                except _Unmounted:
                    return None
                if not n:
                    await self._wait_for_request()
                    continue
                req = _request(self._read_buf, n)
            else:
                if received is None:
                    self._stop_polling()
                    received = await self._handed_recv.receive()  # with the reading
                self._share_state(False)  # the thread parked
                if received is Handed.GONE:
                    return None
                if received is Handed.TAKEN:
                    continue  # read here while the thread is held up
                if received is Handed.FAILED:
                    self.counters.thread_failures += 1
                    continue  # read here from now on (_thread_may_read)
                req = received
            if not self._answer_inline(req):
                if read_here:
                    self._read_buf = self._hand_on(req, self._read_buf)
                return req  # (the thread made the body of its own safe)
            if req.op != READ and self._thread_may_read():
                # A small request: the caller's next one is too. Not after a
                # READ: the thread declined it (its bytes were in a chunk's
                # frame) or the loop was reading already, and the reads of a
                # load come in a stream (the loop reads on until LOOP_IDLE).
                self._give_to_thread()
            served += 1
            if served % YIELD_EVERY == 0:
                await trio.lowlevel.checkpoint()  # the other tasks' turn
        return None

    def _thread_may_read(self) -> bool:
        """Whether the loop gives the reading back to a request thread when
        it has no more to do (not to a thread that failed)."""
        return self._thread is not None and not self._thread.failed

    def _give_to_thread(self) -> None:
        """The request thread reads from here on, unless it is still held up
        in a store call that overran (then the loop reads on)."""
        assert self._store_watch is not None
        self._store_watch.may_resume(self._resume_thread)

    def _resume_thread(self) -> None:
        assert self._thread is not None
        self._share_state(True)
        self.mode = ReadMode.THREAD
        self._thread.resume()

    def _share_state(self, share: bool) -> None:
        """On the loop: let the request thread run fast paths while the loop
        waits for I/O, or not (it parked: the loop reads)."""
        if share and not self._sharing:
            # The loop ran alone, and may have changed anything.
            self._holds_state.took_back()
            trio.lowlevel.add_instrument(self._holds_state)
        elif not share and self._sharing:
            trio.lowlevel.remove_instrument(self._holds_state)
        self._sharing = share

    async def _wait_for_request(self) -> None:
        """Until /dev/fuse has a request; lets go of the burst hold when it
        runs out, and gives the reading back to the request thread once no
        request came for LOOP_IDLE (the loop reads on after a request that
        needed a worker: a save's next WRITE is on its way)."""
        idle_until = trio.current_time() + LOOP_IDLE if self._thread_may_read() else math.inf
        burst = self._burst
        while True:
            held = burst.remaining() if burst is not None else None
            timeout = idle_until - trio.current_time()
            if held is not None:
                timeout = min(timeout, held)
            with trio.move_on_after(max(timeout, 0.0)):
                self._polled = True
                await trio.lowlevel.wait_readable(self.fd)
                return
            if burst is not None:
                burst.let_go_if_over()
            if trio.current_time() >= idle_until:
                self._give_to_thread()
                return

    def _stop_polling(self) -> None:
        """Take /dev/fuse out of the loop's epoll while the request thread
        reads. trio leaves a descriptor it waited for in its epoll set; after
        a wait that was cancelled (the LOOP_IDLE hand-back) its mask keeps
        EPOLLERR and EPOLLHUP, which the kernel always adds, and the kernel
        wakes every waiter of /dev/fuse at each request without saying which
        events, so the loop's thread was woken (and slept again) for every
        request the thread answered, preempting it on its CPU. Called by the
        reader, the only task that waits for /dev/fuse: no task is waiting
        then, so trio's notify_closing wakes nobody and only removes the
        registration."""
        if self._polled and self.fd >= 0:
            self._polled = False
            trio.lowlevel.notify_closing(self.fd)

    def _answer_inline(self, req: Request) -> bool:
        """Whether ``req`` was answered without a worker, on the loop: INIT,
        INTERRUPT, stateless, fast."""
        # The order of the tests is the order of how often they are true: this
        # runs for every request, on the caller's clock (docs/PERFORMANCE.md).
        op = req.op
        fast = self._fast.get(op)
        if fast is not None:
            if not self._run_fast(fast, req):
                return False
            self.counters.fast += 1
            self.answered(req)
        elif op in self._slow:
            return False
        elif op == Op.INTERRUPT:
            self._interrupt(req)
        else:
            self._init_or_stateless(req)
        return True

    def answer_off_loop(self, req: Request) -> bool:
        """Whether ``req`` was answered by the request thread (the caller):
        INIT, stateless, or an off-loop fast path while the loop waits for
        I/O. Anything else needs the loop. The caller then calls
        :meth:`answered` (after it let the request's caller run)."""
        op = req.op
        if op in self._slow or op in self._fast:
            fast = self._off_loop.get(op)
            if (
                fast is None and op not in self._off_loop_checked
            ) or not self._holds_state.try_take():
                return False  # no off-loop path, or the loop is running
            plan = None
            try:
                answered = fast is not None and self._run_fast(fast, req, count_declined=False)
                if answered:
                    self._after_thread_answer()
                elif self._store_watch is not None and self._store_watch.usable():
                    plan = self._plan_checked(req)
            finally:
                self._state_lock.release()
            if not answered and (plan is None or not self._answer_checked(req, *plan)):
                return False  # the loop's fast path tries again, or a worker
            self.counters.thread += 1
        elif op == Op.INTERRUPT:
            return False  # the requests in flight are the loop's
        else:
            self.counters.thread_stateless += 1
            if op == Op.INIT:
                self._init(req)
            else:
                self._stateless(req)
        return True

    def _plan_checked(self, req: Request) -> tuple[CheckedPath, Any] | None:
        """With the state lock: the checked path's plan for ``req``, if any."""
        checked = self._off_loop_checked.get(req.op)
        if checked is None:
            return None
        try:
            plan = checked.plan(req)
        except Exception:  # the loop's handler meets it again, and reports it
            log.exception("%s of inode %d: planning its check failed", _name(req.op), req.nodeid)
            return None
        return None if plan is None else (checked, plan)

    def _answer_checked(self, req: Request, checked: CheckedPath, plan: Any) -> bool:
        """Read for ``plan`` with the state lock let go, then answer with the
        lock held (taken without waiting, as every off-loop path does).
        Raises ReadingTaken if the read overran and the loop took the reading."""
        assert self._store_watch is not None
        result = self._store_watch.run(checked.read, plan, req)
        if result is None or not self._holds_state.try_take():
            return False
        try:
            if not self._run_fast(
                lambda r: checked.finish(r, plan, result), req, count_declined=False
            ):
                return False
            self._after_thread_answer()
        finally:
            self._state_lock.release()
        self.counters.checked += 1
        return True

    def _after_thread_answer(self) -> None:
        hook = self.handlers.after_thread_answer
        if hook is None:
            return
        try:
            hook()
        except Exception:  # a bug; the answer stands, and the thread reads on
            log.exception("after the request thread's answer")

    def _init_or_stateless(self, req: Request) -> None:
        self.counters.stateless += 1
        if req.op == Op.INIT:
            self._init(req)
            return
        self._stateless(req)
        self.answered(req)

    def answered(self, req: Request) -> None:
        """After an inline answer: keep idle CPUs quick to wake for a while."""
        if self._burst is not None and req.pid:
            self._burst.answered()  # a caller waits for it: more may follow

    def give_to_loop(self, req: Request | Handed) -> None:
        """From the request thread, which parked: the loop reads from here on,
        starting with ``req``, or told why by ``Handed`` (the connection is
        gone; the thread failed)."""
        assert self._token is not None
        try:
            self._token.run_sync_soon(self._handed, req)
        except trio.RunFinishedError:
            pass

    def _handed(self, req: Request | Handed) -> None:
        # The mode changes here, on the loop, with the request on its way to
        # the reader: a reader that looked at the mode since it gave the
        # reading to the thread waits for this channel, not /dev/fuse.
        self.mode = ReadMode.LOOP
        try:
            self._handed_send.send_nowait(req)
        except trio.WouldBlock:  # the thread gives one at a time: a bug
            log.error("the FUSE request thread gave the loop a second request at once")

    async def _watch_store_calls(self, watch: StoreCallWatch) -> None:
        """Takes the reading from the request thread when a store call of its
        own runs past ``watch.wait`` (its timer fires)."""
        with trio.CancelScope() as scope:
            self._reading.add(scope)
            try:
                while not self._stopping:
                    await trio.lowlevel.wait_readable(watch.timer.fd)
                    if watch.take_if_overrun(self._take_reading):
                        self.counters.taken += 1
                        # Info: nothing failed (the loop answers), and the
                        # store's own health is tracked and reported elsewhere.
                        log.info(
                            "a backing-store read in the FUSE request thread took over %g s: "
                            "the loop reads requests meanwhile, and the thread makes no "
                            "store reads for %g s",
                            watch.wait,
                            watch.cooldown,
                        )
            finally:
                self._reading.discard(scope)

    def _take_reading(self, req: Request) -> None:
        """Under the watch's lock, the thread held up in the store for
        ``req``: park it, have a worker answer ``req`` now (with the loop's
        timeouts; an INTERRUPT finds it in flight), and wake the reader,
        which waits for the thread's hand-over."""
        assert self._thread is not None
        self._thread.park()
        self.mode = ReadMode.LOOP
        # Off the thread's read buffer, which is its own again once its call
        # returns (it drops the request then).
        req.body = memoryview(bytes(req.body))
        if self._workers is not None:
            self._workers.start_soon(self._handle, req)
        else:  # the session ends: no worker takes it
            self._reply_error(req, errno.EIO)
        try:
            self._handed_send.send_nowait(Handed.TAKEN)
        except trio.WouldBlock:  # the thread hands over only while it reads: a bug
            log.error("the loop took the reading while a hand-over was pending")

    async def _handle(self, req: Request) -> None:
        self.counters.handled += 1
        try:
            handler = self.handlers.slow.get(req.op)
            if handler is None:  # a fast path declined with nothing behind it
                log.error("%s of inode %d: no handler", _name(req.op), req.nodeid)
                self._reply_error(req, errno.ENOSYS)
                return
            try:
                with self._in_flight_while_handled(req):
                    result = await handler(req)
            except Exception as exc:
                self._reply_failure(req, exc)
                return
            # No await between the handler's return and the reply: a READ's
            # result may be a view of an arena slot.
            if req.op in NO_REPLY:
                pass
            elif result is None:  # a caller must never wait for ever
                log.error("%s of inode %d: the handler gave no reply", _name(req.op), req.nodeid)
                self._reply_error(req, errno.EIO)
            else:
                self._reply(req, result)
        finally:
            if req.buffer is not None:
                self._buffers.put(req.buffer)
                req.buffer = None

    # ----- reading and replying -------------------------------------------------------------
    def _read(self, buf: bytearray) -> int:
        """One request into ``buf``; 0 if there is none yet."""
        try:
            return os.readv(self.fd, [buf])
        except (BlockingIOError, InterruptedError):
            return 0
        except OSError as exc:
            return self.read_failed(exc)

    def read_failed(self, exc: OSError) -> int:
        """0 for a read that found nothing after all; else the session ends."""
        if exc.errno in (errno.ENOENT, errno.EAGAIN, errno.EINTR):
            return 0  # ENOENT: interrupted before it was read
        if exc.errno not in (errno.ENODEV, errno.ECONNABORTED):
            log.error("reading /dev/fuse failed, ending the session: %s", exc)
        # Unmounted, aborted (/sys/fs/fuse/connections/N/abort), or
        # unreadable: the session ends, and with it the mount.
        raise _Unmounted from None

    def _run_fast(self, fast: FastHandler, req: Request, count_declined: bool = True) -> bool:
        """Whether ``fast`` answered ``req`` (replied, or failed with an errno)."""
        try:
            result = fast(req)
        except Exception as exc:
            self._reply_failure(req, exc)
            return True
        if result is None:
            self.counters.declined += count_declined
            return False
        if req.op not in NO_REPLY:
            self._reply(req, result)
        return True

    @contextmanager
    def _in_flight_while_handled(self, req: Request) -> Iterator[None]:
        """``req`` is in flight, for an INTERRUPT that names it."""
        with interrupts.handling(req.unique, req.pid) as inflight:
            self._in_flight[req.unique] = inflight
            try:
                yield
            finally:
                del self._in_flight[req.unique]

    def _interrupt(self, req: Request) -> None:
        # The kernel sends it only once it has handed us the request it
        # names, so a request not in flight was answered already: nothing to
        # do (an EAGAIN reply would make the kernel send it again).
        if len(req.body) < abi.INTERRUPT_IN.size:
            return
        inflight = self._in_flight.get(abi.INTERRUPT_IN.unpack_from(req.body)[0])
        if inflight is None:
            return
        if interrupts.stop_requested(inflight.caller):
            self._interrupted(inflight)
            return
        # A SIGCHLD, a timer: no EINTR. The kernel sends no second INTERRUPT
        # for this request, so a stop signal that comes later (Ctrl-C) is
        # looked for until the request is answered.
        self.counters.signals_ignored += 1
        if self._workers is not None:
            self._workers.start_soon(self._watch_for_stop, inflight)

    def _interrupted(self, inflight: interrupts.InFlight) -> None:
        self.counters.interrupts += 1
        inflight.interrupt()

    async def _watch_for_stop(self, inflight: interrupts.InFlight) -> None:
        while self._in_flight.get(inflight.unique) is inflight:
            if interrupts.stop_requested(inflight.caller):
                self._interrupted(inflight)
                return
            await trio.sleep(STOP_POLL)

    def _stateless(self, req: Request) -> None:
        if req.op not in NO_REPLY:  # IOCTL: ENOTTY, as for any file without ioctls
            self._reply_error(req, errno.ENOTTY if req.op == Op.IOCTL else errno.ENOSYS)

    def _hand_on(self, req: Request, buf: bytearray) -> bytearray:
        """Make ``req`` outlive the read buffer; returns the buffer to read into next."""
        if len(req.body) > KEEP_BUFFER_OVER:
            try:
                spare = self._buffers.get_nowait()
            except queue.Empty:
                spare = None
            if spare is not None:
                req.buffer = buf  # the body stays where it was read
                return spare
        # Small, or every buffer is held by a handler that waits (writers in
        # backpressure): a copy, so that reading goes on.
        req.body = memoryview(bytes(req.body))
        return buf

    def _reply(self, req: Request, result: Reply) -> None:
        if isinstance(result, bytes):  # most replies: one struct, packed
            head = OUT_HEADER_PACK(OUT_HEADER_SIZE + len(result), 0, req.unique)
            self._write([head, result], req)
            return
        parts: Sequence[Payload] = (
            [result] if isinstance(result, bytearray | memoryview) else result
        )
        size = OUT_HEADER_SIZE + sum(len(p) for p in parts)
        self._write([OUT_HEADER_PACK(size, 0, req.unique), *parts], req)

    def _reply_failure(self, req: Request, exc: Exception) -> None:
        """A handler raised: its FuseError's errno (EINTR for an interrupted
        wait), else EIO (and logged)."""
        if isinstance(exc, FuseError | interrupts.Interrupted):
            self._reply_error(req, exc.errno)
            return
        log.error("%s of inode %d failed unexpectedly", _name(req.op), req.nodeid, exc_info=exc)
        self._reply_error(req, errno.EIO)

    def _reply_error(self, req: Request, err: int) -> None:
        if not 0 < err < 512:
            # The kernel refuses any other error value and would leave the
            # caller waiting for a reply that never comes.
            log.error("%s of inode %d: errno %r is no errno", _name(req.op), req.nodeid, err)
            err = errno.EIO
        if req.op not in NO_REPLY:
            self._write([OUT_HEADER_PACK(OUT_HEADER_SIZE, -err, req.unique)], req)

    def _write(self, parts: Sequence[Payload], req: Request) -> None:
        try:
            os.writev(self.fd, parts)
        except OSError as exc:
            # ENOENT: the kernel no longer waits for it (interrupted, or the
            # caller was killed); ENODEV: the mount is gone.
            if exc.errno not in (errno.ENOENT, errno.ENODEV):
                log.error("reply to %s of inode %d failed: %s", _name(req.op), req.nodeid, exc)

    def _init(self, req: Request) -> None:
        major, minor, max_readahead, flags = abi.INIT_IN.unpack_from(req.body)
        if major != abi.KERNEL_MAJOR:
            if major > abi.KERNEL_MAJOR:  # the kernel asks again in our major
                self._reply(req, abi.INIT_OUT.pack(abi.KERNEL_MAJOR, 0, *[0] * 11))
            else:
                log.error("the kernel speaks FUSE %d.%d; ckptfs needs 7.x", major, minor)
                self._reply_error(req, errno.EPROTO)
            return
        # What libfuse 3.14 asks for by default (and pyfuse3 with it), so the
        # kernel behaves as it did under pyfuse3: readdirplus only, atomic
        # O_TRUNC, the filesystem clears setuid/setgid on writes. But not
        # ASYNC_DIO: with it an O_DIRECT read or write is sent as background
        # requests and its caller waits for them in state D, deaf to every
        # signal, SIGKILL included, for as long as the store hangs (up to
        # backing_timeout, and Slurm drains a node whose job outlives its
        # kill by UnkillableStepTimeout). Without it the caller's own
        # request gets INTERRUPT like any other (test_interrupts), for
        # about 5-10% of O_DIRECT read throughput from RAM
        # (docs/PERFORMANCE.md). And not AUTO_INVAL_DATA where the kernel
        # drops the cached pages a direct write overwrites (FUSE 7.39, Linux
        # 6.6 on; checked on 6.18): with it a getattr reply whose mtime
        # differs from the kernel's drops every cached page of the inode,
        # and the first stat after a save always does (the kernel keeps the
        # mtime of the create until then), which would drop the pages pushed
        # at the save's close (kernelpages.py). What it guards is covered
        # otherwise there: an open keeps the cache only if it holds the
        # version opened (Filesystem._kernel_may_keep), a direct write drops
        # the pages it overwrites, and a size change still drops them.
        self.direct_writes_drop_pages = minor >= 39
        want = (
            abi.ASYNC_READ
            | abi.PARALLEL_DIROPS
            | abi.HANDLE_KILLPRIV
            | abi.HAS_IOCTL_DIR
            | abi.ATOMIC_O_TRUNC
            | abi.DO_READDIRPLUS
            | abi.MAX_PAGES
        )
        if not self.direct_writes_drop_pages:
            want |= abi.AUTO_INVAL_DATA
        if self.handlers.writeback_cache:
            want |= abi.WRITEBACK_CACHE
        # At most what a read buffer holds: the kernel refuses reads into less.
        max_write = abi.MAX_WRITE if flags & abi.MAX_PAGES else min(32 * PAGE, abi.MAX_WRITE)
        reply = abi.INIT_OUT.pack(
            abi.KERNEL_MAJOR,
            min(minor, abi.KERNEL_MINOR),
            max_readahead,
            (flags & want) | abi.BIG_WRITES,
            0,  # max_background: the kernel's default
            0,  # congestion_threshold: the kernel's default
            max_write,
            1,  # time_gran: nanoseconds
            max_write // PAGE,
            0,
            0,
            0,
            0,
        )
        self._reply(req, reply)


class RequestThread:
    """The reader of /dev/fuse while the loop waits (``ReadMode.THREAD``):
    answers what :meth:`Session.answer_off_loop` can, and gives the loop the
    reading with anything else (then parks until :meth:`resume`)."""

    def __init__(self, session: Session) -> None:
        self.session = session
        self._go = threading.Event()  # set while this thread reads
        self._go.set()
        self._stopping = False
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        # Set by this thread, once, before it hands the reading to the loop
        # for good (Handed.FAILED): the loop then never gives it back.
        self.failed = False
        self._unanswered: Request | None = None  # read here, not yet answered nor handed on
        self._thread = threading.Thread(target=self._main, name="ckptfs-fuse", daemon=True)

    @property
    def wake_fd(self) -> int:
        """Readable once :meth:`stop` was called (the compiled reader polls it)."""
        return self._wake_r

    def start(self) -> None:
        self._thread.start()

    def resume(self) -> None:
        """From the loop, which stopped reading: this thread reads again."""
        self._go.set()

    def park(self) -> None:
        """From the loop, which took the reading while this thread was held
        up in the store: it reads no more until :meth:`resume`."""
        self._go.clear()

    def stop(self) -> None:
        """From any thread: end at the next look (now, if it waits)."""
        self._stopping = True
        self._go.set()
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass  # the pipe is full (it wakes anyway) or closed (it ended)

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)
        if not self._thread.is_alive():
            for fd in (self._wake_r, self._wake_w):
                os.close(fd)

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def _main(self) -> None:
        try:
            self._serve()
        except Exception as exc:  # a bug; without this, nobody would read /dev/fuse
            self._fail(exc)

    def _fail(self, exc: Exception) -> None:
        """Hand the reading to the loop for good; the request this thread
        was answering gets EIO (if it was answered already, the kernel
        drops the second reply), so that its caller is not left waiting."""
        req, self._unanswered = self._unanswered, None
        log.error(
            "the FUSE request thread failed%s: the loop reads every request from now on",
            "" if req is None else f" on {_name(req.op)} of inode {req.nodeid}",
            exc_info=exc,
        )
        if req is not None:
            self.session._reply_error(req, errno.EIO)
        self.failed = True
        self._go.clear()
        self.session.give_to_loop(Handed.FAILED)

    def _serve(self) -> None:
        if self.session.fast_reader is not None:
            self._serve_compiled(self.session.fast_reader)
            return
        session = self.session
        burst = session._burst
        counters = session.counters
        spin = session.spin
        buf = _prefaulted(abi.BUFFER_SIZE)
        poller = select.poll()
        poller.register(session.fd, select.POLLIN)
        poller.register(self._wake_r, select.POLLIN)
        spin_until = 0.0  # read again rather than wait until then (monotonic)
        spinning = False  # the last read found nothing, and no wait followed
        while True:
            if not self._go.is_set():
                self._go.wait()
            if self._stopping:
                return
            try:
                # Read before waiting: a caller's next request is often there.
                n = session._read(buf)
            except _Unmounted:
                self._go.clear()
                session.give_to_loop(Handed.GONE)
                return
            if not n:
                if spin and _now() < spin_until:
                    spinning = True
                    continue
                spinning = False
                counters.thread_waits += 1
                held = burst.remaining() if burst is not None else None
                events = poller.poll(-1 if held is None else math.ceil(held * 1000))
                if not events and burst is not None:
                    burst.let_go_if_over()  # no request for the hold's time
                elif any(fd == self._wake_r for fd, _ in events):
                    _drain(self._wake_r)
                continue
            if spinning:
                counters.spun += 1
                spinning = False
            buf, req = self._serve_one(buf, n)
            if req is not None:
                # The caller was woken by the reply, often onto this CPU (a
                # waker's CPU is where the scheduler tends to put it): let it
                # run before the hold's bookkeeping, and spin only if it did
                # not (then it runs elsewhere, and its next request is read
                # without a wake-up).
                shared = _yield_ran_another()
                session.answered(req)
                if spin and not shared:
                    spin_until = _now() + spin

    def _serve_one(self, buf: bytearray, n: int) -> tuple[bytearray, Request | None]:
        """The request read into ``buf``, answered here or handed to the loop
        with the reading (this thread then parks); the buffer to read into
        next, and the request if it was answered here."""
        session = self.session
        req = self._unanswered = _request(buf, n)
        try:
            answered = session.answer_off_loop(req)
        except ReadingTaken:  # parked; the loop answers req, and reads meanwhile
            self._unanswered = None
            return buf, None
        if answered:
            self._unanswered = None
            return buf, req
        buf = session._hand_on(req, buf)
        self._go.clear()
        self._unanswered = None  # the loop's from here on
        session.give_to_loop(req)
        return buf, None

    def _serve_compiled(self, fast: Any) -> None:
        """As :meth:`_serve`, with the waits and reads (and the IOCTLs and
        ticketed opens they answer themselves) in the compiled reader."""
        session = self.session
        burst = session._burst
        told = session.handlers.compiled_answers
        buf = _prefaulted(abi.BUFFER_SIZE)
        answers = 0  # the compiled reader's, seen so far
        while True:
            if not self._go.is_set():
                self._go.wait()
            if self._stopping:
                return
            held = burst.remaining() if burst is not None else None
            try:
                n = fast.serve(buf, -1 if held is None else math.ceil(held * 1000))
            except OSError as exc:
                try:
                    n = session.read_failed(exc)
                except _Unmounted:
                    self._go.clear()
                    session.give_to_loop(Handed.GONE)
                    return
            done = fast.opens + fast.ioctls + fast.getattrs + fast.lookups
            if done != answers:
                answers = done
                if burst is not None:
                    burst.answered()
                if told is not None:
                    told()
            if n <= 0:
                if n == _fastreader.TIMED_OUT and burst is not None:
                    burst.let_go_if_over()  # no request for the hold's time
                elif n == _fastreader.WOKEN:
                    _drain(self._wake_r)
                continue
            buf, req = self._serve_one(buf, n)
            if req is not None:
                _yield_ran_another()
                session.answered(req)


_now = time.monotonic
_perf = time.perf_counter
YIELDED_TO_ANOTHER = 5e-6  # a sched_yield that took longer ran another task


def _yield_ran_another() -> bool:
    """Yield the CPU; whether another task ran meanwhile (it was runnable
    here: the caller, or anyone who then wants this CPU more than a spin)."""
    start = _perf()
    os.sched_yield()
    return _perf() - start > YIELDED_TO_ANOTHER


def _drain(fd: int) -> None:
    try:
        while os.read(fd, 512):
            pass
    except OSError:
        pass


def _request(buf: bytearray, n: int) -> Request:
    _, op, unique, nodeid, uid, gid, pid, _, _ = IN_HEADER_UNPACK(buf)
    return Request(op, unique, nodeid, uid, gid, pid, memoryview(buf)[IN_HEADER_SIZE:n])


def _prefaulted(size: int) -> bytearray:
    """A read buffer whose pages are already ours (first touch is slow here)."""
    buf = bytearray(size)
    buf[::PAGE] = bytes(len(range(0, size, PAGE)))
    return buf


def _name(op: int) -> str:
    try:
        return Op(op).name
    except ValueError:
        return f"opcode {op}"


def notify_store(fd: int, nodeid: int, offset: int, data: bytes) -> bool:
    """Put ``data`` into the kernel's page cache of ``nodeid`` at ``offset``
    (FUSE_NOTIFY_STORE) through ``fd``, a descriptor of the connection;
    whether it took them. Blocking: the kernel waits for each page's lock,
    held by a READ of it in flight, so never call it from a thread that
    answers requests (kernelpages.py)."""
    size = OUT_HEADER_SIZE + abi.NOTIFY_STORE_OUT.size + len(data)
    head = OUT_HEADER_PACK(size, abi.NOTIFY_STORE, 0)
    where = abi.NOTIFY_STORE_OUT.pack(nodeid, offset, len(data), 0)
    try:
        os.writev(fd, [head, where, data])
    except OSError as exc:
        # ENOENT: the kernel forgot the inode; ENODEV: the mount is gone.
        if exc.errno not in (errno.ENOENT, errno.ENODEV):
            log.warning("pages of inode %d not put in the page cache: %s", nodeid, exc)
        return False
    return True


def describe(session: Session | None) -> dict[str, Any]:
    if session is None:
        return {}
    c = session.counters
    fast = session.fast_reader
    opens, ioctls, getattrs, lookups = (
        (fast.opens, fast.ioctls, fast.getattrs, fast.lookups) if fast is not None else (0, 0, 0, 0)
    )
    compiled = opens + getattrs + lookups
    return {
        "requests": {
            "fast": c.fast + c.thread + compiled,
            "thread": c.thread + compiled,
            # By the compiled reader (fs/_fastreader.c): counted in fast and
            # thread (opens, getattrs, lookups) and in stateless (the IOCTLs).
            "compiled_opens": opens,
            "compiled_getattrs": getattrs,
            "compiled_lookups": lookups,
            "compiled_ioctls": ioctls,
            "compiled_checks": fast.checks if fast is not None else 0,
            "compiled_write_errors": fast.write_errors if fast is not None else 0,
            "checked": c.checked,
            "handled": c.handled,
            "declined": c.declined,
            "stateless": c.stateless + c.thread_stateless + ioctls,
            "spun": c.spun,
            "taken": c.taken,
            "thread_failures": c.thread_failures,
            "interrupts": c.interrupts,
            "signals_ignored": c.signals_ignored,
        },
        "workers": c.workers,
        "read_by": session.mode.value,
        "reader": "compiled" if fast is not None else "python",
    }
