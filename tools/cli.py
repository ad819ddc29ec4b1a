"""The `ckptfs` command line."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ckptfs import __version__
from ckptfs.fs.config import ConfigError, load_config
from ckptfs.fs.daemon.preflight import (
    MountError,
    check_backing,
    check_cache_dir,
    check_mountpoint,
    is_mounted,
    run_files,
)
from ckptfs.tools import history, mounthelper
from ckptfs.tools.control import ControlError, daemon_pid, find_mount, request, run_dir
from ckptfs.tools.offline import cli as offline_cli
from ckptfs.tools.offline.cli import OfflineError
from ckptfs.tools.progress import Progress, bars
from ckptfs.tools.statfmt import format_stat, shown

MOUNT_TIMEOUT = 60.0


class CliError(Exception):
    pass


# Mount flags that set config keys: (flag, argparse dest, config key, is a path).
MOUNT_FLAGS = [
    ("--backing", "backing", "backing", True),
    ("--cache-size", "cache_size", "cache.size", False),
    ("--cache-dir", "cache_dir", "cache.dir", True),
    ("--durability", "durability", "durability", False),
    ("--node", "node", "node", False),
    ("--log-level", "log_level", "log_level", False),
]


def _mount_overrides(args: argparse.Namespace) -> dict[str, Any]:
    return {key: getattr(args, dest) for _, dest, key, _ in MOUNT_FLAGS}


def cmd_mount(args: argparse.Namespace) -> int:
    config = load_config(args.config, _mount_overrides(args))
    mountpoint = check_mountpoint(Path(args.mountpoint))
    config.backing = check_backing(config.backing, mountpoint)
    check_cache_dir(config.cache_dir, mountpoint, config.cache_size)
    sock, _, log_file = run_files(config.run_dir, mountpoint)
    config.log_file = config.log_file or log_file
    if args.foreground:
        from ckptfs.fs.daemon.daemon import run_daemon
        from ckptfs.fs.daemon.logs import setup_logging

        setup_logging(
            config.log_file,
            foreground=not os.environ.get("CKPTFS_DAEMONIZED"),
            level=config.log_level,
            form=config.log_format,
        )
        run_daemon(config, mountpoint)
        return 0
    return _spawn_daemon(args, mountpoint, config.run_dir, config.log_file)


def _spawn_daemon(args: argparse.Namespace, mountpoint: Path, run: Path, log_file: Path) -> int:
    argv = [sys.executable, "-m", "ckptfs", "mount", str(mountpoint), "--foreground"]
    # The daemon runs with cwd "/": relative paths are resolved here.
    if args.config is not None:
        argv += ["--config", str(Path(args.config).resolve())]
    for flag, dest, _, is_path in MOUNT_FLAGS:
        value = getattr(args, dest)
        if value is not None:
            argv += [flag, str(Path(value).resolve()) if is_path else value]
    run.mkdir(parents=True, exist_ok=True)
    log_file.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "CKPTFS_DAEMONIZED": "1", "CKPTFS_RUN_DIR": str(run)}
    start_offset = log_file.stat().st_size if log_file.exists() else 0
    # The daemon's log names every user's files: root's alone (fs/daemon/logs.py).
    log_fd = os.open(log_file, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
    with open(log_fd, "ab") as log_out:
        child = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log_out,
            stderr=log_out,
            start_new_session=True,
            env=env,
            cwd="/",
        )
    deadline = time.monotonic() + MOUNT_TIMEOUT
    while time.monotonic() < deadline:
        if child.poll() is not None:
            raise CliError(
                f"daemon exited ({child.returncode}): {_last_error(log_file, start_offset)}"
            )
        if is_mounted(mountpoint):
            try:
                reply = request(mountpoint, {"op": "ping"}, timeout=5, run=run)
            except ControlError:
                reply = {}
            if reply.get("ok"):
                print(f"mounted {mountpoint} (pid {child.pid}, log {log_file})")
                return 0
        time.sleep(0.05)
    _stop_unready(child, mountpoint)
    raise CliError(
        f"mount of {mountpoint} did not become ready within {MOUNT_TIMEOUT:.0f}s (see {log_file})"
    )


def _stop_unready(child: subprocess.Popen[bytes], mountpoint: Path) -> None:
    """Stop a daemon that never answered, leaving no mount behind: SIGTERM
    (it unmounts; nothing was written through it), then SIGKILL and a lazy
    unmount, since a killed daemon leaves its mount dead (ENOTCONN)."""
    child.terminate()
    try:
        child.wait(10)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait(10)
    if is_mounted(mountpoint):
        _detach(mountpoint)


def _detach(mountpoint: Path) -> None:
    """Lazy unmount: the mount goes now, whatever still uses it."""
    subprocess.run(["fusermount3", "-u", "-z", str(mountpoint)], check=False)


def _last_error(log_file: Path, offset: int) -> str:
    try:
        with open(log_file, "rb") as f:
            f.seek(offset)
            lines = [
                ln.strip() for ln in f.read().decode(errors="replace").splitlines() if ln.strip()
            ]
    except OSError:
        return f"see {log_file}"
    for line in reversed(lines):
        if "error" in line.lower():
            return line
    return lines[-1] if lines else f"see {log_file}"


def cmd_umount(args: argparse.Namespace) -> int:
    mountpoint = Path(os.path.abspath(args.mountpoint))
    if not is_mounted(mountpoint):  # resolving it would stat the (maybe wedged) mount
        try:
            mountpoint = mountpoint.resolve()
        except OSError:
            pass
    if not is_mounted(mountpoint):
        raise CliError(f"{mountpoint} is not mounted")
    run = run_dir(args.config)
    pid = daemon_pid(mountpoint, run)

    def unmount() -> dict[str, Any]:
        return request(
            mountpoint,
            {"op": "unmount", "timeout": args.timeout, "force": args.force},
            timeout=None,
            run=run,
        )

    try:
        if args.force:
            reply = unmount()
        else:
            stat = _stat_of(run, mountpoint, "")
            reply = Progress("unmounting", mountpoint, stat, whole_mount=True).run(unmount)
    except ControlError as exc:
        if not args.force:
            raise CliError(f"{exc}; use --force to detach the mount anyway") from None
        reply = {"ok": False, "error": str(exc)}
    if not reply.get("ok"):
        if not args.force:
            raise CliError(f"not unmounted: {_refusal(reply)}")
        _detach(mountpoint)
    _wait_gone(mountpoint, pid, 60)
    left = int(reply.get("not_durable_count") or 0)
    if reply.get("forced") and left:
        names = reply.get("not_durable") or []
        listed = "".join(f"\n  {shown(name)}" for name in names[:20])
        more = f"\n  ... and {len(names) - 20} more" if len(names) > 20 else ""
        print(
            f"unmounted {mountpoint} without flushing: {left} file(s) not durable stay in "
            f"{reply.get('cache')} for the next mount of it{listed}{more}"
        )
    else:
        print(f"unmounted {mountpoint}")
    return 0


def _wait_gone(mountpoint: Path, pid: int | None, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = pid is not None and _is_daemon(pid)
        if not alive and not is_mounted(mountpoint):
            return
        time.sleep(0.05)
    raise CliError(f"the daemon for {mountpoint} did not exit within {timeout:.0f}s")


def _is_daemon(pid: int) -> bool:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return b"ckptfs" in cmdline


def _daemon_for(path: str | None) -> tuple[Path, str]:
    try:
        return find_mount(Path(path or os.getcwd()))
    except ControlError as exc:
        raise CliError(str(exc)) from None


def _ask(
    run: Path, mountpoint: Path, payload: dict[str, Any], timeout: float | None = 30
) -> dict[str, Any]:
    try:
        reply = request(mountpoint, payload, timeout, run=run)
    except ControlError as exc:
        raise CliError(str(exc)) from None
    return reply


def cmd_stat(args: argparse.Namespace) -> int:
    mountpoint, rel = _daemon_for(args.path)
    run = run_dir(args.config)
    while True:
        reply = _ask(run, mountpoint, {"op": "stat", "path": rel})
        if not reply.get("ok"):
            raise CliError(reply.get("error", "stat failed"))
        reply.pop("ok")
        if args.json:
            print(json.dumps(reply, indent=2))
        else:
            if args.watch:
                print("\033[H\033[J", end="")
            print(format_stat(reply, verbose=args.verbose))
            if args.watch:
                width = shutil.get_terminal_size().columns
                print("\n".join(bars(reply.get("files", []), width)))
        if not args.watch:
            return 0
        time.sleep(args.interval)


def _stat_of(run: Path, mountpoint: Path, rel: str) -> Callable[[], dict[str, Any]]:
    """The daemon's stat of ``rel``, bounded: what Progress polls."""
    return lambda: request(mountpoint, {"op": "stat", "path": rel}, timeout=10, run=run)


