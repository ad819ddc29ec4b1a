"""A private network of test hosts: one network namespace per node, joined
by a bridge that lives in a namespace of its own, so nothing here touches
this machine's own interfaces or routes.

    switch namespace:  br0 -- veth{i} ...
    node namespace i:  lo, eth0 = 198.18.0.{i+1}/24 (RFC 2544's benchmarking range)

Links are cut and healed inside the node namespaces:

- a one-way cut A -> B gives A a permanent neighbour entry for B's address
  with a MAC address no port has: A's frames to B are flooded by the bridge
  and dropped by every port (a silent loss, as a dead switch port or a
  firewall gives, not a fast "unreachable"), while B's frames to A still
  arrive; healing deletes the entry and ARP finds B again;
- packet loss uses iptables' ``statistic`` match, or ``tc netem`` where the
  kernel has it; delay needs netem. :func:`capabilities` says which are
  there, and the trials skip, with a printed note, what is not.

Every command has a timeout; :meth:`Network.close` removes everything it
made, whatever state it is in, and :func:`remove_stale` what a killed run
left behind.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from . import spawner

NETNS_DIR = Path("/var/run/netns")
PREFIX = "ckft"
SUBNET = "198.18.0"
BOGUS_MAC = "02:00:5e:00:53:01"  # locally administered; no port has it
COMMAND_TIMEOUT = 20.0


class NetError(RuntimeError):
    pass


def run(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run one command, bounded; a failure names the command and its stderr."""
    try:
        done = spawner.run(argv, timeout=COMMAND_TIMEOUT)
    except subprocess.TimeoutExpired:
        raise NetError(f"{' '.join(argv)}: no answer within {COMMAND_TIMEOUT:g}s") from None
    if check and done.returncode != 0:
        raise NetError(f"{' '.join(argv)}: {done.stderr.strip() or done.returncode}")
    return done


@dataclass(frozen=True)
class Capabilities:
    netem: bool
    iptables: bool

    def notes(self) -> list[str]:
        notes = []
        if not self.netem:
            notes.append("tc netem is not available on this kernel: no delay faults")
        if not self.netem and not self.iptables:
            notes.append("neither tc netem nor iptables is available: no packet-loss faults")
        return notes


def capabilities(probe_ns: str) -> Capabilities:
    """What the kernel and tools here offer, tried in the namespace ``probe_ns``."""
    netem = run("ip", "netns", "exec", probe_ns, "tc", "qdisc", "add", "dev", "lo", "root",
                "netem", "delay", "1ms", check=False).returncode == 0  # fmt: skip
    if netem:
        run("ip", "netns", "exec", probe_ns, "tc", "qdisc", "del", "dev", "lo", "root", check=False)
    iptables = shutil.which("iptables") is not None and (
        run("ip", "netns", "exec", probe_ns, "iptables", "-S", check=False).returncode == 0
    )
    return Capabilities(netem=netem, iptables=iptables)


def remove_stale() -> list[str]:
    """Remove namespaces of earlier runs whose process is gone (their names
    carry its pid); return their names."""
    removed = []
    if not NETNS_DIR.is_dir():
        return removed
    for entry in NETNS_DIR.iterdir():
        name = entry.name
        if not name.startswith(PREFIX):
            continue
        pid = name[len(PREFIX) :].split("-")[0]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            run("ip", "netns", "del", name, check=False)
            removed.append(name)
    return removed


