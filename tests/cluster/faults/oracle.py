"""What the fault trials check: every read, and the store once faults heal.

The workload tells the oracle about every operation that changes a path,
before it starts (:meth:`Oracle.begin`) and when it ends (:meth:`Oracle.end`),
and about every read it makes (:meth:`Oracle.check_read`). Contents are
known by their SHA-256 only.

The rules (docs/FAULT-TRIALS.md):

1. A read returns a whole version of that path: one that a write, a replace
   or a rename put (or may have put) there, or the empty file while an
   in-place write truncated it. Never anything else. Errors are not wrong
   bytes: they are allowed while faults last.
2. Once faults heal and every node's ``flush --wait`` returned, every file
   in the store is durable and holds a version of its path; a path whose
   last operation succeeded after every other one on it had ended holds
   exactly what that operation put there (the newest version), or nothing
   if it removed the path.
3. A file may be lost (EIO, or a manifest left pending) only if every node
   its manifest named as a holder when it was closed lost its RAM after
   that, or an operation on that path failed (a writer killed mid-write:
   what it was writing over is gone, as on any filesystem).
4. No file is in the store that no operation made.
"""

from __future__ import annotations

import hashlib
import itertools
import threading
import time
from dataclasses import dataclass, field

EMPTY = hashlib.sha256(b"").hexdigest()
UNKNOWN = "?"  # an effect the oracle cannot tell (a rename of a path it could not tell)
ABSENT = None


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def short(h: str | None) -> str:
    return "absent" if h is None else h[:12]


@dataclass
class Op:
    """One operation on one path: what the path holds after it, if it succeeds."""

    id: int
    kind: str  # write | replace | rename | unlink
    path: str
    node: str
    effect: str | None  # a digest, ABSENT or UNKNOWN
    t0: float
    t1: float | None = None
    ok: bool | None = None  # None while it runs
    error: str = ""
    holders: tuple[str, ...] = ()  # of the version it put there, at its close
    # For a rename: when the version it moved was closed (a holder's RAM lost
    # after that may lose it), and whether the source could be lost anyway.
    closed_at: float | None = None
    lossy: bool = False

    def describe(self) -> str:
        outcome = "running" if self.ok is None else ("ok" if self.ok else f"failed {self.error}")
        return (
            f"#{self.id} {self.kind} {self.path} on {self.node} -> {short(self.effect)} {outcome}"
        )


@dataclass
class Observed:
    """A path as the final check found it."""

    path: str
    state: str  # durable | pending | plain | absent
    digest: str | None = None  # of the bytes read through a mount; None if the read failed
    error: str = ""  # the read's error
    holders: tuple[str, ...] = ()
    size: int = 0  # the manifest's


