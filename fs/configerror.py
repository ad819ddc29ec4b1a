"""The one error a bad configuration raises, for the daemon's keys and the
peers section alike (a leaf: fs/config.py and peer/config.py both use it)."""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration problem; ``str()`` is a one-line message naming the key."""

    def __init__(self, key: str, problem: str) -> None:
        super().__init__(f"config key '{key}': {problem}")
        self.key = key