@dataclass
class Network:
    """The namespaces of ``nodes``; :meth:`open` makes them, :meth:`close` removes them."""

    nodes: list[str]
    tag: str = field(default_factory=lambda: str(os.getpid()))
    made: list[str] = field(default_factory=list)
    cuts: set[tuple[str, str]] = field(default_factory=set)
    lossy: dict[str, str] = field(default_factory=dict)  # node -> "iptables" | "netem"
    caps: Capabilities | None = None

    @property
    def switch(self) -> str:
        return f"{PREFIX}{self.tag}-sw"

    def ns(self, node: str) -> str:
        return f"{PREFIX}{self.tag}-{node}"

    def ns_path(self, node: str) -> Path:
        return NETNS_DIR / self.ns(node)

    def ip(self, node: str) -> str:
        return f"{SUBNET}.{self.nodes.index(node) + 1}"

    def open(self) -> None:
        self._add_ns(self.switch)
        run("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
        run("ip", "-n", self.switch, "link", "set", "br0", "up")
        for i, node in enumerate(self.nodes):
            ns = self.ns(node)
            self._add_ns(ns)
            run("ip", "-n", self.switch, "link", "add", f"veth{i}", "type", "veth",
                "peer", "name", "eth0", "netns", ns)  # fmt: skip
            run("ip", "-n", self.switch, "link", "set", f"veth{i}", "master", "br0", "up")
            run("ip", "-n", ns, "addr", "add", f"{self.ip(node)}/24", "dev", "eth0")
            run("ip", "-n", ns, "link", "set", "eth0", "up")
            run("ip", "-n", ns, "link", "set", "lo", "up")
        self.caps = capabilities(self.ns(self.nodes[0]))

    def _add_ns(self, name: str) -> None:
        run("ip", "netns", "del", name, check=False)  # a leftover of the same name
        run("ip", "netns", "add", name)
        self.made.append(name)

    def close(self) -> None:
        """Remove every namespace made (their veths and the bridge go with them)."""
        for name in reversed(self.made):
            run("ip", "netns", "del", name, check=False)
        self.made.clear()
        self.cuts.clear()
        self.lossy.clear()

    def nsenter(self, node: str) -> list[str]:
        """The argv prefix that runs a command in ``node``'s network namespace
        only: mounts it makes stay visible to this process."""
        return ["nsenter", f"--net={self.ns_path(node)}", "--"]

    # ----- cuts --------------------------------------------------------------
    def cut(self, src: str, dst: str) -> None:
        """Drop every frame ``src`` sends to ``dst`` (one way), silently."""
        run("ip", "-n", self.ns(src), "neigh", "replace", self.ip(dst), "lladdr", BOGUS_MAC,
            "nud", "permanent", "dev", "eth0")  # fmt: skip
        self.cuts.add((src, dst))

    def mend(self, src: str, dst: str) -> None:
        run("ip", "-n", self.ns(src), "neigh", "del", self.ip(dst), "dev", "eth0", check=False)
        self.cuts.discard((src, dst))

    def isolate(self, node: str) -> None:
        for other in self.nodes:
            if other != node:
                self.cut(node, other)
                self.cut(other, node)

    def split(self, side: list[str]) -> None:
        """Cut ``side`` from the rest of the nodes, both ways."""
        for a in side:
            for b in self.nodes:
                if b not in side:
                    self.cut(a, b)
                    self.cut(b, a)

    # ----- loss and delay --------------------------------------------------------
    def lose(self, node: str, percent: int) -> None:
        """Drop ``percent`` % of the packets ``node`` sends, at random."""
        assert self.caps is not None
        ns = self.ns(node)
        if self.caps.iptables:
            run("ip", "netns", "exec", ns, "iptables", "-A", "OUTPUT", "-o", "eth0", "-m",
                "statistic", "--mode", "random", "--probability", f"{percent / 100:.2f}",
                "-j", "DROP")  # fmt: skip
            self.lossy[node] = "iptables"
        elif self.caps.netem:
            run("ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", "eth0", "root",
                "netem", "loss", f"{percent}%")  # fmt: skip
            self.lossy[node] = "netem"
        else:
            raise NetError("no way to drop packets here (neither iptables nor tc netem)")

    def delay(self, node: str, ms: int, jitter_ms: int) -> None:
        run("ip", "netns", "exec", self.ns(node), "tc", "qdisc", "replace", "dev", "eth0",
            "root", "netem", "delay", f"{ms}ms", f"{jitter_ms}ms")  # fmt: skip
        self.lossy[node] = "netem"

    def heal(self) -> None:
        """Every link whole again."""
        for src, dst in list(self.cuts):
            self.mend(src, dst)
        for node, how in list(self.lossy.items()):
            ns = self.ns(node)
            if how == "iptables":
                run("ip", "netns", "exec", ns, "iptables", "-F", "OUTPUT", check=False)
            else:
                run("ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", "eth0", "root",
                    check=False)  # fmt: skip
            del self.lossy[node]
