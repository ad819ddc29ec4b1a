"""The metrics a daemon exports (fs/daemon/metrics.py), from a canned stat
snapshot: their values, and that every metric the shipped alert rules and
dashboard name (deploy/) is one of them."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml
from ckptfs.fs.daemon.metrics import Timings, stat_metrics
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def snapshot(**over: Any) -> dict[str, Any]:
    """The fields of a daemon's stat reply that metrics read."""
    states = {"dirty": (1, 10), "mirrored": (2, 20), "flushing": (3, 30), "durable": (4, 40)}
    s: dict[str, Any] = {
        "version": "9.9.9", "node": "n1", "durability": "buddy",
        "progress": {**{k: {"files": f, "bytes": b} for k, (f, b) in states.items()},
                     "to_store": 60},
        "cache": {"capacity": 1000, "used": 100, "waiting_writers": 1,
                  "backpressure_seconds": 2.5, "backpressure_events": 3},
        "flush": {"bytes_stored": 500, "bytes_deduped": 50, "files_durable": 7,
                  "failures": 1, "failing": 0},
        "lost": [{"path": "secret/x.pt"}], "not_shown": {"lost": 2},
        "backing_health": "full",
        "backing_error": {"errno": "ENOSPC", "error": "x", "seconds_ago": 1},
        "daemon_health": "ok",
        "backing_calls": {"total": 90, "slow": 2, "timed_out": 1},
        "mirroring": {"writer": {"bytes_sent": 300, "fallbacks": 1}, "mirrored_bytes": 70,
                      "takeovers": 1},
        "peer_reads": {"bytes_fetched": 11, "bytes_served": 12},
        "peers": [{"name": "n2", "alive": True, "rtt_ms": 0.5},
                  {"name": "n3", "alive": False, "rtt_ms": None}],
    }  # fmt: skip
    s.update(over)
    return s


def exported(s: dict[str, Any]) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    class Canned(Collector):
        def collect(self) -> Any:
            return stat_metrics(s)

    registry = CollectorRegistry(auto_describe=False)
    registry.register(Canned())
    Timings(registry).file_durable(1.5, 0.2)
    text = generate_latest(registry).decode()
    return {
        (x.name, frozenset(x.labels.items())): x.value
        for family in text_string_to_metric_families(text)
        for x in family.samples
    }


def test_the_snapshots_numbers_become_metrics_with_bounded_labels() -> None:
    got = exported(snapshot())
    assert got[("ckptfs_cache_bytes", frozenset({("state", "mirrored")}))] == 20
    assert got[("ckptfs_to_store_bytes", frozenset())] == 60
    assert got[("ckptfs_lost_files", frozenset())] == 3  # shown and not shown
    assert got[("ckptfs_store_health", frozenset({("state", "full")}))] == 1
    assert got[("ckptfs_store_health", frozenset({("state", "normal")}))] == 0
    assert got[("ckptfs_store_error", frozenset({("errno", "ENOSPC")}))] == 1
    assert got[("ckptfs_backpressure_seconds_total", frozenset())] == 2.5
    assert got[("ckptfs_peer_up", frozenset({("peer", "n3")}))] == 0
    assert ("ckptfs_peer_rtt_seconds", frozenset({("peer", "n3")})) not in got
    assert got[("ckptfs_peer_rtt_seconds", frozenset({("peer", "n2")}))] == 0.0005
    assert got[("ckptfs_close_to_mirrored_seconds_count", frozenset())] == 1
    info = frozenset({("version", "9.9.9"), ("node", "n1"), ("durability", "buddy")})
    assert got[("ckptfs_info", info)] == 1
    assert not [k for k in got if any("secret" in v for _, v in k[1])]
    # No error, no peers: no error sample, no peer samples.
    quiet = exported(snapshot(backing_error=None, peers=[], backing_health="normal"))
    assert not [k for k in quiet if k[0] in ("ckptfs_store_error", "ckptfs_peer_up")]


def test_every_metric_the_alert_rules_and_the_dashboard_use_is_exported() -> None:
    names = {name for name, _ in exported(snapshot())}
    rules = yaml.safe_load((DEPLOY / "prometheus-alerts.yaml").read_text())
    exprs = [r["expr"] for g in rules["groups"] for r in g["rules"]]
    dashboard = json.loads((DEPLOY / "grafana-dashboard.json").read_text())
    exprs += [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    exprs.append(dashboard["templating"]["list"][1]["query"])
    used = {name for expr in exprs for name in re.findall(r"\bckptfs_[a-z_]+", expr)}
    assert len(used) > 10 and used <= names, sorted(used - names)
