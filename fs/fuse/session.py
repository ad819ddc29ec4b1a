"""ckptfs's FUSE session: the kernel's requests, read from /dev/fuse and
answered on the trio loop.

Why not pyfuse3's loop: there every request, however small, runs through
two task steps and a lock handed between its reader tasks, and pyfuse3
cannot set FOPEN_NOFLUSH nor take a WRITE's bytes without a copy.

- Worker tasks take turns reading, one at a time (the read lock). The reader
  reads before it waits, so a burst costs no wake-up of the loop per request.
- INTERRUPT (no reply) marks the request it names, if a handler still has it
  and its caller was sent a stop signal: the waits that may end early then
  end (interrupts.py).
- An operation with a *fast path* (``Handlers.fast``: a read-only open of a
  file the cache can serve, a READ of bytes in RAM, a release that drops
  nothing, a getattr that needs no store access, FORGET) is answered by the
  reader inline, with no task. A fast path is synchronous, and declines
  (returns None) before it changes anything when the answer needs an await.
- Any other request is run by the worker that read it, after it hands the
  reading to the next worker (one is started if none waits, up to
  ``workers``). So each request's handler starts (runs up to its first
  await) before the next request is read, as pyfuse3 did. The kernel does
  not promise that a writer's RELEASE, a background request, comes before a
  later request of the same caller; nothing here relies on it. With every
  worker busy, reading stops and the kernel holds the rest.
- A WRITE's body stays in the buffer it was read into (one of ``BUFFERS``,
  pre-faulted), handed to its handler: its bytes are copied once, into the
  cache.
"""

from __future__ import annotations

import errno
import logging
import os
import queue
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import trio
from ckptfs.fs import interrupts
from ckptfs.fs.fuse import abi as abi
from ckptfs.fs.fuse.abi import Op

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
# Bound once: every request goes through them.
IN_HEADER_UNPACK = abi.IN_HEADER.unpack_from
IN_HEADER_SIZE = abi.IN_HEADER.size
OUT_HEADER_PACK = abi.OUT_HEADER.pack
OUT_HEADER_SIZE = abi.OUT_HEADER.size


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
    writeback_cache: bool = False


@dataclass
class Counters:
    fast: int = 0  # answered by a fast path, inline
    declined: int = 0  # had a fast path that declined: handled by a worker
    handled: int = 0  # handled by a worker (the async handler)
    stateless: int = 0  # INIT, IOCTL, unknown opcodes
    interrupts: int = 0  # INTERRUPTs for a stop signal, of a request a handler still had
    signals_ignored: int = 0  # INTERRUPTs for another signal (see interrupts.py)
    workers: int = 0  # worker tasks started so far


class Session:
    """One mount's FUSE connection: ``fd`` is its /dev/fuse descriptor."""

    def __init__(
        self, fd: int, handlers: Handlers, *, workers: int, buffers: int = BUFFERS
    ) -> None:
        os.set_blocking(fd, False)  # the reader waits in the loop, not in read(2)
        self.fd = fd
        self.handlers = handlers
        # Plain int keys: a request's opcode is an int, and an IntEnum key
        # makes each lookup compare through the enum.
        self._fast = {int(op): fn for op, fn in handlers.fast.items()}
        self._slow = frozenset(int(op) for op in handlers.slow)
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
        # Set at INIT: the kernel drops cached pages a direct write overwrites,
        # so pages may be pushed (kernelpages.py) and AUTO_INVAL_DATA is off.
        self.direct_writes_drop_pages = False

    # ----- the session's life ------------------------------------------------------------
    async def run(self) -> None:
        """Serve until the mount goes away or :meth:`terminate`; returns once
        every request being handled has been answered."""
        self._token = trio.lowlevel.current_trio_token()
        try:
            async with trio.open_nursery() as workers:
                self._workers = workers
                if not self._stopping:
                    self._add_worker()
        finally:
            self._workers = None

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
        """Stop reading and cancel the handlers still running: :meth:`run`
        returns at once. Their callers get no reply here; the kernel fails
        their requests when the connection closes."""
        self._stop_reading()
        if self._workers is not None:
            self._workers.cancel_scope.cancel()

    def _stop_reading(self) -> None:
        self._stopping = True
        for scope in self._reading:
            scope.cancel()

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
        is gone. Only the holder of the read lock reads, into ``_read_buf``."""
        served = 0
        while not self._stopping:
            try:
                n = self._read(self._read_buf)
            except _Unmounted:
                return None
            if not n:
                await trio.lowlevel.wait_readable(self.fd)
                continue
            req = _request(self._read_buf, n)
            if not self._answer_inline(req):
                self._read_buf = self._hand_on(req, self._read_buf)
                return req
            served += 1
            if served % YIELD_EVERY == 0:
                await trio.lowlevel.checkpoint()  # the other tasks' turn
        return None

    def _answer_inline(self, req: Request) -> bool:
        """Whether ``req`` was answered without a worker: INIT, INTERRUPT,
        stateless, fast."""
        # The order of the tests is the order of how often they are true: this
        # runs for every request, on the caller's clock.
        op = req.op
        fast = self._fast.get(op)
        if fast is not None:
            if not self._run_fast(fast, req):
                return False
            self.counters.fast += 1
        elif op in self._slow:
            return False
        elif op == Op.INTERRUPT:
            self._interrupt(req)
        else:
            self.counters.stateless += 1
            if op == Op.INIT:
                self._init(req)
            else:
                self._stateless(req)
        return True

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

    def _run_fast(self, fast: FastHandler, req: Request) -> bool:
        """Whether ``fast`` answered ``req`` (replied, or failed with an errno)."""
        try:
            result = fast(req)
        except Exception as exc:
            self._reply_failure(req, exc)
            return True
        if result is None:
            self.counters.declined += 1
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
    return {
        "requests": {
            "fast": c.fast,
            "handled": c.handled,
            "declined": c.declined,
            "stateless": c.stateless,
            "interrupts": c.interrupts,
            "signals_ignored": c.signals_ignored,
        },
        "workers": c.workers,
    }
