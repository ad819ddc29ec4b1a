"""Daemons on this machine that are peers of each other: each has its own
mountpoint, cache and loopback port, and all share one backing directory
(the NFS stand-in). In a ring of n1, n2, n3, n2 is the buddy of n1, n3 of n2
and n1 of n3."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mounts import Mount, free_port
from waits import wait_for

# What a node logs, as a warning, when another node stops or is killed.
PEER_LOGS = ["lost connection to peer", "peer 'n", "dropped connection from peer"]
SECRET = "correct horse battery staple 0123456789"


def cluster_config(
    tmp_path: Path,
    ports: dict[str, int],
    timeout: float = 1.5,
    heartbeat: float = 0.2,
    **extra: str,
) -> Path:
    """The peers config of ``ports``' nodes on 127.0.0.1 (a new file each
    call, beside one secret file in ``tmp_path``); ``extra``: more keys."""
    secret = tmp_path / "secret"
    if not secret.exists():
        secret.write_text(SECRET + "\n")
        secret.chmod(0o600)
    nodes = ", ".join(f"{name}: 127.0.0.1:{port}" for name, port in ports.items())
    lines = [
        "peers:",
        f"  secret_file: {secret}",
        f"  nodes: {{{nodes}}}",
        f"  timeout: {timeout}",
        f"  heartbeat: {heartbeat}",
        *(f"  {key}: {value}" for key, value in extra.items()),
    ]
    path = tmp_path / f"cluster-{len(list(tmp_path.glob('cluster-*')))}.yaml"
    path.write_text("\n".join(lines) + "\n")
    return path


def peers_of(m: Mount) -> dict[str, dict]:
    """``ckptfs stat``'s peers of ``m``, by name."""
    return {p["name"]: p for p in m.stat()["peers"]}


def cluster(
    mounts: Any,
    tmp_path: Path,
    names: list[str],
    env: dict[str, dict[str, str]] | None = None,
    *,
    args: tuple[str, ...] = (),
    cache_size: str = "256MiB",
    **config: Any,
) -> dict[str, Mount]:
    """Nodes ``names`` mounted (``mounts`` is the fixture) as one cluster,
    once each sees every other alive. ``env``: each node's environment;
    ``args``: more mount arguments of every node; ``config``: peers keys
    (``timeout``, ``heartbeat``...)."""
    ports = {name: free_port() for name in names}
    config_file = cluster_config(tmp_path, ports, **config)
    nodes = {name: mounts(name) for name in names}
    for name, m in nodes.items():
        m.mount("--config", str(config_file), "--node", name, *args,
                cache_size=cache_size, env=(env or {}).get(name, {}))  # fmt: skip
    for name, m in nodes.items():
        wait_for(
            lambda m=m, name=name: all(p["alive"] for p in peers_of(m).values()),
            30,
            f"{name} sees every peer alive",
        )
    return nodes