def _refusal(reply: dict[str, Any]) -> str:
    """The daemon's error, and the files it names, if any."""
    error = str(reply.get("error", "refused"))
    files = reply.get("not_durable") or []
    if isinstance(files, str):
        files = [files]
    return f"{error}: {', '.join(files)}" if files else error


def cmd_flush(args: argparse.Namespace) -> int:
    mountpoint, rel = _daemon_for(args.path)
    run = run_dir(args.config)

    def flush() -> dict[str, Any]:
        return _ask(
            run,
            mountpoint,
            {"op": "flush", "path": rel, "wait": args.wait, "timeout": args.timeout},
            timeout=None if args.wait else 30,
        )

    if args.wait:
        stat = _stat_of(run, mountpoint, rel)
        reply = Progress("flushing", mountpoint / rel, stat, whole_mount=not rel).run(flush)
    else:
        reply = flush()
    if not reply.get("ok"):
        raise CliError(_refusal(reply))
    what = "durable" if args.wait else "queued"
    print(f"{reply.get('files', 0)} file(s) {what} under {mountpoint / rel}")
    return 0


def cmd_history(args: argparse.Namespace) -> int:
    mountpoint, rel = _daemon_for(args.path)
    try:
        payload = history.request_of(args, rel)
    except history.WhenError as exc:
        raise CliError(str(exc)) from None
    reply = _ask(run_dir(args.config), mountpoint, payload, timeout=120)
    if not reply.get("ok"):
        raise CliError(reply.get("error", "history failed"))
    print(history.show(reply, args.json))
    return 0


