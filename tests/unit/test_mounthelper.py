"""mount(8)'s arguments as mount.ckptfs reads them (tools/mounthelper.py)."""

from __future__ import annotations

import pytest
from ckptfs.tools.mounthelper import HelperError, parse


def test_options_become_config_keys_and_mounts_own_are_ignored() -> None:
    command, env, fake = parse([
        "/nfs/ckpt", "/ckpt", "-o",
        "rw,config=/etc/ckptfs/c.yaml,cache_size=20%,durability=buddy,_netdev,nofail,"
        "x-systemd.requires=nfs.mount,flush_bandwidth=200MiB,run_dir=/run/x",
    ])  # fmt: skip
    assert command == ["mount", "/ckpt", "--backing", "/nfs/ckpt", "--config", "/etc/ckptfs/c.yaml"]
    assert env == {
        "CKPTFS_CACHE_SIZE": "20%",
        "CKPTFS_DURABILITY": "buddy",
        "CKPTFS_FLUSH_BANDWIDTH": "200MiB",
        "CKPTFS_RUN_DIR": "/run/x",
    }
    assert not fake
    assert parse(["-f", "-t", "fuse.ckptfs", "a", "b"])[2]  # -f: pretend
    assert parse(["a", "b", "-ocache_size=1GiB", "-sv"])[1] == {"CKPTFS_CACHE_SIZE": "1GiB"}


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["a", "b", "-o", "ro"], "read-only"),
        (["a", "b", "-o", "bogus=1"], "'bogus': not a ckptfs config key"),
        (["a", "b", "-o", "peers=x"], "'peers'"),
        (["a", "b", "-o", "allow_other"], "takes key=value"),
        (["a"], "usage"),
        (["a", "b", "-N", "/proc/1/ns/mnt"], "another mount namespace"),
    ],
)
def test_what_it_cannot_do_is_said(argv: list[str], said: str) -> None:
    with pytest.raises(HelperError) as refused:
        parse(argv)
    assert said in str(refused.value)
