"""Scrape a daemon's Prometheus endpoint (fs/daemon/metrics.py) as a server would."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(address: str, timeout: float = 20) -> Samples:
    """Every sample of ``http://ADDRESS/metrics``, keyed by name and labels."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=timeout) as reply:
        assert reply.status == 200
        assert reply.headers["Content-Type"].startswith("text/plain")
        text = reply.read().decode()
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    key = (name, frozenset(labels.items()))
    assert key in samples, f"no {name}{labels} in {sorted(k[0] for k in samples)}"
    return samples[key]
