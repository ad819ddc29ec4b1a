"""What `ckptfs stat` names to whom (fs/daemon/statview.py), section by section,
with cache entries made by hand: no mount, no peers."""

from __future__ import annotations

import json
from typing import Any

from ckptfs.fs.content.cachedfile import CachedFile
from ckptfs.fs.content.state import FileRole, FileState
from ckptfs.fs.daemon.statview import SECTIONS, StatView, Viewer
from ckptfs.fs.store.history import Recent
from ckptfs.tools.statfmt import not_shown_text

ROOT, ALICE, BOB = 0, 1001, 1002


def cached(path: str, uid: int, **kw: Any) -> CachedFile:
    return CachedFile(
        file_id=f"id-{path}",
        version=f"v-{path}",
        path=path,
        size=10,
        mode=0o100600,
        uid=uid,
        gid=uid,
        mtime_ns=0,
        atime_ns=0,
        page_size=4096,
        **kw,
    )


def scene() -> dict[str, Any]:
    """Alice's and Bob's files in every section that names files."""
    a = cached("alice/a.pt", ALICE, state=FileState.PENDING)
    b = cached("secret/b.pt", BOB, state=FileState.PENDING)
    b_lost = cached("secret/gone.pt", BOB, state=FileState.LOST, lost_reason="holders died")
    a_lost = cached("alice/gone.pt", ALICE, state=FileState.LOST, lost_reason="holders died")
    b_taken = cached("secret/t.pt", BOB, state=FileState.PENDING, role=FileRole.TAKEOVER)
    # The remote file the mount sees where Bob's taken-over file is.
    b_remote = cached("secret/t.pt", BOB, state=FileState.PENDING, role=FileRole.REMOTE)
    b_remote.file_id = b_taken.file_id
    mirrors = [
        cached("alice/m.pt", ALICE, state=FileState.PENDING, role=FileRole.MIRROR, origin="n2"),
        cached("secret/m.pt", BOB, state=FileState.PENDING, role=FileRole.MIRROR, origin="n2"),
    ]
    return {
        "linked": [a, b, b_lost, a_lost, b_remote],
        "taken": [b_taken],
        "active": [a, b],
        "recent": [
            Recent(ALICE, {"path": "alice/a.pt"}),
            Recent(BOB, {"path": "secret/b.pt"}),
        ],
        "mirroring": {
            "writer": {
                "buddy": "n2",
                "fallbacks": 2,
                "fallback_paths": ["alice/a.pt", "secret/b.pt"],
            },
            "mirrored_files": ["n2:alice/m.pt", "n2:secret/m.pt"],
            "mirrors": 2,
        },
        "mirrors": mirrors,
        "own": {ALICE: {"alice/a.pt", "alice/gone.pt"}, BOB: set(), ROOT: set()},
    }


def view_for(uid: int, prefix: str = "") -> tuple[dict[str, Any], dict[str, int]]:
    s = scene()
    view = StatView(Viewer(uid))
    reply = {
        **view.files(s["linked"], s["taken"], prefix),
        "flush": view.flush({"queued": 0}, s["active"]),
        "history": view.history(s["recent"]),
        "mirroring": view.mirroring(s["mirroring"], s["mirrors"], s["own"][uid]),
    }
    return reply, view.not_shown


def test_an_ordinary_user_sees_its_own_files_and_counts_of_the_others() -> None:
    reply, hidden = view_for(ALICE)
    text = json.dumps(reply)
    assert "secret" not in text and "v-secret" not in text and "id-secret" not in text, text
    assert [f["path"] for f in reply["files"]] == ["alice/a.pt", "alice/gone.pt"]
    assert reply["files"][0]["version"] == "v-alice/a.pt"
    assert reply["lost"] == [{"path": "alice/gone.pt", "reason": "holders died"}]
    assert reply["taken_over"] == []
    assert reply["flush"] == {"queued": 0, "active": ["alice/a.pt"]}
    assert reply["history"] == [{"path": "alice/a.pt"}]
    assert reply["mirroring"]["mirrored_files"] == ["n2:alice/m.pt"]
    assert reply["mirroring"]["writer"]["fallback_paths"] == ["alice/a.pt"]
    assert reply["mirroring"]["mirrors"] == 2  # counters stay
    # Bob's: b and b_lost as files (b_remote is listed as taken over), the
    # taken-over file, the lost one, and one in every other section.
    assert hidden == {
        "files": 2,
        "taken_over": 1,
        "lost": 1,
        "flushing": 1,
        "history": 1,
        "mirrored_files": 1,
        "fallback_paths": 1,
    }
    assert set(hidden) == set(SECTIONS)


def test_counts_do_not_depend_on_the_path_asked() -> None:
    _, whole = view_for(ALICE)
    for prefix in ("secret/b.pt", "secret", "secret/no-such.pt", "alice"):
        reply, hidden = view_for(ALICE, prefix)
        assert hidden == whole, prefix
        assert all(f["path"].startswith("alice/") for f in reply["files"]), prefix
    assert view_for(ALICE, "secret")[0]["files"] == []


def test_root_sees_everything_as_before() -> None:
    reply, hidden = view_for(ROOT)
    assert hidden == dict.fromkeys(SECTIONS, 0)
    assert [f["path"] for f in reply["files"]] == [
        "alice/a.pt",
        "alice/gone.pt",
        "secret/b.pt",
        "secret/gone.pt",
    ]
    assert [f["path"] for f in reply["taken_over"]] == ["secret/t.pt"]
    assert reply["taken_over"][0]["origin"] == ""
    assert [x["path"] for x in reply["lost"]] == ["alice/gone.pt", "secret/gone.pt"]
    assert reply["flush"]["active"] == ["alice/a.pt", "secret/b.pt"]
    assert len(reply["history"]) == 2
    assert reply["mirroring"] == scene()["mirroring"]


def test_the_owner_of_the_files_taken_over_sees_them_under_its_path() -> None:
    reply, hidden = view_for(BOB, "secret")
    assert [f["path"] for f in reply["taken_over"]] == ["secret/t.pt"]
    # Listed once, as taken over, not also as the remote file at its path.
    assert [f["path"] for f in reply["files"]] == ["secret/b.pt", "secret/gone.pt"]
    assert hidden["files"] == 2 and hidden["taken_over"] == 0


def test_the_human_output_says_what_was_not_shown() -> None:
    _, hidden = view_for(ALICE)
    text = not_shown_text(hidden)
    assert text.startswith("not shown: 2 cached files, 1 file taken over, 1 lost file,")
    assert "1 recent checkpoint," in text and "of other users in this mount" in text
    assert not_shown_text(dict.fromkeys(SECTIONS, 0)) == ""