@dataclass
class Oracle:
    clock: object = time.monotonic
    allowed: dict[str, set[str]] = field(default_factory=dict)
    ops: dict[str, list[Op]] = field(default_factory=dict)
    ram_lost: list[tuple[str, float]] = field(default_factory=list)
    inplace_nodes: dict[str, set[str]] = field(default_factory=dict)
    contents: dict[str, bytes] = field(default_factory=dict)  # digest -> bytes, to explain
    failures: list[str] = field(default_factory=list)
    reads: int = 0
    _ids: itertools.count = field(default_factory=lambda: itertools.count(1))
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def now(self) -> float:
        return self.clock()  # type: ignore[operator]

    # ----- what the workload does --------------------------------------------------
    def begin(
        self,
        kind: str,
        path: str,
        node: str,
        effect: str | None,
        holders: tuple[str, ...] = (),
        data: bytes | None = None,
    ) -> Op:
        """Before an operation starts: its content becomes readable at ``path``
        (a close publishes before it returns, so a read may see it first).
        ``data``, the content, is kept to explain a wrong read."""
        with self._lock:
            if data is not None and effect not in (ABSENT, UNKNOWN):
                self.contents[effect] = data
            op = Op(next(self._ids), kind, path, node, effect, self.now(), holders=holders)
            self.ops.setdefault(path, []).append(op)
            allowed = self.allowed.setdefault(path, set())
            if kind == "write":
                # An in-place write truncates first: readers may see it empty.
                allowed.add(EMPTY)
                self.inplace_nodes.setdefault(path, set()).add(node)
            if effect not in (ABSENT, UNKNOWN):
                allowed.add(effect)
            return op

    def end(
        self, op: Op, ok: bool, error: str = "", holders: tuple[str, ...] | None = None
    ) -> None:
        with self._lock:
            op.t1, op.ok, op.error = self.now(), ok, error
            if holders is not None:
                op.holders = holders

    def rename(self, old: str, new: str, node: str, kind: str = "rename") -> tuple[Op, Op]:
        """A rename of ``old`` to ``new`` begins: ``new`` may show whatever
        ``old`` could, and holds what ``old`` held if that can be told.
        Returns the operations on ``old`` and on ``new``, to :meth:`end` both."""
        source = self.determined(old)
        effect = UNKNOWN if source is None or source.effect is ABSENT else source.effect
        lossy = self.may_be_lost(old)
        with self._lock:
            self.allowed.setdefault(new, set()).update(self.allowed.get(old, set()))
        holders = source.holders if source is not None else ()
        gone = self.begin("rename", old, node, ABSENT)
        moved = self.begin(kind, new, node, effect, holders)
        moved.lossy = lossy or source is None
        if source is not None:
            moved.closed_at = source.closed_at if source.closed_at is not None else source.t1
        return gone, moved

    def note_ram_lost(self, node: str) -> None:
        with self._lock:
            self.ram_lost.append((node, self.now()))

    def check_read(self, path: str, data: bytes, node: str) -> str | None:
        """A read of ``path`` on ``node`` returned ``data``: None, or the
        failure it is (also recorded)."""
        got = digest(data)
        with self._lock:
            self.reads += 1
            allowed = set(self.allowed.get(path, set()))
            if got in allowed:
                return None
            versions = {h: self.contents[h] for h in allowed if h in self.contents}
            others = {h: v for h, v in self.contents.items() if h not in versions}
        failure = (
            f"WRONG BYTES: a read of {path} on {node} returned {len(data)} bytes "
            f"(sha256 {short(got)}) that no version of it had: {explain(data, versions, others)}"
        )
        with self._lock:
            self.failures.append(failure)
        return failure

    def readable_on(self, path: str, node: str) -> bool:
        """Whether a reader on ``node`` can judge ``path`` whole: not while this
        node writes it in place (its own writer's bytes show before the close)."""
        with self._lock:
            return node not in self.inplace_nodes.get(path, set())

    def paths(self) -> list[str]:
        with self._lock:
            return sorted(self.ops)

    # ----- what a path should hold ---------------------------------------------------
    def last_op(self, path: str) -> Op | None:
        ops = self.ops.get(path, [])
        return max(ops, key=lambda o: o.t0) if ops else None

    def determined(self, path: str) -> Op | None:
        """The operation whose effect the path must show, if that can be
        told: the last one, if it succeeded and began after every other one
        on the path had ended."""
        last = self.last_op(path)
        if last is None or last.ok is not True or last.effect == UNKNOWN:
            return None
        for op in self.ops[path]:
            if op is not last and (op.t1 is None or op.t1 > last.t0):
                return None
        return last

    def expected(self, path: str) -> str | None:
        """The digest ``path`` holds now if it can be told, else None."""
        op = self.determined(path)
        return None if op is None or op.effect is None else op.effect

    def may_be_lost(self, path: str) -> bool:
        """Rule 3: whether ``path`` may be lost."""
        ops = self.ops.get(path, [])
        if any(op.ok is False or op.lossy for op in ops):
            return True
        for op in ops:
            if op.ok and op.effect not in (ABSENT, UNKNOWN) and self._holders_lost(op):
                return True
        return False

    def _holders_lost(self, op: Op) -> bool:
        holders = op.holders or (op.node,)
        closed = op.closed_at if op.closed_at is not None else (op.t1 or op.t0)
        return all(any(n == h and t >= closed for n, t in self.ram_lost) for h in holders)

    # ----- the final check --------------------------------------------------------
    def verify(self, observed: dict[str, Observed]) -> list[str]:
        """Rules 2-4 against what the store holds once faults healed; the failures."""
        found: list[str] = []
        for path in sorted(set(observed) | set(self.ops)):
            seen = observed.get(path, Observed(path, "absent"))
            found += self._verify_path(path, seen)
        with self._lock:
            self.failures += found
        return found

    def _verify_path(self, path: str, seen: Observed) -> list[str]:
        if path not in self.ops:
            return [f"UNKNOWN FILE: {path} is in the store ({seen.state}) but nothing wrote it"]
        op = self.determined(path)
        lost_ok = self.may_be_lost(path)
        allowed = self.allowed.get(path, set())
        if seen.state == "absent":
            if op is not None and op.effect is not ABSENT:
                return [f"LOST: {path} is gone, but {op.describe()} was the last operation on it"]
            if op is None and not self._may_be_absent(path):
                return [f"LOST: {path} is gone; every operation on it succeeded"]
            return []
        if op is not None and op.effect is ABSENT:
            return [f"RESURRECTED: {path} is in the store ({seen.state}) after {op.describe()}"]
        if seen.digest is None:
            if lost_ok:
                return []
            return [f"LOST: {path} ({seen.state}, {seen.error}; holders {list(seen.holders)}) "
                    f"though a holder or the store survived"]  # fmt: skip
        if seen.state == "pending" and not lost_ok:
            return [f"NOT DURABLE: {path} is pending (holders {list(seen.holders)}) after the "
                    f"faults healed and every node's flush --wait returned"]  # fmt: skip
        if seen.digest not in allowed:
            return [f"WRONG BYTES: {path} holds sha256 {short(seen.digest)}, no version of it"]
        if op is not None and seen.digest != op.effect:
            return [f"NOT NEWEST: {path} holds {short(seen.digest)}, but {op.describe()}"]
        return []

    def _may_be_absent(self, path: str) -> bool:
        ops = self.ops.get(path, [])
        return any(op.effect in (ABSENT, UNKNOWN) or not op.ok for op in ops)

    def history(self, path: str) -> list[str]:
        return [op.describe() for op in sorted(self.ops.get(path, []), key=lambda o: o.t0)]


