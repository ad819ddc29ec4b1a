"""Two daemons on this machine form a cluster: config validated at mount,
authenticated heartbeats, peers in `ckptfs stat`, a dead node noticed."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from pathlib import Path

import pytest
from children import next_line
from clusters import cluster_config, peers_of
from mounts import Mount, free_port, lines_of_a_killed_peer
from waits import wait_for

MiB = 1 << 20


def test_two_nodes_see_each_other_and_notice_a_death(mounts, tmp_path):
    ports = {"n1": free_port(), "n2": free_port()}
    config = cluster_config(tmp_path, ports)
    n1, n2 = mounts("n1"), mounts("n2")
    n1.mount("--config", str(config), "--node", "n1")
    n2.mount("--config", str(config), "--node", "n2")
    wait_for(lambda: peers_of(n1)["n2"]["alive"] and peers_of(n2)["n1"]["alive"], 20, "alive")
    p = peers_of(n1)["n2"]
    assert p["address"] == f"127.0.0.1:{ports['n2']}" and p["buddy"] is True
    assert p["last_heartbeat_age"] is not None and p["last_heartbeat_age"] < 5
    assert "peers:        n2 alive (buddy)" in n1.cli("stat", str(n1.mnt)).stdout
    assert "peer n2:      127.0.0.1" in n1.cli("stat", str(n1.mnt), "--verbose").stdout
    # With peers, durability is buddy by default: a closed file is held by both.
    (n1.mnt / "x.bin").write_bytes(b"x" * 1000)
    assert n1.stat()["durability"] == "buddy"
    x = {f["path"]: f for f in n1.stat()["files"]}["x.bin"]
    assert x["state"] == "durable" or x["holders"] == ["n1", "n2"], x

    n2.kill()
    # A node's death is for the operator to see.
    n1.allowed_log += lines_of_a_killed_peer("n2")
    wait_for(lambda: not peers_of(n1)["n2"]["alive"], 20, "n2 declared dead")
    assert peers_of(n1)["n2"]["state"] == "dead"
    assert "peer 'n2' at 127.0.0.1" in n1.log() and "is dead" in n1.log()
    n1.umount()


def test_a_node_with_another_node_list_is_refused(mounts, tmp_path):
    ports = {"n1": free_port(), "n2": free_port()}
    n1, n2 = mounts("n1"), mounts("n2")
    n1.mount("--config", str(cluster_config(tmp_path, ports)), "--node", "n1")
    # n2 believes in a third node: its cluster hash differs.
    other = cluster_config(tmp_path, {**ports, "n3": free_port()})
    n2.mount("--config", str(other), "--node", "n2")
    for m in (n1, n2):
        m.allowed_log += ["cluster hash mismatch", "refus", "is dead", "lost connection"]
    wait_for(lambda: "mismatch" in n1.log() and "mismatch" in n2.log(), 20, "refusals logged")
    assert not peers_of(n1)["n2"]["alive"] and not peers_of(n2)["n1"]["alive"]


@pytest.mark.parametrize(
    ("extra", "key", "message"),
    [
        ({"buddies": "{n1: n9}"}, "peers.buddies", "n9"),
        ({"listen": "nonsense"}, "peers.listen", "host:port"),
    ],
)
def test_bad_peer_config_fails_the_mount_naming_the_key(mounts, tmp_path, extra, key, message):
    m = mounts()
    config = cluster_config(tmp_path, {"n1": free_port(), "n2": free_port()}, **extra)
    proc = m.cli("mount", str(m.mnt), "--backing", str(m.backing), "--config", str(config),
                 "--node", "n1", check=False)  # fmt: skip
    assert proc.returncode == 1
    line = proc.stderr.strip()
    assert line.startswith("ckptfs: error:") and key in line and message in line, line
    assert len(line.splitlines()) == 1


def test_mount_refuses_a_node_missing_from_nodes_and_an_open_secret(mounts, tmp_path):
    m = mounts()
    config = cluster_config(tmp_path, {"n1": free_port(), "n2": free_port()})
    proc = m.cli("mount", str(m.mnt), "--backing", str(m.backing), "--config", str(config),
                 "--node", "n7", check=False)  # fmt: skip
    assert proc.returncode == 1 and "n7" in proc.stderr and "node" in proc.stderr
    (tmp_path / "secret").chmod(0o644)
    proc = m.cli("mount", str(m.mnt), "--backing", str(m.backing), "--config", str(config),
                 "--node", "n1", check=False)  # fmt: skip
    assert proc.returncode == 1 and "peers.secret_file" in proc.stderr, proc.stderr


def _slow_writer_and_reader(
    mounts, tmp_path: Path, bandwidth: str = "32KiB"
) -> tuple[Mount, Mount]:
    """n1 writes and is slow to flush (a bandwidth cap, durability local:
    its files stay pending, held by n1 alone); n2 reads them from n1."""
    ports = {"n1": free_port(), "n2": free_port()}
    config = cluster_config(tmp_path, ports)
    n1, n2 = mounts("n1"), mounts("n2")
    n1.mount("--config", str(config), "--node", "n1",
             env={"CKPTFS_FLUSH_BANDWIDTH": bandwidth, "CKPTFS_DURABILITY": "local"})  # fmt: skip
    n2.mount("--config", str(config), "--node", "n2")
    wait_for(lambda: peers_of(n2)["n1"]["alive"], 20, "n1 alive for n2")
    return n1, n2


def test_a_file_pending_on_another_node_is_read_from_it(mounts, tmp_path):
    """n1 closes a file and is slow to flush it (a bandwidth cap): n2 reads
    its bytes from n1, verified. When n1 dies, what n2 has not read yet is
    EIO with a reason (bytes fetched ahead before the death are served:
    they are that version, verified), and stat lists the file as lost;
    never wrong bytes.
    (Durability local: with buddy, n2 would hold the file and take it over;
    tests/cluster/test_buddy.py covers that.)"""
    n1, n2 = _slow_writer_and_reader(mounts, tmp_path)
    # Larger than what n2's read-ahead fetches beyond its reads (4 blocks of
    # 4 MiB), so that part of it is still only on n1 when n1 dies.
    data = os.urandom(40 * MiB + 12345)
    (n1.mnt / "ckpt.pt").write_bytes(data)
    assert n1.file_state("ckpt.pt") in ("dirty", "flushing")  # pending, not durable

    with open(n2.mnt / "ckpt.pt", "rb") as f:
        head = f.read(3 * MiB)
    assert head == data[: 3 * MiB]
    s = n2.stat()
    assert {f["path"]: f["state"] for f in s["files"]}["ckpt.pt"] == "remote"
    assert s["peer_reads"]["bytes_fetched"] >= 3 * MiB
    assert n1.stat()["peer_reads"]["bytes_served"] >= 3 * MiB
    with pytest.raises(OSError) as err:
        open(n2.mnt / "ckpt.pt", "ab").close()  # only a full rewrite may replace it here
    assert err.value.errno == errno.EBUSY

    n1.kill()
    n2.allowed_log += lines_of_a_killed_peer("n1") + [
        "is lost here",
        "read of ckpt.pt failed",
    ]
    fd = os.open(n2.mnt / "ckpt.pt", os.O_RDONLY | os.O_DIRECT)
    try:
        with pytest.raises(OSError) as err:
            os.pread(fd, MiB, 36 * MiB)
        assert err.value.errno == errno.EIO
    finally:
        os.close(fd)
    lost = n2.stat()["lost"]
    assert [item["path"] for item in lost] == ["ckpt.pt"]
    assert "n1" in lost[0]["reason"]


def _version(m: Mount, path: str) -> str:
    return next(f["version"] for f in m.stat()["files"] if f["path"] == path)


def test_a_file_changed_on_its_node_while_open_on_another_is_stale_there_not_lost(mounts, tmp_path):
    """n2 has a file open that is pending on n1, which then rewrites it in
    place, or replaces it (torch.save to a temporary name, os.replace), and
    n2 also opens the new version. n2's old handle then reads only the bytes
    it fetched already: a read of others gets ESTALE, as NFS answers a reader
    of a file that another client changed under it; never EIO with a false
    "is lost here" (the stress run, tests/cluster/stress_mount.py, found that), and
    never zeros (a second reader found that the old version, retired on n2
    once n2 loaded the new one, read as zeros). A new open reads the new
    version whole."""
    n1, n2 = _slow_writer_and_reader(mounts, tmp_path)
    for change in ("rewrite", "replace"):
        name = f"{change}.pt"
        # Larger than what n2 fetches ahead of its reads (4 blocks of 4 MiB).
        old, new = os.urandom(40 * MiB + 1), os.urandom(40 * MiB + 2)
        (n1.mnt / name).write_bytes(old)
        fd = os.open(n2.mnt / name, os.O_RDONLY | os.O_DIRECT)
        try:
            assert os.pread(fd, MiB, 0) == old[:MiB]
            version = _version(n1, name)
            if change == "rewrite":
                (n1.mnt / name).write_bytes(new)  # in place: the same file, a new version
            else:
                (n1.mnt / "tmp").write_bytes(new)
                os.replace(n1.mnt / "tmp", n1.mnt / name)
            with open(n2.mnt / name, "rb") as f:  # n2 loads the new version
                assert f.read(MiB) == new[:MiB]
            # n1 serves no version that is not the one at its name: a replaced
            # file it keeps for open handles may still be written through them.
            assert all(f["version"] != version for f in n1.stat()["files"] if f["path"] == name)
            with pytest.raises(OSError) as err:
                os.pread(fd, MiB, 36 * MiB)
            assert err.value.errno == errno.ESTALE, (change, err.value)
            assert n2.stat()["lost"] == []
        finally:
            os.close(fd)
        assert (n2.mnt / name).read_bytes() == new
    assert n2.stat()["lost"] == []
    n1.kill()  # its files are not durable (the bandwidth cap): no clean unmount
    n2.allowed_log += lines_of_a_killed_peer("n1")


# Opens a file for an in-place change (argv: path, offset, patch length,
# truncate size or -1), changes it once a line ("go") and the patch arrive on
# stdin, says "changed", and keeps it open until another line arrives. In a
# process of its own: a fork of the test process (every CLI call) would close
# an inherited descriptor, and that close is a FLUSH that publishes the change.
IN_PLACE_WRITER = """
import os, sys
path, off, n, size = sys.argv[1], *map(int, sys.argv[2:])
fd = os.open(path, os.O_RDWR)
sys.stdin.buffer.readline()
if size >= 0:
    os.ftruncate(fd, size)
