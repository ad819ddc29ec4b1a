"""Randomized fault trials on a cluster of real daemons (docs/FAULT-TRIALS.md).

    python tests/cluster/fault_trials.py --trials N --seed S [--nodes 4] [--trial K] [--kinds a,b]

One cluster runs all trials. A trial: a directory of its own; the workload
(tests/cluster/faults/workload.py) for a few seconds; one fault, chosen at random,
injected at a random moment and healed; then every daemon up again, every
node's ``flush --wait``, and the oracle's final check (tests/cluster/faults/oracle.py)
of what the store holds, and ``ckptfs check``. Trial K of seed S always
draws the same fault, the same timings and the same data (``--seed S
--trial K`` replays it; what the machine's scheduler does is not replayed).
A failure prints the seed, the trial and its event log.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ckptfs.fs.store.manifest import ManifestError, is_tmp_name, read_manifest

from .cluster import Cluster, ClusterError
from .netns import Network, remove_stale
from .oracle import Observed, Oracle, digest
from .workload import OP_BOUND, EventLog, Workload

# Fault kinds and their weights.
KINDS: dict[str, int] = {
    "none": 2,
    "kill_keep": 3,  # kill -9 of a daemon; its cache (tmpfs) kept
    "kill_lost": 3,  # kill -9 of a daemon and its RAM lost (cache removed)
    "pair_lost": 2,  # a node and its buddy killed, both RAM lost
    "stop": 3,  # SIGSTOP, then SIGCONT
    "isolate": 2,  # a node cut from every other, both ways
    "oneway": 3,  # a node's link to its buddy cut one way
    "split": 2,  # the cluster cut in two halves
    "loss": 1,  # a node loses a share of the packets it sends
    "delay": 1,  # a node's packets delayed (tc netem)
    "store_stall": 2,  # every store request waits
    "store_full": 2,  # the store refuses space (ENOSPC)
    "store_eio": 2,  # the store's file contents fail (EIO)
    "takeover_restart": 2,  # a daemon restarted while its buddy takes its files over
    # kill -9 (cache kept), restarted while the store fails opens of the
    # users' files (manifests): its recovery cannot read them
    "restart_store_eio": 2,
}
SETTLE_TIMEOUT = 60.0  # every node alive again, every flush --wait done
STORE_STALL_MAX = 6.0


@dataclass
class Plan:
    kind: str
    node: str
    at: float  # seconds into the workload
    hold: float  # how long the fault lasts (seconds)
    detail: dict[str, object] = field(default_factory=dict)

    def describe(self) -> str:
        extra = " ".join(f"{k}={v}" for k, v in self.detail.items())
        return f"{self.kind} on {self.node} at {self.at:.2f}s for {self.hold:.2f}s {extra}".strip()


@dataclass
class Result:
    trial: int
    plan: Plan
    failures: list[str]
    log: list[str]
    seconds: float
    ops: dict[str, int]
    errors: int
    reads: int
    notes: list[str] = field(default_factory=list)


def buddy_of(names: list[str], node: str) -> str:
    """The default ring: each node's buddy is the next one listed."""
    return names[(names.index(node) + 1) % len(names)]


