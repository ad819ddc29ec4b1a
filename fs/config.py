"""Mount configuration: YAML file, then ``CKPTFS_*`` environment, then flags.

Every value has a default; an unknown key or a bad value raises
:class:`ConfigError`, whose message is one line naming the key.
"""

from __future__ import annotations

import os
import re
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from ckptfs.fs.configerror import ConfigError
from ckptfs.peer.config import Address, PeersConfig, parse_address, parse_peers

DURABILITY_LEVELS = ("local", "buddy", "backing")
# WARN and CRITICAL: what CKPTFS_LOG_LEVEL took before it was a key (logging's names).
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "WARN", "ERROR", "CRITICAL")
LOG_FORMATS = ("text", "json")
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b?|b|%)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def total_ram() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def parse_size(value: Any, key: str, *, allow_percent: bool = False) -> int:
    """Parse ``123``, ``64MiB``, ``2GiB``, ``1.5G`` or (if allowed) ``40%`` of RAM."""
    if isinstance(value, bool):
        raise ConfigError(key, f"expected a size, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(key, f"size must not be negative, got {value}")
        return value
    m = _SIZE_RE.match(str(value))
    if not m:
        raise ConfigError(key, f"expected a size like 512MiB, 2GiB or 40%, got {value!r}")
    number, unit = float(m.group(1)), (m.group(2) or "").lower()
    if unit == "%":
        if not allow_percent:
            raise ConfigError(key, f"a percentage is not allowed here, got {value!r}")
        if not 0 < number <= 100:
            raise ConfigError(key, f"percentage must be in (0, 100], got {value!r}")
        return int(total_ram() * number / 100)
    return int(number * _UNITS[unit[:1]])


def parse_int(value: Any, key: str, *, minimum: int = 0) -> int:
    try:
        result = int(value)
    except (TypeError, ValueError):
        raise ConfigError(key, f"expected an integer, got {value!r}") from None
    if isinstance(value, bool) or result < minimum:
        raise ConfigError(key, f"expected an integer >= {minimum}, got {value!r}")
    return result


def parse_bool(value: Any, key: str) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ConfigError(key, f"expected true or false, got {value!r}")


@dataclass
class Config:
    node: str = field(default_factory=socket.gethostname)
    backing: Path | None = None
    cache_dir: Path = Path("/dev/shm/ckptfs")
    cache_size: int = 0  # bytes; resolved from "40%" when left at 0
    cache_prefault: bool = True
    durability: str = "local"
    flush_workers: int = 4
    flush_bandwidth: int = 0  # bytes/s, 0 = unlimited
    chunk_size: int = 4 << 20
    # Off: with it, the kernel trusts its own size and mtime of a regular file
    # for ever, so a file rewritten on another node keeps its old size here.
    writeback_cache: bool = False
    direct_writes: bool = True
    read_ahead_kb: int = 1024
    # Handlers that wait (backpressure, durability) each hold a worker; FUSE
    # service needs free ones. An idle worker costs nothing, a busy one ~2 MiB.
    fuse_workers: int = 128
    allow_other: bool = True
    # A read-only open, or a stat of a closed file, reuses the manifest check
    # that the lookup, stat or open just before it made, if no older than this
    # (seconds): one backing-store round trip less each (torch.load's mmap
    # reopen, and its getsize after a read). 0: every open re-reads.
    open_recheck: float = 0.05
    # A closed file waits this long (seconds) before its flush starts: a
    # close is often followed at once by a rename (torch.save to a temporary
    # name, then os.replace), which would otherwise wait for the flush's
    # manifest publish while the kernel holds the replaced file's inode lock,
    # and every reader's lseek(SEEK_END) of that file with it. 0: at once.
    flush_settle: float = 0.02
    backing_timeout: float = 120.0
    run_dir: Path = Path("/run/ckptfs")
    log_file: Path | None = None
    log_level: str = "INFO"
    log_format: str = "text"  # or "json": one JSON object per line
    metrics_listen: Address | None = None  # Prometheus endpoint; None = off
    history_file: Path | None = None
    peers: dict[str, Any] = field(default_factory=dict)
    peers_config: PeersConfig | None = None  # the validated `peers`, set by load_config
    retention_keep_last: int = 0  # 0 = retention off
    retention_pattern: str = "checkpoint-*"
    retention_audit_log: Path | None = None

    def __post_init__(self) -> None:
        if not self.cache_size:
            self.cache_size = parse_size("40%", "cache.size", allow_percent=True)


# YAML schema: dotted key -> (Config attribute, parser). Env var names are the
# dotted keys upper-cased with dots as underscores, prefixed by CKPTFS_.
def _path(value: Any, key: str) -> Path:
    if not isinstance(value, str | os.PathLike) or not str(value):
        raise ConfigError(key, f"expected a path, got {value!r}")
    return Path(value)


def _durability(value: Any, key: str) -> str:
    if value not in DURABILITY_LEVELS:
        raise ConfigError(key, f"expected one of {', '.join(DURABILITY_LEVELS)}, got {value!r}")
    return str(value)


def _node(value: Any, key: str) -> str:
    text = str(value)
    if not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", text):
        raise ConfigError(key, f"expected a name of letters, digits, '_', '.', '-', got {value!r}")
    return text


def _float_seconds(value: Any, key: str) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ConfigError(key, f"expected seconds, got {value!r}") from None


def _timeout(value: Any, key: str) -> float:
    result = _float_seconds(value, key)
    if result <= 0:
        raise ConfigError(key, f"expected a positive number of seconds, got {value!r}")
    return result


def _seconds(value: Any, key: str) -> float:
    result = _float_seconds(value, key)
    if not 0 <= result <= 3600:
        raise ConfigError(key, f"expected 0 to 3600 seconds, got {value!r}")
    return result


def _one_of(choices: tuple[str, ...], upper: bool = False) -> Any:
    def parse(value: Any, key: str) -> str:
        text = str(value).upper() if upper else str(value)
        if text not in choices:
            raise ConfigError(key, f"expected one of {', '.join(choices)}, got {value!r}")
        return text

    return parse


def _peers(value: Any, key: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ConfigError(key, f"expected a mapping, got {value!r}")
    return dict(value)  # ckptfs.peer.config checks each sub-key, naming it


def _pattern(value: Any, key: str) -> str:
    text = str(value)
    if not text or "/" in text:
        raise ConfigError(
            key, f"expected a glob for directory names like checkpoint-*, got {value!r}"
        )
    return text


def _chunk_size(value: Any, key: str) -> int:
    size = parse_size(value, key)
    if not (64 << 10) <= size <= (256 << 20):
        raise ConfigError(key, f"expected between 64KiB and 256MiB, got {value!r}")
    return size


def _cache_size(value: Any, key: str) -> int:
    size = parse_size(value, key, allow_percent=True)
    if size < (16 << 20):
        raise ConfigError(key, f"must be at least 16MiB, got {value!r}")
    return size


SCHEMA: dict[str, tuple[str, Any]] = {
    "node": ("node", _node),
    "backing": ("backing", _path),
    "cache.dir": ("cache_dir", _path),
    "cache.size": ("cache_size", _cache_size),
    "cache.prefault": ("cache_prefault", parse_bool),
    "durability": ("durability", _durability),
    "flush.workers": ("flush_workers", lambda v, k: parse_int(v, k, minimum=1)),
    "flush.bandwidth": ("flush_bandwidth", parse_size),
    "flush.settle": ("flush_settle", _seconds),
    "chunk_size": ("chunk_size", _chunk_size),
    "fuse.writeback_cache": ("writeback_cache", parse_bool),
    "fuse.workers": ("fuse_workers", lambda v, k: parse_int(v, k, minimum=8)),
    "fuse.direct_writes": ("direct_writes", parse_bool),
    "fuse.allow_other": ("allow_other", parse_bool),
    "fuse.open_recheck": ("open_recheck", _seconds),
    "fuse.read_ahead_kb": ("read_ahead_kb", parse_int),
    "backing_timeout": ("backing_timeout", _timeout),
    "run_dir": ("run_dir", _path),
    "log": ("log_file", _path),
    "log_level": ("log_level", _one_of(LOG_LEVELS, upper=True)),
    "log_format": ("log_format", _one_of(LOG_FORMATS)),
    "metrics.listen": ("metrics_listen", lambda v, k: parse_address(v, k) if v else None),
    "history": ("history_file", _path),
    "peers": ("peers", _peers),
    "retention.keep_last": ("retention_keep_last", parse_int),
    "retention.pattern": ("retention_pattern", lambda v, k: _pattern(v, k)),
    "retention.audit_log": ("retention_audit_log", _path),
}
_SECTIONS = {key.split(".")[0] for key in SCHEMA if "." in key}


def _flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        if dotted in SCHEMA:
            flat[dotted] = value
        elif isinstance(value, dict) and dotted in _SECTIONS:
            flat.update(_flatten(value, dotted + "."))
        else:
            raise ConfigError(dotted, "unknown key")
    return flat


def env_name(key: str) -> str:
    return "CKPTFS_" + key.upper().replace(".", "_")


def load_config(
    path: str | os.PathLike[str] | None = None,
    overrides: dict[str, Any] | None = None,
    environ: dict[str, str] | None = None,
) -> Config:
    """Build a Config from a YAML file, the environment and explicit overrides.

    ``overrides`` uses dotted keys (``{"cache.size": "1GiB"}``); None values are
    ignored so that unset command-line flags fall through.
    """
    values: dict[str, Any] = {}
    if path is not None:
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise ConfigError("--config", f"cannot read {path}: {exc.strerror}") from None
        try:
            data = yaml.safe_load(text) or {}
        except yaml.YAMLError as exc:
            msg = f"{path} is not valid YAML: {exc}".splitlines()[0]
            raise ConfigError("--config", msg) from None
        if not isinstance(data, dict):
            raise ConfigError("--config", f"{path} must hold a mapping")
        values.update(_flatten(data))
    env = os.environ if environ is None else environ
    for key in SCHEMA:
        if key != "peers" and env_name(key) in env:
            values[key] = env[env_name(key)]
    if env_name("peers") in env:
        # A mapping of nodes, addresses and secrets has no one-line form; an
        # ignored variable would leave a node silently without its buddy.
        raise ConfigError(
            "peers", f"{env_name('peers')} is set, but peers can only be set in the config file"
        )
    for key, value in (overrides or {}).items():
        if key not in SCHEMA:
            raise ConfigError(key, "unknown key")
        if value is not None:
            values[key] = value
    config = Config()
    for key, value in values.items():
        attr, parser = SCHEMA[key]
        setattr(config, attr, parser(value, key))
    config.peers_config = parse_peers(config.peers or None, config.node)
    if "durability" not in values and config.peers_config is not None:
        config.durability = "buddy"  # the default with peers (DESIGN.md)
    if "fuse.open_recheck" not in values and config.peers_config is not None:
        # Reusing a recent check would let an open that follows another
        # node's close within the window read the old version: with peers,
        # every open re-reads the manifest (NFS close-to-open).
        config.open_recheck = 0.0
    if config.durability == "buddy" and config.peers_config is None:
        raise ConfigError("durability", "'buddy' needs peers.nodes; use local or backing")
    return config