else:
    os.pwrite(fd, sys.stdin.buffer.read(n), off)
print("changed", flush=True)
sys.stdin.readline()
os.close(fd)
"""


@pytest.mark.parametrize("change", ["r+b", "truncate above 0"])
def test_a_file_its_writer_changes_in_place_is_stale_elsewhere_not_lost(mounts, tmp_path, change):
    """n2 has a file open that is pending on n1; a process on n1 opens it
    for an in-place change (r+b, or a truncate to a size above 0 through
    the handle) and keeps it open. n1 then serves no version of it, and the
    manifest still names the old version as pending until that close. n2's
    read of a block it has not fetched is ESTALE, as for a file replaced
    elsewhere, never EIO with a false "is lost here" (before: EIO, an ERROR
    line, and the file listed as lost). Once the writer closes, a new open
    on n2 reads the changed file whole."""
    n1, n2 = _slow_writer_and_reader(mounts, tmp_path)
    old = os.urandom(40 * MiB + 7)
    (n1.mnt / "ckpt.pt").write_bytes(old)
    version = _version(n1, "ckpt.pt")
    patch = os.urandom(3 * MiB + 5)
    if change == "r+b":
        args, new = [20 * MiB, len(patch), -1], old[: 20 * MiB] + patch + old[23 * MiB + 5 :]
    else:
        args, new = [0, 0, 38 * MiB], old[: 38 * MiB]
    fd = os.open(n2.mnt / "ckpt.pt", os.O_RDONLY | os.O_DIRECT)
    writer = subprocess.Popen(
        [sys.executable, "-c", IN_PLACE_WRITER, str(n1.mnt / "ckpt.pt"), *map(str, args)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE,
    )  # fmt: skip
    try:
        assert os.pread(fd, MiB, 0) == old[:MiB]
        assert writer.stdin is not None and writer.stdout is not None
        writer.stdin.write(b"go\n" + (patch if change == "r+b" else b""))
        writer.stdin.flush()
        assert next_line(writer) == "changed"
        assert _version(n1, "ckpt.pt") == version  # not published before the close
        with pytest.raises(OSError) as err:
            os.pread(fd, MiB, 36 * MiB)  # beyond what n2 fetched ahead
        assert err.value.errno == errno.ESTALE, err.value
        assert n2.stat()["lost"] == []
        writer.stdin.write(b"close\n")
        writer.stdin.close()
        assert writer.wait(timeout=60) == 0
        assert _version(n1, "ckpt.pt") != version
    finally:
        os.close(fd)
        writer.kill()
        writer.wait(timeout=60)
    assert (n2.mnt / "ckpt.pt").read_bytes() == new
    assert n2.stat()["lost"] == []
    n1.kill()  # its files are not durable (the bandwidth cap): no clean unmount
    n2.allowed_log += lines_of_a_killed_peer("n1")


def test_a_reader_goes_on_from_the_store_once_the_writer_node_unmounted(mounts, tmp_path):
    """n2 reads a file pending on n1; n1 is unmounted cleanly, which makes
    the file durable in the store first. n2's reads of bytes it has not
    fetched yet come from the store: the whole file, through the handle n2
    opened while the file was still pending. (Before, n2 took the file for
    lost: EIO, though every byte was in the store.)"""
    # Pending for about 5 s after its close: the umount waits for the rest.
    n1, n2 = _slow_writer_and_reader(mounts, tmp_path, bandwidth="8MiB")
    data = os.urandom(40 * MiB + 4321)
    (n1.mnt / "ckpt.pt").write_bytes(data)
    assert n1.file_state("ckpt.pt") in ("dirty", "flushing")
    fd = os.open(n2.mnt / "ckpt.pt", os.O_RDONLY | os.O_DIRECT)
    try:
        assert os.pread(fd, MiB, 0) == data[:MiB]
        assert {f["path"]: f["state"] for f in n2.stat()["files"]}["ckpt.pt"] == "remote"
        n1.umount()  # flushes everything to the store, then goes
        n2.allowed_log += lines_of_a_killed_peer("n1")  # gone, as a killed node is
        got = bytearray()
        while chunk := os.pread(fd, 4 * MiB, len(got)):
            got += chunk
        assert got == data
    finally:
        os.close(fd)
    assert n2.stat()["lost"] == []


def test_a_removed_file_of_another_node_rewritten_through_a_handle_reads_what_was_written(
    mounts, tmp_path
):
    """n2 removes a file pending on n1 while n2 has it open, then rewrites it
    through that handle (/proc/self/fd, O_TRUNC): its bytes are n2's from
    then on and must read back as written, not as the old version's from
    its holder (a second reader found that a removed file of another node
    still read from its holders after such a rewrite)."""
    n1, n2 = _slow_writer_and_reader(mounts, tmp_path)
    old, new = os.urandom(2 * MiB), os.urandom(MiB + 7)
    (n1.mnt / "x.pt").write_bytes(old)
    fd = os.open(n2.mnt / "x.pt", os.O_RDONLY | os.O_DIRECT)
    try:
        assert os.pread(fd, MiB, 0) == old[:MiB]
        os.unlink(n2.mnt / "x.pt")
        wfd = os.open(f"/proc/self/fd/{fd}", os.O_RDWR | os.O_TRUNC | os.O_DIRECT)
        try:
            assert os.write(wfd, new) == len(new)
            assert os.pread(wfd, 2 * MiB, 0) == new
        finally:
            os.close(wfd)
        assert os.pread(fd, 2 * MiB, 0) == new
    finally:
        os.close(fd)
    n1.kill()  # its files are not durable (the bandwidth cap): no clean unmount
    n2.allowed_log += lines_of_a_killed_peer("n1")