def plan_trial(seed: int, trial: int, names: list[str], kinds: list[str], work: float) -> Plan:
    rng = random.Random(f"{seed}:{trial}:plan")
    kind = rng.choices(kinds, weights=[KINDS[k] for k in kinds])[0]
    node = rng.choice(names)
    at = rng.uniform(0.15, 0.6) * work
    hold = rng.uniform(0.5, 4.0)
    detail: dict[str, object] = {}
    if kind in ("kill_keep", "kill_lost", "pair_lost"):
        hold = rng.choice([0.0, rng.uniform(0.0, 4.0)])  # until the restart
    elif kind == "oneway":
        detail["direction"] = rng.choice(["to-buddy", "from-buddy"])
    elif kind == "split":
        side = rng.sample(names, max(1, len(names) // 2))
        detail["side"] = ",".join(sorted(side))
    elif kind == "loss":
        detail["percent"] = rng.choice([5, 20, 50])
    elif kind == "delay":
        detail["ms"] = rng.choice([20, 100, 400])
    elif kind == "store_stall":
        hold = rng.uniform(2.0, STORE_STALL_MAX)
    elif kind == "takeover_restart":
        detail["restart"] = rng.choice(["writer", "buddy-too"])
    return Plan(kind, node, at, hold, detail)


class Injector:
    """Carries out one plan on the cluster, in a thread of its own, and
    leaves every daemon running and every link and the store whole."""

    def __init__(self, cluster: Cluster, oracle: Oracle, log: EventLog, plan: Plan) -> None:
        self.cluster, self.oracle, self.log, self.plan = cluster, oracle, log, plan
        self.error: str | None = None
        self.done = threading.Event()

    def run(self, start: float) -> None:
        try:
            time.sleep(max(0.0, start + self.plan.at - time.monotonic()))
            self.log.add(f"FAULT {self.plan.describe()}")
            getattr(self, f"_{self.plan.kind}")()
            self.log.add(f"HEALED {self.plan.kind}")
        except Exception as exc:  # noqa: BLE001 - reported as the trial's failure
            self.error = f"the fault {self.plan.kind} could not be carried out: {exc!r}"
            self.log.add(self.error + "\n" + traceback.format_exc())
        finally:
            self.done.set()

    @property
    def buddy(self) -> str:
        return buddy_of(self.cluster.names, self.plan.node)

    def _none(self) -> None:
        pass

    def _kill(self, nodes: list[str], lose_ram: bool) -> None:
        for n in nodes:
            self.cluster.kill(n, lose_ram)
            if lose_ram:
                self.oracle.note_ram_lost(n)
            self.log.add(f"killed {n}" + (" and removed its cache" if lose_ram else ""))
        time.sleep(self.plan.hold)
        self._restart(nodes)

    def _restart(self, nodes: list[str]) -> None:
        for n in nodes:
            t0 = time.monotonic()
            self.cluster.restart(n)
            self.log.add(f"restarted {n} in {time.monotonic() - t0:.2f}s")

    def _kill_keep(self) -> None:
        self._kill([self.plan.node], lose_ram=False)

    def _kill_lost(self) -> None:
        self._kill([self.plan.node], lose_ram=True)

    def _pair_lost(self) -> None:
        self._kill([self.plan.node, self.buddy], lose_ram=True)

    def _stop(self) -> None:
        self.cluster.stop(self.plan.node)
        try:
            time.sleep(self.plan.hold)
        finally:
            self.cluster.cont(self.plan.node)

    def _hold_net(self, cut: Callable[[Network], None]) -> None:
        try:
            cut(self.cluster.net)
            time.sleep(self.plan.hold)
        finally:
            self.cluster.net.heal()

    def _isolate(self) -> None:
        self._hold_net(lambda net: net.isolate(self.plan.node))

    def _oneway(self) -> None:
        a, b = self.plan.node, self.buddy
        if self.plan.detail["direction"] == "from-buddy":
            a, b = b, a
        self._hold_net(lambda net: net.cut(a, b))

    def _split(self) -> None:
        side = str(self.plan.detail["side"]).split(",")
        self._hold_net(lambda net: net.split(side))

    def _loss(self) -> None:
        self._hold_net(lambda net: net.lose(self.plan.node, int(self.plan.detail["percent"])))

    def _delay(self) -> None:
        ms = int(self.plan.detail["ms"])
        self._hold_net(lambda net: net.delay(self.plan.node, ms, ms // 4))

    def _store(self, mode: str) -> None:
        assert self.cluster.store is not None
        try:
            self.cluster.store.inject(mode)
            time.sleep(self.plan.hold)
        finally:
            self.cluster.store.inject("ok")

    def _store_stall(self) -> None:
        self._store("stall")

    def _store_full(self) -> None:
        self._store("enospc")

    def _store_eio(self) -> None:
        self._store("eio")

    def _restart_store_eio(self) -> None:
        node = self.plan.node
        assert self.cluster.store is not None
        self.cluster.kill(node, lose_ram=False)
        self.log.add(f"killed {node}")
        try:
            self.cluster.store.inject("eio-files")
            self._restart([node])
            time.sleep(self.plan.hold)
        finally:
            self.cluster.store.inject("ok")

    def _takeover_restart(self) -> None:
        """kill -9 of the node; once its buddy says it takes the node's files
        over, the node comes back (and with ``buddy-too`` the buddy is killed
        and restarted first, mid-takeover)."""
        node, buddy = self.plan.node, self.buddy
        self.cluster.mark_logs()
        self.cluster.kill(node, lose_ram=False)
        self.log.add(f"killed {node}")
        deadline = time.monotonic() + self.cluster.peer_timeout + 8
        seen = False
        while time.monotonic() < deadline and not seen:
            seen = "taking over" in self.cluster.log_since_mark(buddy)
            time.sleep(0.02)
        self.log.add(f"{buddy} {'is taking over' if seen else 'took nothing over'}")
        if self.plan.detail["restart"] == "buddy-too":
            self.cluster.kill(buddy, lose_ram=False)
            self.log.add(f"killed {buddy}")
            self._restart([buddy])
        self._restart([node])


class Trials:
    """One cluster and the trials run on it."""

    def __init__(self, args: argparse.Namespace, out: Callable[[str], None] | None = None) -> None:
        self.args = args
        self.out = out or (lambda line: print(line, flush=True))
        self.observed: dict[str, Observed] = {}
        self.names = [f"n{i + 1}" for i in range(args.nodes)]
        self.kinds = [k for k in (args.kinds or list(KINDS))]
        self.results: list[Result] = []

    def node_env(self) -> dict[str, dict[str, str]]:
        """Chunks of 256 KiB; n1's flush capped, so that its files stay
        pending for a while and faults meet them there."""
        env = {n: {"CKPTFS_CHUNK_SIZE": "256KiB"} for n in self.names}
        env[self.names[0]]["CKPTFS_FLUSH_BANDWIDTH"] = "2MiB"
        return env

    def usable_kinds(self, net: Network) -> list[str]:
        caps = net.caps
        assert caps is not None
        for note in caps.notes():
            self.out(f"note: {note}")
        kinds = list(self.kinds)
        if not caps.netem:
            kinds = [k for k in kinds if k != "delay"]
        if not caps.netem and not caps.iptables:
            kinds = [k for k in kinds if k != "loss"]
        if not kinds:
            raise SystemExit("fault_trials: no fault kind left to run here")
        return kinds

    def run(self) -> int:
        remove_stale()
        work = Path(self.args.workdir or tempfile.mkdtemp(prefix="ckptfs-faults-", dir="/var/tmp"))
        numbers = [self.args.trial] if self.args.trial is not None else range(self.args.trials)
        started = time.monotonic()
        try:
            with Cluster(work, self.names, self.node_env()) as cluster:
                kinds = self.usable_kinds(cluster.net)
                self.out(f"cluster of {len(self.names)} up in {time.monotonic() - started:.1f}s "
                         f"(workdir {work}); kinds: {', '.join(kinds)}")  # fmt: skip
                for k in numbers:
                    plan = plan_trial(self.args.seed, k, self.names, kinds, self.args.work)
                    result = self.trial(cluster, k, plan)
                    self.results.append(result)
                    self.report(result)
                    if result.failures and not self.args.keep_going:
                        break
        finally:
            if not self.args.keep and not any(r.failures for r in self.results):
                shutil.rmtree(work, ignore_errors=True)
        return self.summary(time.monotonic() - started)

    # ----- one trial -----------------------------------------------------------------
    def trial(self, cluster: Cluster, k: int, plan: Plan) -> Result:
        t0 = time.monotonic()
        log = EventLog()
        oracle = Oracle()
        top = f"t{k:05d}"
        cluster.mark_logs()
        log.add(f"trial {k} of seed {self.args.seed}: {plan.describe()}")
        failures: list[str] = []
        notes: list[str] = []
        wl = Workload(cluster, oracle, log, top, f"{self.args.seed}:{k}", 0.0)
        try:
            self.make_top(cluster, top)
            start = time.monotonic()
            wl.until = start + self.args.work
            injector = Injector(cluster, oracle, log, plan)
            threads = [threading.Thread(target=injector.run, args=(start,), daemon=True)]
            threads += [
                threading.Thread(target=fn, args=args, name=name, daemon=True)
                for name, fn, args in wl.actors()
            ]
            for t in threads:
                t.start()
            failures += self.join(threads, wl, injector, log)
            if injector.error:
                failures.append(injector.error)
            if not failures:
                failures += self.settle(cluster, log)
            if not failures:
                failures += self.final_check(cluster, oracle, top, log)
                failures += self.check_agrees(cluster, oracle, top, log)
            failures += self.daemon_trouble(cluster)
            failures = oracle.failures + [f for f in failures if f not in oracle.failures]
        except ClusterError as exc:
            failures.append(f"cluster: {exc}")
        if failures:
            for path in oracle.paths():
                log.add(f"history of {path}: " + "; ".join(oracle.history(path)))
            for n in cluster.names:
                lines = [ln for ln in cluster.log_since_mark(n).splitlines()
                         if " WARNING " in ln or " ERROR " in ln or "Traceback" in ln]  # fmt: skip
                log.lines += [f"  {n} log: {ln}" for ln in lines[-60:]]
        else:
            self.remove_top(cluster, top, log, notes)
        return Result(k, plan, failures, log.lines, time.monotonic() - t0, dict(wl.counts),
                      len(wl.errors), oracle.reads, notes)  # fmt: skip

    def make_top(self, cluster: Cluster, top: str) -> None:
        os.mkdir(cluster.nodes[self.names[0]].mnt / top)

    def join(
        self, threads: list[threading.Thread], wl: Workload, injector: Injector, log: EventLog
    ) -> list[str]:
        """Wait for the actors and the injector; a bounded wait, then hangs are failures."""
        deadline = time.monotonic() + self.args.work + OP_BOUND + 60
        while time.monotonic() < deadline and any(t.is_alive() for t in threads):
            overdue = wl.overdue()
            if overdue:
                return overdue
            for t in threads:
                t.join(0.1)
        alive = [t.name for t in threads if t.is_alive()]
        hangs = [e for e in wl.errors if e.startswith("HANG")]
        if alive:
            hangs.append(f"HANG: {', '.join(alive)} still running after every bound")
        return hangs

    def settle(self, cluster: Cluster, log: EventLog) -> list[str]:
        """Faults healed: every node alive for every other, then ``flush --wait``
        on every node (at once)."""
        t0 = time.monotonic()
        try:
            cluster.wait_alive(SETTLE_TIMEOUT)
        except ClusterError as exc:
            return [f"NOT HEALED: {exc}"]
        replies: dict[str, dict[str, object]] = {}

        def flush(n: str) -> None:
            order = {"op": "flush", "path": "", "wait": True, "timeout": SETTLE_TIMEOUT}
            replies[n] = cluster.ask(n, order, timeout=SETTLE_TIMEOUT + 30)

        threads = [threading.Thread(target=flush, args=(n,), daemon=True) for n in self.names]
        for t in threads:
            t.start()
        for t in threads:
            t.join(SETTLE_TIMEOUT + 40)
        log.add(f"settled in {time.monotonic() - t0:.2f}s: " +
                "; ".join(f"{n} {replies.get(n)}" for n in self.names))  # fmt: skip
        failures = []
        for n in self.names:
            reply = replies.get(n)
            if reply is None:
                failures.append(f"HANG: flush --wait on {n} did not return")
            elif not reply.get("ok") and "not_durable" not in reply:
                failures.append(f"flush --wait on {n} failed: {reply.get('error')}")
            elif not reply.get("ok"):
                log.add(f"flush --wait on {n}: not durable: {reply.get('not_durable')}")
        return failures

    def observe(self, cluster: Cluster, top: str) -> dict[str, Observed]:
        """Every file under the trial's directory in the store, and its bytes
        as a node reads them (a different node for each, in turn)."""
        assert cluster.store is not None
        real = cluster.store.real
        seen: dict[str, Observed] = {}
        i = 0
        for dirpath, dirnames, filenames in os.walk(real / top):
            dirnames.sort()
            for name in sorted(filenames):
                if is_tmp_name(name):
                    continue
                rel = str((Path(dirpath) / name).relative_to(real))
                try:
                    m = read_manifest(real / rel)
                except (OSError, ManifestError):
                    m = None
                state = "plain" if m is None else m.state
                holders = tuple(m.holders) if m is not None else ()
                size = m.size if m is not None else 0
                node = self.names[i % len(self.names)]
                i += 1
                try:
                    data = (cluster.nodes[node].mnt / rel).read_bytes()
                    seen[rel] = Observed(rel, state, digest(data), "", holders, size)
                except OSError as exc:
                    seen[rel] = Observed(rel, state, None, f"read on {node}: {exc}", holders, size)
        return seen

    def final_check(self, cluster: Cluster, oracle: Oracle, top: str, log: EventLog) -> list[str]:
        seen = self.observe(cluster, top)
        self.observed = seen
        for rel, o in sorted(seen.items()):
            log.add(f"store: {rel} {o.state} {o.digest and o.digest[:12]} {o.error}")
        return oracle.verify(seen)

    def check_agrees(self, cluster: Cluster, oracle: Oracle, top: str, log: EventLog) -> list[str]:
        """``ckptfs check`` of the trial's directory names exactly the files
        the final check found lost, and nothing else."""
        node = self.names[-1]
        code, out = cluster.check(node, top)
        log.add(f"ckptfs check: exit {code}: {out.strip().splitlines()[-1] if out.strip() else ''}")
        # A pending file that no running daemon holds: check calls it lost.
        # An empty one (a writer killed between its create and its close)
        # reads empty: nothing to lose, and check says so.
        lost = {r for r, o in self.observed.items() if o.state == "pending" and o.size}
        lost |= {r for r, o in self.observed.items() if o.state == "pending" and o.digest is None}
        flagged = [line for line in out.splitlines() if line.startswith("ckptfs: error:")]
        if code == -1:
            return [f"HANG: ckptfs check: {out}"]
        named = {r for r in lost if any(f"/{r}: " in line for line in flagged)}
        stray = [line for line in flagged if not any(f"/{r}: " in line for r in lost)]
        if lost - named or stray or (code == 0) != (not named):
            return [f"CHECK DISAGREES: lost {sorted(lost)}, ckptfs check exit {code}:\n{out}"]
        return []

    def daemon_trouble(self, cluster: Cluster) -> list[str]:
        """A traceback in a daemon's log is a bug, whatever the fault."""
        found = []
        for n in self.names:
            text = cluster.log_since_mark(n)
            if "Traceback" in text:
                lines = text.splitlines()
                at = next(i for i, ln in enumerate(lines) if "Traceback" in ln)
                found.append(
                    f"TRACEBACK in {n}'s log:\n" + "\n".join(lines[max(0, at - 3) : at + 30])
                )
        return found

    def remove_top(self, cluster: Cluster, top: str, log: EventLog, notes: list[str]) -> None:
        """The trial's files go, so that the store stays small."""
        done = threading.Event()

        def rm() -> None:
            try:
                shutil.rmtree(cluster.nodes[self.names[0]].mnt / top)
            except OSError as exc:
                notes.append(f"could not remove {top}: {exc}")
            done.set()

        threading.Thread(target=rm, daemon=True).start()
        if not done.wait(OP_BOUND):
            notes.append(f"removing {top} took over {OP_BOUND:g}s")

    # ----- output ---------------------------------------------------------------------
    def report(self, r: Result) -> None:
        status = "FAIL" if r.failures else "ok"
        ops = " ".join(f"{k}={v}" for k, v in sorted(r.ops.items()))
        self.out(f"trial {r.trial:5d} {status:4s} {r.seconds:5.1f}s {r.plan.describe()} | "
                 f"{ops} errors={r.errors} reads={r.reads}")  # fmt: skip
        for note in r.notes:
            self.out(f"  note: {note}")
        if r.failures:
            self.out(f"\nFAILED: seed {self.args.seed} trial {r.trial} "
                     f"(replay: python tests/cluster/fault_trials.py --seed {self.args.seed} "
                     f"--trial {r.trial} --nodes {self.args.nodes})")  # fmt: skip
            for f in r.failures:
                self.out(f"  {f}")
            self.out("event log:")
            for line in r.log:
                self.out(f"  {line}")

    def summary(self, seconds: float) -> int:
        failed = [r for r in self.results if r.failures]
        kinds: dict[str, int] = {}
        for r in self.results:
            kinds[r.plan.kind] = kinds.get(r.plan.kind, 0) + 1
        rate = len(self.results) / seconds * 60 if seconds else 0
        self.out(f"\n{len(self.results)} trial(s), {len(failed)} failed, in {seconds:.0f}s "
                 f"({rate:.1f} per minute); by kind: "
                 + ", ".join(f"{k} {v}" for k, v in sorted(kinds.items())))  # fmt: skip
        if failed:
            self.out(
                "failed: " + ", ".join(f"seed {self.args.seed} trial {r.trial}" for r in failed)
            )
        return 1 if failed else 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="fault_trials", description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--trial", type=int, help="run only trial K of the seed (a replay)")
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--work", type=float, default=3.0, help="seconds of workload per trial")
    parser.add_argument("--kinds", type=lambda s: s.split(","), help="only these fault kinds")
    parser.add_argument("--workdir", help="default: a new directory under /var/tmp")
    parser.add_argument("--keep", action="store_true", help="keep the workdir (and the store)")
    parser.add_argument("--keep-going", action="store_true", help="go on after a failure")
    args = parser.parse_args(argv)
    if args.nodes < 3:
        parser.error("--nodes must be at least 3 (a writer, its buddy and a reader)")
    for kind in args.kinds or []:
        if kind not in KINDS:
            parser.error(f"unknown fault kind {kind!r}; known: {', '.join(KINDS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    if os.geteuid() != 0:
        print("fault_trials: needs root (network namespaces, FUSE mounts)", file=sys.stderr)
        return 2

    def interrupted(signum: int, frame: object) -> None:
        # Once: a second signal must not cut the cleanup short.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise KeyboardInterrupt  # so that everything started is cleaned up

    signal.signal(signal.SIGINT, interrupted)
    signal.signal(signal.SIGTERM, interrupted)
    return Trials(parse_args(argv)).run()
