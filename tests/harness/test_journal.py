"""The cache journal (fs/cache/journal.py): its records on tmpfs, written and
removed from store-call threads, some of which the loop gave up on."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest
from ckptfs.fs.cache import journal as journal_mod
from ckptfs.fs.cache.journal import Journal, check_record

KEY = ("f1", "v1")


def record(path: str) -> dict[str, Any]:
    return {
        "file_id": KEY[0], "version": KEY[1], "seq": 5, "path": path, "size": 0, "mode": 0o644,
        "mtime_ns": 1, "dirty": {}, "spilled": {}, "base": [], "base_end": 0,
    }  # fmt: skip


def stalled_write(j: Journal, rec: dict[str, Any], monkeypatch: Any) -> tuple[Any, Any]:
    """A write of ``rec`` in a thread of its own that stops before it writes
    its file (a store call the loop gave up on, still running): returns the
    thread and the event that lets it go on."""
    go, stopped = threading.Event(), threading.Event()
    real = json.dumps

    def slow_dumps(obj: Any, *args: Any, **kwargs: Any) -> str:
        if obj is rec:
            stopped.set()
            assert go.wait(10)
        return real(obj, *args, **kwargs)

    monkeypatch.setattr(journal_mod.json, "dumps", slow_dumps)
    thread = threading.Thread(target=j.write_now, args=(KEY, rec))
    thread.start()
    assert stopped.wait(10)
    return thread, go


@pytest.mark.parametrize("then", ["rewritten", "removed"])
def test_a_write_given_up_on_lands_over_nothing_newer(tmp_path: Path, monkeypatch, then):
    """The abandoned write began first; a newer write of the same record (a
    rename rewrote it), or its removal (the version became durable), lands
    meanwhile. The abandoned one then lands over neither: the record stays
    what the newest said, and the newest write never fails."""
    j = Journal(tmp_path / "journal")
    old, new = record("old/a.pt"), record("new/a.pt")
    j.write_now(KEY, old)
    thread, go = stalled_write(j, old, monkeypatch)
    if then == "rewritten":
        j.write_now(KEY, new)
    else:
        j._remove(KEY)
    go.set()
    thread.join(10)
    assert [r["path"] for r in j.load()] == (["new/a.pt"] if then == "rewritten" else [])
    assert sorted(p.name for p in (tmp_path / "journal").iterdir()) == (
        ["f1.v1.json"] if then == "rewritten" else []
    )


def test_a_record_that_does_not_check_out_is_dropped_not_adopted(tmp_path: Path):
    j = Journal(tmp_path / "journal")
    j.write_now(KEY, record("a.pt"))
    bad = {**record("../../etc/x"), "version": "v2"}
    (tmp_path / "journal" / "f1.v2.json").write_text(json.dumps(bad))
    (tmp_path / "journal" / "f1.v3.json").write_text("{not json")
    assert [r["path"] for r in j.load()] == ["a.pt"]
    assert check_record(bad) == "bad path"
    assert check_record({**record("a.pt"), "base": [[0, 10, "/dev/sda"]]}) == "bad chunk map"