def explain(
    data: bytes,
    versions: dict[str, bytes],
    others: dict[str, bytes] | None = None,
    block: int = 4096,
) -> str:
    """Which versions ``data`` has bytes of, block by block: a torn read
    (two versions), a stale size, a prefix, or bytes of no version at all.
    A block of no version is named by a content of another path that has it
    at that offset (``other:DIGEST``: bytes crossed between files), as
    ``zero`` if it is all zero bytes, else ``none``."""
    sizes = ", ".join(f"{short(h)}={len(v)}B" for h, v in sorted(versions.items()))
    runs: list[str] = []
    for off in range(0, len(data), block):
        piece = data[off : off + block]
        owners = [short(h) for h, v in sorted(versions.items()) if v[off : off + block] == piece]
        if not owners:
            owners = [
                f"other:{short(h)}"
                for h, v in sorted((others or {}).items())
                if v[off : off + block] == piece
            ]
        label = "/".join(owners[:3]) if owners else ("zero" if not piece.strip(b"\0") else "none")
        if runs and runs[-1].split("@")[0] == label:
            continue
        runs.append(f"{label}@{off}")
    head = data[:64]
    where = [
        f"{short(h)}+{v.find(head)}" for h, v in sorted(versions.items()) if head and head in v
    ]
    zeros = " (all zero bytes)" if data and not data.strip(b"\0") else ""
    return (
        f"versions {sizes or 'none'}; its blocks from: {' '.join(runs[:20]) or '(empty)'}{zeros}"
        + (f"; its first bytes are at {', '.join(where)}" if where else "")
    )
