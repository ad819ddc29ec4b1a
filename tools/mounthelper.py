"""``mount.ckptfs``: what mount(8) runs for ``-t ckptfs`` and ``-t fuse.ckptfs``
(and so for /etc/fstab entries of those types).

It is the ``ckptfs`` console script under another name (a symlink in
/sbin: ``mount.ckptfs`` and ``mount.fuse.ckptfs``), called as
``mount.ckptfs SPEC DIR [-sfnv] [-o OPTIONS]``: SPEC is the backing
directory, DIR the mountpoint. Each option ``key=value`` is the config key
whose environment name is ``CKPTFS_<KEY>`` (``cache_size=20%``,
``durability=buddy``, ``node=n1``, ``run_dir=/run/ckptfs``), ``config=FILE``
names the config file, and the options mount(8) and systemd use for their
own purposes (``_netdev``, ``nofail``, ``x-systemd.*``...) are ignored::

    /nfs/ckpt  /ckpt  fuse.ckptfs  config=/etc/ckptfs/ckptfs.yaml,_netdev,nofail  0 0
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

from ckptfs.fs.config import SCHEMA, ConfigError, env_name

NAMES = ("mount.ckptfs", "mount.fuse.ckptfs")
# mount(8)'s generic options, and those of fstab tools and systemd: not ours.
IGNORED = {
    "defaults", "auto", "noauto", "user", "nouser", "users", "owner", "group", "_netdev",
    "nofail", "rw", "suid", "nosuid", "dev", "nodev", "exec", "noexec", "async", "atime",
    "noatime", "relatime", "strictatime", "lazytime", "nolazytime",
}  # fmt: skip
IGNORED_PREFIXES = ("x-", "comment=", "fsname=", "subtype=")
_BY_OPTION = {env_name(key)[len("CKPTFS_") :].lower(): key for key in SCHEMA if key != "peers"}


class HelperError(ValueError):
    pass


def parse(argv: list[str]) -> tuple[list[str], dict[str, str], bool]:
    """mount(8)'s arguments: the ``ckptfs mount`` arguments, the environment
    they need, and whether mount(8) asked only to pretend (``-f``)."""
    positional: list[str] = []
    options: list[str] = []
    fake = False
    args = iter(argv)
    for arg in args:
        if arg == "-o":
            options += next(args, "").split(",")
        elif arg.startswith("-o"):
            options += arg[2:].split(",")
        elif arg == "-t":
            next(args, None)  # the type: ours
        elif arg == "-N":
            # mount(8) would mount in another mount namespace: this helper
            # cannot, and mounting here instead would be a mount nobody sees.
            raise HelperError("mount -N (another mount namespace) is not supported")
        elif arg.startswith("-") and len(arg) > 1:
            fake = fake or "f" in arg[1:]  # -s sloppy, -n no mtab, -v verbose: nothing to do
        else:
            positional.append(arg)
    if len(positional) != 2:
        raise HelperError("usage: mount.ckptfs BACKING_DIR MOUNTPOINT [-o key=value,...]")
    spec, mountpoint = positional
    command = ["mount", mountpoint, "--backing", spec]
    env: dict[str, str] = {}
    for option in filter(None, options):
        if option in IGNORED or option.startswith(IGNORED_PREFIXES):
            continue
        if option == "ro":
            raise HelperError("ckptfs cannot be mounted read-only (option ro)")
        name, sep, value = option.partition("=")
        if not sep:
            raise HelperError(f"unknown mount option {option!r} (ckptfs takes key=value)")
        if name == "config":
            command += ["--config", value]
        elif name in _BY_OPTION:
            env[env_name(_BY_OPTION[name])] = value
        else:
            raise HelperError(f"unknown mount option {name!r}: not a ckptfs config key")
    return command, env, fake


def run(argv: list[str], cli_main: Callable[[list[str]], int]) -> int:
    try:
        command, env, fake = parse(argv)
    except (HelperError, ConfigError) as exc:
        print(f"mount.ckptfs: {exc}", file=sys.stderr)
        return 1
    if fake:
        return 0
    os.environ.update(env)
    return cli_main(command)
