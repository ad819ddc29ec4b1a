"""Metrics of peers (fs/daemon/metrics.py): a mirrored file's close to
mirrored and to durable, bytes sent to the buddy and read from a holder's
RAM, and each peer's health."""

from __future__ import annotations

import os
from pathlib import Path

from ckptfs import __version__
from clusters import PEER_LOGS, cluster
from conftest import free_port, wait_for
from scrape import scrape, value


def test_a_mirrored_file_a_read_from_a_holder_and_a_dead_peer_show_in_the_metrics(
    mounts,  # type: ignore[no-untyped-def]
    tmp_path: Path,
) -> None:
    names = ["n1", "n2", "n3"]
    listen = {name: f"127.0.0.1:{free_port()}" for name in names}
    env = {n: {"CKPTFS_METRICS_LISTEN": a} for n, a in listen.items()}
    # n1's flush paced to 1 MiB/s: its file stays in RAM (n1's and its buddy
    # n2's) for the seconds n3 takes to read it.
    env["n1"]["CKPTFS_FLUSH_BANDWIDTH"] = "1MiB"
    nodes = cluster(mounts, tmp_path, names, env=env)
    n1, n3 = nodes["n1"], nodes["n3"]
    data = os.urandom(3_000_000)
    (n1.mnt / "shard.pt").write_bytes(data)  # durability buddy: close waits for n2
    assert (n3.mnt / "shard.pt").read_bytes() == data
    n1.wait_durable()
    s = {name: scrape(address) for name, address in listen.items()}
    assert value(s["n1"], "ckptfs_info", version=__version__, node="n1", durability="buddy") == 1
    assert value(s["n1"], "ckptfs_close_to_mirrored_seconds_count") == 1
    assert value(s["n1"], "ckptfs_close_to_durable_seconds_count") == 1
    assert value(s["n1"], "ckptfs_mirror_sent_bytes_total") >= len(data)
    fetched = value(s["n3"], "ckptfs_peer_read_bytes_total", direction="fetched")
    served = [value(s[n], "ckptfs_peer_read_bytes_total", direction="served") for n in names]
    assert fetched >= len(data) and sum(served) == fetched, (fetched, served)
    for name in names:
        for peer in names:
            if peer != name:
                assert value(s[name], "ckptfs_peer_up", peer=peer) == 1
                assert value(s[name], "ckptfs_peer_rtt_seconds", peer=peer) > 0
    nodes["n2"].kill()
    for m in nodes.values():
        m.allowed_log = PEER_LOGS
    wait_for(lambda: value(scrape(listen["n1"]), "ckptfs_peer_up", peer="n2") == 0, 30,
             "n1's metrics say n2 is down")  # fmt: skip
    assert value(scrape(listen["n3"]), "ckptfs_peer_up", peer="n1") == 1
