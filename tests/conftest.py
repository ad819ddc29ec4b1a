"""The suite's tiers and its shared fixtures.

Each test file sits in the directory of the heaviest thing one of its tests
needs, and every test in it gets that directory's marker, so that a tier runs
alone (``pytest -m unit``, ``pytest -m "not cluster and not frameworks"``):

- ``unit``: pure logic; no I/O beyond temporary files, no threads, no daemon;
- ``harness``: ckptfs's core or its parts (cache, store, mirror, transport)
  driven in this process without FUSE, on trio, threads and loopback sockets;
- ``mount``: real FUSE mounts (daemons that are not peers of each other);
- ``cluster``: daemons that are peers of each other, network namespaces and
  the fault trials;
- ``frameworks``: torch and the training frameworks on real mounts.

Helper modules live in tests/support (on ``sys.path`` through pytest's
``pythonpath``): mounts.py (the Mount of a real daemon), waits.py,
manifests.py, clusters.py, users.py, caches.py, tensors.py, peerwire.py,
lifecycle_harness.py and others.
"""

from __future__ import annotations

import shutil
import signal
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

# Tests import these from conftest as well as from their support modules.
from manifests import store_key, write_store_manifest  # noqa: F401
from mounts import (  # noqa: F401
    Mount,
    free_port,
    is_mounted,
    lines_of_a_killed_peer,
    mount_factory,
    process_gone,
)
from waits import wait_for  # noqa: F401

TIERS = ("unit", "harness", "mount", "cluster", "frameworks")
TESTS = Path(__file__).resolve().parent


def pytest_configure(config: pytest.Config) -> None:
    """Ctrl-C as a terminal sends it. pytest-xdist's workers start with
    SIGINT ignored, and an ignored signal stays ignored across exec: every
    child a test starts would ignore the Ctrl-C the interrupt tests send it
    (Python installs no KeyboardInterrupt handler then). A handler, unlike
    SIG_IGN, is reset to the default at exec."""
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark each test with the tier of its directory; a test file outside
    every tier is an error, so that no test escapes ``-m`` selections."""
    for item in items:
        path = Path(item.path).resolve()
        if not path.is_relative_to(TESTS):
            continue
        tier = path.relative_to(TESTS).parts[0]
        if tier not in TIERS:
            raise pytest.UsageError(
                f"{path}: a test file belongs in one of tests/{{{','.join(TIERS)}}}/"
                " (see tests/conftest.py)"
            )
        item.add_marker(getattr(pytest.mark, tier))


@pytest.fixture
def mounts(tmp_path: Path) -> Iterator[Any]:
    """Factory: ``mounts("n1")`` returns a Mount (not yet mounted)."""
    with mount_factory(tmp_path) as make:
        yield make


@pytest.fixture
def shared_mounts() -> Iterator[Any]:
    """Like ``mounts``, under a directory every user may traverse (pytest's
    tmp_path is 0700 to root)."""
    root = Path(tempfile.mkdtemp(prefix="ckptfs-users-", dir="/tmp"))
    root.chmod(0o755)
    try:
        with mount_factory(root, run_dir_mode=0o755) as make:
            yield make
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def mounted(mounts: Any) -> Mount:
    m = mounts()
    m.mount()
    return m


@pytest.fixture
def h(tmp_path: Path) -> Iterator[Any]:
    """A ckptfs Core driven without FUSE (lifecycle_harness.py), started."""
    from lifecycle_harness import Harness

    harness = Harness(tmp_path)
    harness.start()
    yield harness
    harness.close()
