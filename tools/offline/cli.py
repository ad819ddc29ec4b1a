"""`ckptfs export`, `gc` and `check`: they work on the backing directory itself.

PATH may be a path in the backing directory, or a path inside a ckptfs mount
(then the daemon is asked where its backing directory is).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from ckptfs.fs.store.manifest import ManifestError, read_manifest
from ckptfs.tools.control import ControlError, find_mount, live_daemons, request
from ckptfs.tools.offline.check import PendingFile, check
from ckptfs.tools.offline.export import export
from ckptfs.tools.offline.gc import collect_garbage
from ckptfs.tools.offline.walk import find_backing_root
from ckptfs.tools.progress import gc_progress


class OfflineError(Exception):
    pass


def backing_path(path: str | None) -> tuple[Path, Path]:
    """(backing root, the backing-store path that ``path`` stands for)."""
    target = Path(path or os.getcwd())
    try:
        mountpoint, rel = find_mount(target)
    except ControlError:
        root = find_backing_root(target)
        if root is None:
            raise OfflineError(
                f"{target} is neither inside a ckptfs mount nor in a backing directory "
                "(no .ckptfs/chunks above it)"
            ) from None
        return root, Path(os.path.abspath(target))
    reply = request(mountpoint, {"op": "stat", "path": rel})
    if not reply.get("ok"):
        raise OfflineError(f"the daemon for {mountpoint} did not answer: {reply.get('error')}")
    root = Path(reply["backing"])
    return root, root / rel if rel else root


def cmd_export(args: argparse.Namespace) -> int:
    root, src = backing_path(args.src)
    try:
        result = export(src, Path(args.dst), backing=root)
    except (ValueError, FileNotFoundError) as exc:
        raise OfflineError(str(exc)) from None
    for problem in result.problems:
        print(f"ckptfs: error: {problem}")
    print(
        f"exported {len(result.files)} file(s), {result.bytes} bytes to {args.dst}"
        + (f"; {len(result.problems)} failed" if result.problems else "")
    )
    return 0 if result.ok else 1


def cmd_gc(args: argparse.Namespace) -> int:
    root, _ = backing_path(args.path)
    # Only a report unless --delete: an operator who runs gc to look loses nothing.
    with gc_progress(sys.stderr) as progress:
        result = collect_garbage(
            root, grace_seconds=args.grace, dry_run=not args.delete, progress=progress
        )
    for problem in result.problems:
        print(f"ckptfs: warning: {problem}")
    if result.refused:
        print(f"ckptfs: error: nothing removed: {result.refused}")
        return 1
    verb = "removed" if args.delete else "would remove"
    for path in result.removed:
        print(f"{verb} {path}")
    print(
        f"{verb} {len(result.removed)} chunk file(s), {result.freed_bytes} bytes; "
        f"{result.referenced} referenced by {result.manifests} manifest(s) kept, "
        f"{result.kept_young} unreferenced kept within the {args.grace:.0f}s grace period"
    )
    if not args.delete and result.removed:
        print("nothing was removed: run with --delete to remove them")
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    root, path = backing_path(args.path)
    result = check(root, path, verify_data=not args.quick)
    for problem in result.problems:
        print(f"ckptfs: error: {problem}")
    # Daemons of this node that serve this backing directory: they hold the
    # bytes of pending manifests that name them, unless they were being
    # written when a daemon died (each is asked: Cache.holds).
    serving = {
        str(d.get("node")): str(d.get("mountpoint"))
        for d in live_daemons()
        if os.path.realpath(str(d["backing"])) == os.path.realpath(root)
    }
    held = {
        node: _held(mountpoint, [p for p in result.pending if node in p.holders])
        for node, mountpoint in serving.items()
    }
    unrecoverable = []
    for p in result.pending:
        holders = ", ".join(p.holders) or "none"
        running = [h for h in p.holders if h in serving]
        holding = [h for h in running if held[h].get(p.path, True)]
        elsewhere = [h for h in p.holders if h not in serving]
        line = f"{p.path}: pending, {p.size} bytes, holders {holders}, age {p.age:.0f}s"
        if holding:
            where = f"{serving[holding[0]]} (node {holding[0]})"
            print(f"{line}: held by the running daemon of {where}")
        elif p.covered:
            # An empty file (its writer died between its create and its
            # close): every daemon reads it as empty, holder or not.
            print(f"{line}: empty, nothing to lose")
        elif running and (now := _now_at(p)) is not None:
            # Saved again, made durable or removed since it was read: the
            # daemons were asked about a version that is gone.
            print(f"{line}: changed during the check ({now}); check it again")
        elif running:
            where = ", ".join(f"{serving[h]} (node {h})" for h in running)
            cause = f"the running daemon of {where} does not hold its bytes"
            if elsewhere:
                # A holder on another machine (the writer, whose buddy runs
                # here) is not asked: it may well have them.
                print(
                    f"ckptfs: warning: {line}: {cause}; its holder(s) {', '.join(elsewhere)} "
                    "do not serve this backing directory on this machine and were not asked"
                )
            else:
                unrecoverable.append(p)
                print(
                    f"ckptfs: error: {line}: lost: {cause} (a daemon died before they were "
                    "durable, or its cache was removed); rewrite or remove it"
                )
        else:
            unrecoverable.append(p)
            print(
                f"ckptfs: error: {line}: not durable and no running daemon of its holders "
                "serves this backing directory; its bytes are lost unless a holder comes back"
            )
    trouble = []
    if not result.ok:
        trouble.append(f"{len(result.damaged_files)} damaged file(s)")
    if unrecoverable:
        trouble.append(f"{len(unrecoverable)} pending file(s) that no running holder has")
    status = "; ".join(trouble) or "all well"
    print(
        f"checked {result.manifests} manifest(s), {result.chunks} chunk(s), "
        f"{result.plain} plain file(s), {len(result.pending)} pending: {status}"
    )
    return 0 if result.ok and not unrecoverable else 1


def _now_at(p: PendingFile) -> str | None:
    """What replaced the pending version ``p`` at its path since the check
    read it, or None if it is still there."""
    try:
        m = read_manifest(p.path)
    except FileNotFoundError:
        return "removed"
    except IsADirectoryError:
        return "a directory now"
    except (OSError, ManifestError):
        return None  # not readable now: the check's verdict stands
    if m is None:
        return "a plain file now"
    if (m.file_id, m.version) != (p.file_id, p.version):
        return "another version now"
    return None if m.state == "pending" else f"{m.state} now"


def _held(mountpoint: str, pending: list[PendingFile]) -> dict[Path, bool]:
    """Whether the daemon of ``mountpoint`` holds each pending file's bytes;
    if it cannot be asked, it is taken to hold them (a warning says so)."""
    if not pending:
        return {}
    try:
        reply = request(
            Path(mountpoint), {"op": "holds", "files": [[p.file_id, p.version] for p in pending]}
        )
        if not reply.get("ok"):
            raise ControlError(str(reply.get("error")))
        return {p.path: bool(h) for p, h in zip(pending, reply["held"], strict=True)}
    except (ControlError, OSError, ValueError, KeyError, TypeError) as exc:
        print(f"ckptfs: warning: could not ask the daemon of {mountpoint} what it holds: {exc}")
        return {}


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("export", help="write plain files (no ckptfs needed) from SRC to DST")
    p.add_argument("src", help="file or directory in the backing store or the mount")
    p.add_argument("dst")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("gc", help="report (with --delete: remove) chunks no manifest references")
    p.add_argument("path", nargs="?", help="backing directory or mount (default: cwd)")
    p.add_argument(
        "--grace",
        type=float,
        default=3600.0,
        help="only remove chunks older than this many seconds (default 3600)",
    )
    p.add_argument(
        "--delete", action="store_true", help="remove them (without it: only report them)"
    )
    p.set_defaults(func=cmd_gc)

    p = sub.add_parser("check", help="verify manifests and chunks under PATH")
    p.add_argument("path", nargs="?")
    p.add_argument(
        "--quick",
        action="store_true",
        help="check chunks exist with the right size, without reading them",
    )
    p.set_defaults(func=cmd_check)