def cmd_evict(args: argparse.Namespace) -> int:
    mountpoint, rel = _daemon_for(args.path)
    reply = _ask(run_dir(args.config), mountpoint, {"op": "evict", "path": rel})
    if not reply.get("ok"):
        raise CliError(reply.get("error", "evict failed"))
    kept = reply.get("not_durable", [])
    print(
        f"evicted {reply['freed'] >> 20} MiB under {mountpoint / rel}"
        + (f"; kept {len(kept)} file(s) that are not durable yet" if kept else "")
    )
    return 0


CONFIG_HELP = (
    "the config file the mount used, if it sets run_dir (where the control sockets are; "
    "CKPTFS_RUN_DIR overrides it)"
)


class VersionAction(argparse.Action):
    """``--version``: prints ``ckptfs <version>`` and exits."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, help="print the version and exit")

    def __call__(self, parser: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> None:
        print(f"ckptfs {__version__}")
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ckptfs", description=__doc__)
    parser.add_argument("--version", action=VersionAction)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("mount", help="mount ckptfs at MOUNTPOINT over a backing directory")
    p.add_argument("mountpoint")
    p.add_argument("--backing", help="backing directory (the NFS/SFS checkpoint directory)")
    p.add_argument("--config", help="YAML config file")
    p.add_argument("--cache-size", help="RAM cache budget: bytes, KiB/MiB/GiB, or %% of RAM")
    p.add_argument("--cache-dir", help="tmpfs directory for the cache (default /dev/shm/ckptfs)")
    p.add_argument("--durability", choices=["local", "buddy", "backing"])
    p.add_argument("--node", help="this node's name (default: hostname)")
    p.add_argument("--log-level", choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"],
                   type=str.upper, help="the daemon's log level (default INFO)")  # fmt: skip
    p.add_argument("--foreground", action="store_true", help="do not daemonize")
    p.set_defaults(func=cmd_mount)

    p = sub.add_parser("umount", help="flush everything to the backing store, then unmount")
    p.add_argument("mountpoint")
    p.add_argument("--timeout", type=float, help="give up waiting for the flush after seconds")
    p.add_argument(
        "--force",
        action="store_true",
        help="unmount at once, without flushing (what is not durable stays in the tmpfs "
        "cache, with its journal, for the next mount)",
    )
    p.add_argument("--config", help=CONFIG_HELP)
    p.set_defaults(func=cmd_umount)

    p = sub.add_parser(
        "stat",
        help="health, bytes not yet durable and when they will be, backpressure, peers, "
        "lost files and recent checkpoints",
    )
    p.add_argument("path", nargs="?")
    p.add_argument(
        "-v", "--verbose", action="store_true", help="also the internals, and every file"
    )
    p.add_argument("--json", action="store_true", help="everything, as JSON")
    p.add_argument("--watch", action="store_true", help="refresh until interrupted")
    p.add_argument("--interval", type=float, default=1.0)
    p.add_argument("--config", help=CONFIG_HELP)
    p.set_defaults(func=cmd_stat)

    p = sub.add_parser("flush", help="start (and wait for) persistence under PATH")
    p.add_argument("path", nargs="?")
    p.add_argument("--wait", action="store_true")
    p.add_argument("--timeout", type=float)
    p.add_argument("--config", help=CONFIG_HELP)
    p.set_defaults(func=cmd_flush)

    p = sub.add_parser("evict", help="drop durable cached bytes under PATH from RAM")
    p.add_argument("path", nargs="?")
    p.add_argument("--config", help=CONFIG_HELP)
    p.set_defaults(func=cmd_evict)

    history.add_parser(sub, CONFIG_HELP).set_defaults(func=cmd_history)

    offline_cli.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    if argv is None and Path(sys.argv[0]).name in mounthelper.NAMES:
        return mounthelper.run(sys.argv[1:], main)  # run by mount(8)
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (CliError, ConfigError, MountError, ControlError, OfflineError) as exc:
        print(f"ckptfs: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # `ckptfs stat | head`: the reader went away; not an error of ours.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
