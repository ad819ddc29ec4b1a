"""Operator commands racing the file lifecycle: `ckptfs flush` and
`ckptfs flush --wait` arriving while a training job creates a checkpoint.

Found by a multi-process stress run on a real mount (uid 65534 writers doing
temporary-name-then-os.replace saves, a controller running `ckptfs flush` and
`ckptfs evict` at random): a `ckptfs flush` landing while a file's CREATE
was writing its first manifest committed the new file before that manifest
existed. The publish found no manifest at the name, took the name for gone
and dropped the file's content; the writer went on writing into nothing, its
os.replace moved the empty first manifest over the checkpoint, and every
later open of the name got EIO ("not durable yet and no reachable holder").

Driven without FUSE (lifecycle_harness.py); the operator's command runs as a
background task, so the test lets it run to its end while the CREATE waits
at its manifest write, which is the order the race needs.
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import trio
from ckptfs.fs.content.state import FileState
from ckptfs.fs.namespace.inodes import ROOT
from lifecycle_harness import BACKGROUND, CALLER, Harness, audit, name_reads


def create_during(h: Harness, operator: Callable[[], Awaitable[Any]], name: str) -> int:
    """CREATE ``name`` while ``operator`` runs (as a background task); returns
    the new handle.

    A rename holds the namespace lock as both start, so the CREATE (its file
    already registered) and the command's commit of it both wait for the
    lock; which goes first when it opens is trio's choice (it runs a batch
    of woken tasks in either order), as it is the thread pool's in the daemon.
    """
    core, gate = h.core, h.gate
    assert core is not None and gate is not None
    out: dict[str, Any] = {}

    async def scenario() -> None:
        rename_done = trio.Event()

        async def rename(task_status: trio.TaskStatus[None]) -> None:
            async with core.fs.ns_lock.exclusive():
                task_status.started()
                await rename_done.wait()

        async def create() -> None:
            out["fh"], _ = await core.fs.create(ROOT, name, 0o644, os.O_WRONLY, CALLER)

        async def command() -> None:
            BACKGROUND.set("operator")
            out["operator"] = await operator()

        async with trio.open_nursery() as nursery:
            await nursery.start(rename)
            nursery.start_soon(create)
            await h._settle()
            nursery.start_soon(command)
            await h._settle()
            rename_done.set()
            for _ in range(400):
                await h._settle()
                if "operator" in out and "fh" in out:
                    break
                if gate.waiting["bg"]:
                    gate.grant("bg")
                elif gate.waiting["fg"]:
                    gate.grant("fg")
                else:
                    await trio.sleep(0.005)  # the flusher's timers
            assert "fh" in out and "operator" in out, out

    h.direct(scenario)
    return out["fh"]


def write_close(h: Harness, fh: int, data: bytes) -> None:
    fs = h.core.fs
    h.call(fs.write, fh, 0, data)
    h.call(fs.flush, fh)
    h.call(fs.release, fh)


@pytest.mark.parametrize("command", ["flush", "flush --wait"])
def test_a_flush_while_files_are_created_keeps_them(h: Harness, command: str) -> None:
    """Each round has an even chance of the order that lost the file, so
    twelve rounds fail the old code all but once in 4096 runs."""
    core = h.core
    assert core is not None
    saved = {}
    for i in range(12):
        name = f"ckpt{i}.pt"
        data = os.urandom(5 * 4096 + 123 + i)
        if command == "flush":
            fh = create_during(h, lambda: core.flush(""), name + ".tmp")
        else:
            fh = create_during(h, lambda: core.drain("", 60), name + ".tmp")
        f = core.fs.handles[fh].file
        assert f is not None and not f.unlinked, f"round {i}: the file being created was dropped"
        if command == "flush":  # leaves a file open for writing to its close
            assert f.state is FileState.MODIFIED, f"round {i}: committed while open: {f.state}"
        write_close(h, fh, data)
        assert f.state in (FileState.PENDING, FileState.DURABLE), (i, f.state)
        # torch.save's os.replace, then a resume that reads it
        h.call(core.fs.rename, ROOT, name + ".tmp", ROOT, name, 0)
        assert name_reads(h, name) == data, f"round {i}"
        saved[name] = data
    h.call(core.drain, "", 60)
    manifests = h.manifests()
    assert set(manifests) == set(saved), manifests
    for name, data in saved.items():
        assert manifests[name].state == "durable", name
        assert h.reassemble(manifests[name]) == data, name
    assert audit(core) == []
    # and from the backing store alone, after a clean unmount and a new mount
    h.stop_clean()
    h.start()
    for name, data in saved.items():
        assert name_reads(h, name) == data, name


def test_a_flush_goes_on_past_a_file_whose_commit_fails(h: Harness) -> None:
    """Two closed files whose publish failed at their close (the store down)
    wait for a retry. `ckptfs flush` then finds the store refusing one of
    them only: it commits and queues the other and names the one that failed
    with its cause (before, the first failure ended the command, and files
    after it in the walk were left to the background retry)."""
    core = h.core
    assert core is not None
    fs = core.fs
    real_replace = fs.backing.replace_manifest
    refused: set[str] = {"a.pt", "b.pt"}

    async def store_refuses(rel: str, *args: Any, **kw: Any) -> Any:
        if rel in refused:
            raise OSError(5, f"the store refuses {rel}")
        return await real_replace(rel, *args, **kw)

    fs.backing.replace_manifest = store_refuses
    data = {name: os.urandom(3 * 4096 + 7) for name in ("a.pt", "b.pt")}
    for name, content in data.items():
        fh, _ = h.call(fs.create, ROOT, name, 0o644, os.O_WRONLY, CALLER)
        h.call(fs.write, fh, 0, content)
        with pytest.raises(OSError):
            h.call(fs.flush, fh)
        with pytest.raises(OSError):
            h.call(fs.release, fh)
    files = {f.path: f for f in fs.files_under("")}
    assert {p: f.state for p, f in files.items()} == {
        "a.pt": FileState.MODIFIED,
        "b.pt": FileState.MODIFIED,
    }
    refused.discard("b.pt")
    queued, failed = h.call(core.flush, "")
    assert queued == 1 and failed == ["a.pt (the store refuses a.pt)"]
    assert files["a.pt"].state is FileState.MODIFIED
    assert files["b.pt"].state in (FileState.PENDING, FileState.DURABLE)
    fs.backing.replace_manifest = real_replace
    h.call(core.drain, "", 60)
    for name, content in data.items():
        assert name_reads(h, name) == content
        assert h.reassemble(h.manifests()[name]) == content
    assert audit(core) == []
