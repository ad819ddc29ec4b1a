"""One writer of file state: the cache package.

Every change of a CachedFile is made by fs/cache (docs/STATES.md), and every
change of its state goes through fs/cache/transitions.py's table. These
tests read the source (a module that assigns a field elsewhere fails here,
with the line) and drive the table itself.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from ckptfs.fs.cache.transitions import ALLOWED, STARTS, IllegalTransition, move, start
from ckptfs.fs.content.cachedfile import CachedFile
from ckptfs.fs.content.state import FileState

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("fs", "peer", "tools")
CACHE = ROOT / "fs" / "cache"
CLASS_MODULE = ROOT / "fs" / "content" / "cachedfile.py"

# Receivers of an attribute assignment that are never a CachedFile, although
# they share field names with it (a Manifest's mode, a frame's state...).
NOT_CACHED_FILES = {
    "manifest",  # fs/store/manifest.py Manifest
    "frame",  # fs/read/frames.py Frame
    "block",  # fs/read/remoteread.py Block
    "snap",  # fs/content/cachedfile.py Snapshot (snap.file is one: checked)
    "core.fs",  # the Filesystem
}


def cached_file_fields() -> set[str]:
    tree = ast.parse(CLASS_MODULE.read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "CachedFile")
    return {
        n.target.id
        for n in cls.body
        if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
    }


def assigned_attributes(path: Path) -> list[tuple[int, str, str]]:
    """(line, receiver, attribute) of every attribute assignment in a module."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        else:
            continue
        for target in targets:
            for t in target.elts if isinstance(target, ast.Tuple) else [target]:
                if isinstance(t, ast.Attribute):
                    out.append((node.lineno, ast.unparse(t.value), t.attr))
    return out


def product_modules() -> list[Path]:
    return [
        p
        for top in PACKAGES
        for p in sorted((ROOT / top).rglob("*.py"))
        if "bench" not in p.relative_to(ROOT).parts
    ]


def test_no_module_outside_the_cache_package_assigns_a_cached_file_field() -> None:
    fields = cached_file_fields()
    assert {"state", "path", "handles", "writers", "mode", "uid", "mtime_ns"} <= fields
    found = []
    for path in product_modules():
        if CACHE in path.parents or path == CLASS_MODULE:
            continue
        for line, receiver, attr in assigned_attributes(path):
            if attr in fields and receiver != "self" and receiver not in NOT_CACHED_FILES:
                found.append(f"{path.relative_to(ROOT)}:{line}: {receiver}.{attr}")
    assert not found, "CachedFile fields assigned outside fs/cache (make it a Cache method):\n" + (
        "\n".join(found)
    )


def test_the_check_finds_an_assignment_outside_the_cache(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text("def f(handle):\n    handle.file.writers -= 1\n    f.path, x = 'a', 1\n")
    assert (2, "handle.file", "writers") in assigned_attributes(module)
    assert (3, "f", "path") in assigned_attributes(module)


def test_only_the_transitions_module_assigns_a_file_state() -> None:
    found = []
    for path in product_modules():
        if path == CACHE / "transitions.py":
            continue
        for line, receiver, attr in assigned_attributes(path):
            if attr == "state" and receiver not in {"page", "frame", "block", "self"}:
                found.append(f"{path.relative_to(ROOT)}:{line}: {receiver}.state")
    assert not found, "a file state set outside transitions.move/start:\n" + "\n".join(found)


def a_file(state: FileState) -> CachedFile:
    f = CachedFile("id", "v1", "dir/ckpt.pt", 0, 0o644, 0, 0, 0, 0, 1 << 20)
    f.state = state
    return f


def test_every_state_has_its_moves_and_unlinked_is_the_end() -> None:
    assert set(ALLOWED) == set(FileState)
    assert ALLOWED[FileState.UNLINKED] == frozenset()
    # Every state but the end can be removed; every state is reachable.
    for state in FileState:
        if state is not FileState.UNLINKED:
            assert FileState.UNLINKED in ALLOWED[state], state
    reachable = set(STARTS) | {to for moves in ALLOWED.values() for to in moves}
    assert reachable == set(FileState)


@pytest.mark.parametrize("source", list(FileState))
@pytest.mark.parametrize("target", list(FileState))
def test_a_move_happens_exactly_when_the_table_allows_it(
    source: FileState, target: FileState
) -> None:
    f = a_file(source)
    if target is source or target in ALLOWED[source]:
        move(f, target)
        assert f.state is target
    else:
        with pytest.raises(IllegalTransition, match=r"dir/ckpt\.pt: .* -> "):
            move(f, target)
        assert f.state is source


def test_the_paths_of_a_save_a_rewrite_and_a_removal_are_allowed() -> None:
    f = a_file(FileState.MODIFIED)
    for state in (
        FileState.PUBLISHING,
        FileState.PENDING,
        FileState.DURABLE,
        FileState.MODIFIED,  # the next torch.save of the same name
        FileState.PUBLISHING,
        FileState.MODIFIED,  # written again while its commit ran
        FileState.PUBLISHING,
        FileState.PENDING,
        FileState.UNLINKED,
    ):
        move(f, state)
    assert f.state is FileState.UNLINKED
    with pytest.raises(IllegalTransition):
        move(f, FileState.MODIFIED)


def test_a_file_cannot_start_unlinked_or_publishing() -> None:
    for state in (FileState.UNLINKED, FileState.PUBLISHING):
        with pytest.raises(IllegalTransition):
            start(a_file(FileState.MODIFIED), state)
    f = a_file(FileState.MODIFIED)
    start(f, FileState.PENDING)
    assert f.state is FileState.PENDING
