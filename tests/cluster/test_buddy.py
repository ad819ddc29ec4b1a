"""Buddy mirroring and takeover, with real daemons on this machine.

Each node has its own mountpoint, cache and loopback port; they share one
backing directory (the NFS stand-in). The ring n1 -> n2 -> n3 -> n1 makes n2
the buddy of n1, n3 of n2 and n1 of n3.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from children import next_line
from ckptfs.fs.store.manifest import read_manifest
from clusters import cluster, cluster_config, peers_of
from manifests import durable_now
from mounts import Mount, free_port
from users import GROUP, USER, run_as
from waits import wait_for

MiB = 1 << 20
SLOW = "32KiB"  # a flush cap that keeps a file pending for the whole test
PEER_LOGS = ["lost connection to peer", "peer 'n", "dropped connection from peer"]


def file_info(m: Mount, rel: str) -> dict | None:
    return {f["path"]: f for f in m.stat()["files"]}.get(rel)


def test_a_closed_file_is_in_its_buddys_ram_and_read_from_peers_before_any_flush(mounts, tmp_path):
    slow = {"CKPTFS_FLUSH_BANDWIDTH": SLOW, "CKPTFS_CHUNK_SIZE": "1MiB"}
    nodes = cluster(mounts, tmp_path, ["n1", "n2", "n3"], {n: slow for n in ("n1", "n2", "n3")})
    n1, n2, n3 = nodes["n1"], nodes["n2"], nodes["n3"]
    data = os.urandom(6 * MiB + 4321)
    start = time.monotonic()
    (n1.mnt / "ckpt.pt").write_bytes(data)
    info = file_info(n1, "ckpt.pt")
    assert info is not None and info["holders"] == ["n1", "n2"], info
    assert info["mirror"] == "acked" and info["state"] in ("mirrored", "flushing"), info
    mirroring = n2.stat()["mirroring"]
    assert mirroring["mirrored_bytes"] >= len(data) and mirroring["mirrors"] == 1, mirroring
    assert "to n2: 1 file(s) mirrored" in n1.cli("stat", str(n1.mnt), "--verbose").stdout
    assert "for n1: 1 mirror(s)" in n2.cli("stat", str(n2.mnt), "--verbose").stdout
    # The RAM each needed: the writer its own bytes, the buddy the mirror.
    pages = -(-len(data) // MiB) * MiB
    assert n1.stat()["cache"]["peak"]["own_dirty"] == pages
    assert n1.stat()["cache"]["peak"]["mirrored"] == 0
    assert n2.stat()["cache"]["peak"]["own_dirty"] == 0
    assert n2.stat()["cache"]["peak"]["mirrored"] == pages
    peaks = n2.cli("stat", str(n2.mnt), "--verbose").stdout
    assert "+ mirrored for others 7.0 MiB at most" in peaks
    writer = n1.stat()["mirroring"]["writer"]
    assert writer["buddy"] == "n2" and writer["bytes_sent"] >= len(data) and not writer["fallbacks"]
    assert time.monotonic() - start < 30

    # The buddy reads it from its own RAM, another node from a holder: no
    # chunk is read from the backing store by either.
    assert (n2.mnt / "ckpt.pt").read_bytes() == data
    assert (n3.mnt / "ckpt.pt").read_bytes() == data
    assert n2.stat()["peer_reads"]["bytes_fetched"] == 0
    assert n3.stat()["peer_reads"]["bytes_fetched"] >= len(data)
    for m in (n2, n3):
        assert m.stat()["cache"]["chunk_reads"] == 0
    # Every flush is capped, so nothing here becomes durable and a clean
    # unmount would wait out its timeout on each node (45 s of CI): they
    # are killed, and the buddy may have begun its takeover of n1's file
    # meanwhile (takeovers are tested below).
    for m in nodes.values():
        m.allowed_log += PEER_LOGS + ["not yet durable", "taking over", "is dead"]
        m.kill()


def test_kill_9_of_the_writer_after_close_its_buddy_makes_the_files_durable(mounts, tmp_path):
    """close() returned, then the writer's node died: its buddy flushes what
    it mirrors (also a file renamed after close, as torch.save to a temporary
    name and os.replace do), and a third node reads identical bytes."""
    nodes = cluster(mounts, tmp_path, ["n1", "n2", "n3"], {"n1": {"CKPTFS_FLUSH_BANDWIDTH": SLOW}})
    n1, n2, n3 = nodes["n1"], nodes["n2"], nodes["n3"]
    (n1.mnt / "run").mkdir()
    files = {"run/model.pt": os.urandom(5 * MiB + 17), "run/optim.pt": os.urandom(3 * MiB + 5)}
    for rel, data in files.items():
        tmp = n1.mnt / (rel + ".tmp")
        tmp.write_bytes(data)
        os.replace(tmp, n1.mnt / rel)
    for rel in files:
        info = file_info(n1, rel)
        assert info is not None and info["holders"] == ["n1", "n2"], info
    n1.kill()
    for m in (n2, n3):
        m.allowed_log += PEER_LOGS + ["is dead", "taking over"]

    wait_for(lambda: all(durable_now(n1.backing / rel) for rel in files), 60,
             "the buddy made n1's files durable")  # fmt: skip
    for rel, data in files.items():
        m = read_manifest(n1.backing / rel)
        assert m is not None and m.holders == ["n2"], m
        assert (n3.mnt / rel).read_bytes() == data
    assert "taking over run/model.pt" in n2.log()
    assert n2.stat()["mirroring"]["takeovers"] == 2
    assert not (n1.backing / "run" / "model.pt.tmp").exists()


def test_a_stopped_buddy_makes_the_writer_fall_back_not_hang(mounts, tmp_path):
    nodes = cluster(mounts, tmp_path, ["n1", "n2"], {})
    n1, n2 = nodes["n1"], nodes["n2"]
    assert n2.pid is not None
    os.kill(n2.pid, signal.SIGSTOP)
    try:
        data = os.urandom(4 * MiB + 99)
        start = time.monotonic()
        (n1.mnt / "a.pt").write_bytes(data)
        first = time.monotonic() - start
        start = time.monotonic()
        (n1.mnt / "b.pt").write_bytes(data)
        second = time.monotonic() - start
        # peers.timeout is 1.5 s: one timed-out request, then the buddy is dead.
        assert first < 10 and second < 10, (first, second)
        n1.wait_durable()
        writer = n1.stat()["mirroring"]["writer"]
        assert writer["fallbacks"] >= 1 and "a.pt" in writer["fallback_paths"], writer
        assert (n1.mnt / "a.pt").read_bytes() == data
        assert "a.pt is not mirrored" in n1.log()
    finally:
        os.kill(n2.pid, signal.SIGCONT)
    n1.allowed_log += PEER_LOGS + ["is not mirrored", "is dead", "timed out"]
    # n2 wakes up to the connections n1 gave up on meanwhile.
    n2.allowed_log += PEER_LOGS + ["is dead", "timed out", "refused peer connection"]


def test_a_partitioned_writer_and_its_takeover_never_publish_older_over_newer(mounts, tmp_path):
    """n1 stops (as if partitioned) after closing V1; n2 declares it dead and
    takes V1 over, slowly. n1 comes back and writes V2 at the same path.
    The takeover's fenced publish must not put V1 over V2."""
    nodes = cluster(
        mounts,
        tmp_path,
        ["n1", "n2"],
        {
            # Both flush 1 MiB chunks slowly: n1 is still flushing V1 (about
            # 30 s) and n2's takeover of V1 takes about 15 s, while V2 comes
            # about 3 s after V1.
            "n1": {"CKPTFS_FLUSH_BANDWIDTH": "128KiB", "CKPTFS_CHUNK_SIZE": "1MiB"},
            "n2": {"CKPTFS_FLUSH_BANDWIDTH": "256KiB", "CKPTFS_CHUNK_SIZE": "1MiB"},
        },
    )
    n1, n2 = nodes["n1"], nodes["n2"]
    v1 = os.urandom(4 * MiB + 1)
    (n1.mnt / "ckpt.pt").write_bytes(v1)
    m1 = read_manifest(n1.backing / "ckpt.pt")
    assert m1 is not None and m1.holders == ["n1", "n2"]
    assert n1.pid is not None
    os.kill(n1.pid, signal.SIGSTOP)
    try:
        wait_for(lambda: "taking over ckpt.pt" in n2.log(), 30, "n2 takes over V1")
    finally:
        os.kill(n1.pid, signal.SIGCONT)
    v2 = os.urandom(200_000)
    (n1.mnt / "ckpt.pt").write_bytes(v2)
    m2 = read_manifest(n1.backing / "ckpt.pt")
    assert m2 is not None and m2.version != m1.version

    seen = []

    def settled() -> bool:
        m = read_manifest(n1.backing / "ckpt.pt")
        assert m is not None
        seen.append(m.version)
        assert m.version != m1.version, "the takeover published V1 over V2"
        return "rewritten elsewhere" in n2.log() or "ckpt.pt changed" in n2.log()

    wait_for(settled, 60, "n2's takeover of V1 gives up")
    n1.wait_durable()
    m = read_manifest(n1.backing / "ckpt.pt")
    assert m is not None and m.version == m2.version and m.state == "durable"
    assert (n1.mnt / "ckpt.pt").read_bytes() == v2
    assert (n2.mnt / "ckpt.pt").read_bytes() == v2
    for m_ in (n1, n2):
        m_.allowed_log += PEER_LOGS + ["is dead", "taking over", "is not mirrored", "timed out"]
    n2.allowed_log += ["refused peer connection"]


MEGATRON = textwrap.dedent(
    """
    import os, sys, torch
    mnt, rank, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    d = os.path.join(mnt, "iter_0000100", f"mp_rank_{rank:02d}")
    g = torch.Generator().manual_seed(1000 + rank)
    want = {"w": torch.randn(256, 1024, generator=g), "step": 100, "rank": rank}
    if mode == "save":
        os.makedirs(d, exist_ok=True)
        torch.save(want, os.path.join(d, "model_optim_rng.pt"))
    else:
        it = open(os.path.join(mnt, "latest_checkpointed_iteration.txt")).read().strip()
        assert it == "100", it
        got = torch.load(os.path.join(d, "model_optim_rng.pt"))
        assert torch.equal(got["w"], want["w"]) and got["rank"] == rank
    """
)


def test_megatron_pattern_across_nodes_restarts_on_other_nodes(mounts, tmp_path):
    """Each rank saves its shard on its own node, rank 0 writes the tracker
    after the barrier; n3 dies; the restart runs rank r on another node."""
    nodes = cluster(
        mounts,
        tmp_path,
        ["n1", "n2", "n3"],
        # n3's shard (1 MiB of tensor data) stays pending: its second chunk waits 8 s.
        {"n3": {"CKPTFS_FLUSH_BANDWIDTH": SLOW, "CKPTFS_CHUNK_SIZE": "256KiB"}},
    )
    script = tmp_path / "megatron.py"
    script.write_text(MEGATRON)
    order = ["n1", "n2", "n3"]

    def run(rank: int, node: str, mode: str) -> None:
        subprocess.run(
            [sys.executable, str(script), str(nodes[node].mnt), str(rank), mode],
            check=True,
            timeout=120,
        )

    for rank, node in enumerate(order):
        run(rank, node, "save")
    (nodes["n1"].mnt / "latest_checkpointed_iteration.txt").write_text("100")
    nodes["n3"].kill()
    for m in (nodes["n1"], nodes["n2"]):
        m.allowed_log += PEER_LOGS + ["is dead", "taking over"]
    # n3's shard was mirrored on n1 (its buddy), which takes it over.
    wait_for(lambda: "taking over iter_0000100" in nodes["n1"].log(), 30, "n1 takes over")
    for rank, node in enumerate(["n2", "n1", "n2"]):
        run(rank, node, "load")


def test_a_file_rewritten_on_another_node_is_never_read_stale(mounts, tmp_path):
    """Close-to-open across nodes: n2 reads (and the kernel caches) V1; n1
    rewrites the file in place with V2 of the same size; n2's next open
    reads V2, not the daemon's or the kernel's copy of V1. Again once V2 is
    durable, and with a third version read through mmap."""
    nodes = cluster(mounts, tmp_path, ["n1", "n2", "n3"], {})
    n1, n3 = nodes["n1"], nodes["n3"]
    size = 3 * MiB + 11
    for i in range(3):
        data = os.urandom(size)
        (n1.mnt / "w.bin").write_bytes(data)
        if i == 1:
            n1.wait_durable()
        for reader in (nodes["n2"], n3):
            if i == 2:
                import mmap

                with (
                    open(reader.mnt / "w.bin", "rb") as f,
                    mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m,
                ):
                    if m[:] != data:
                        info = file_info(reader, "w.bin")
                        raise AssertionError(f"{reader.mnt}: stale mmap in version {i}: {info}")
            else:
                assert (reader.mnt / "w.bin").read_bytes() == data, f"stale in version {i}"
    for m in nodes.values():
        m.allowed_log += PEER_LOGS


def test_a_file_larger_than_the_buddys_mirror_space_falls_back_without_hanging(mounts, tmp_path):
    """The buddy may hold mirrors in half of its cache: a bigger file cannot
    be mirrored, and waiting for room would wait for its own flush. Its close
    falls back to local promptly; smaller files after it are mirrored again."""
    ports = {"n1": free_port(), "n2": free_port()}
    config = cluster_config(tmp_path, ports)
    n1, n2 = mounts("n1"), mounts("n2")
    n1.mount("--config", str(config), "--node", "n1", cache_size="256MiB")
    n2.mount("--config", str(config), "--node", "n2", cache_size="64MiB")
    wait_for(lambda: peers_of(n1)["n2"]["alive"] and peers_of(n2)["n1"]["alive"], 30, "alive")
    big = os.urandom(48 * MiB + 3)
    start = time.monotonic()
    (n1.mnt / "big.pt").write_bytes(big)
    assert time.monotonic() - start < 40
    n1.allowed_log += PEER_LOGS + ["is not mirrored"]
    n2.allowed_log += PEER_LOGS + ["is dead"]
    writer = n1.stat()["mirroring"]["writer"]
    assert writer["fallbacks"] == 1 and writer["fallback_paths"] == ["big.pt"], writer
    assert read_manifest(n1.backing / "big.pt").holders == ["n1"]
    assert "more than buddy n2 may hold" in n1.log() or "had no room" in n1.log()
    n1.wait_durable()
    wait_for(lambda: n2.stat()["mirroring"]["mirrors"] == 0, 30, "n2 drops what it held of it")
    small = os.urandom(2 * MiB)
    (n1.mnt / "small.pt").write_bytes(small)
    info = file_info(n1, "small.pt")
    assert info is not None and info["holders"] == ["n1", "n2"], info
    assert (n1.mnt / "big.pt").read_bytes() == big
    # The history says which the buddy held, and when (from the open).
    n1.wait_durable()
    history = {h["path"]: h for h in n1.stat()["history"]}
    assert history["big.pt"]["mirrored_s"] == "", history
    small_h = history["small.pt"]
    assert 0 <= small_h["mirrored_s"] <= small_h["close_s"] + 0.001, small_h


def test_a_buddy_unmounted_before_its_takeover_is_durable_waits_for_it(mounts, tmp_path):
    """n1 dies with a closed file pending, mirrored on n2; n2 takes it over
    and is unmounted before that flush is done. The only copy is in n2's
    cache, which a clean unmount deletes: the unmount waits until the file
    is durable (it did not, and said everything was durable), and `ckptfs
    stat` lists the file meanwhile."""
    slow = {"CKPTFS_FLUSH_BANDWIDTH": "128KiB", "CKPTFS_CHUNK_SIZE": "256KiB"}
    nodes = cluster(mounts, tmp_path, ["n1", "n2"], {"n1": slow, "n2": slow})
    n1, n2 = nodes["n1"], nodes["n2"]
    n2.allowed_log += PEER_LOGS + ["is dead", "taking over"]
    data = os.urandom(MiB + 4321)
    (n1.mnt / "ckpt.pt").write_bytes(data)
    info = file_info(n1, "ckpt.pt")
    assert info is not None and info["holders"] == ["n1", "n2"], info
    n1.kill()
    wait_for(lambda: "taking over ckpt.pt" in n2.log(), 30, "n2 takes ckpt.pt over")
    s = n2.stat()
    assert [(f["path"], f["origin"]) for f in s["taken_over"]] == [("ckpt.pt", "n1")], s
    assert "taken over:   ckpt.pt (1.0 MiB) from n1" in n2.cli("stat", str(n2.mnt)).stdout
    assert read_manifest(n2.backing / "ckpt.pt").state == "pending"
    n2.umount()
    m = read_manifest(n2.backing / "ckpt.pt")
    assert m is not None and m.state == "durable" and m.holders == ["n2"], m
    c = mounts("c")
    c.mount()
    assert (c.mnt / "ckpt.pt").read_bytes() == data
    c.umount()


def test_a_buddy_whose_writer_dies_during_its_unmount_waits_for_the_takeover(mounts, tmp_path):
    """n2 is told to unmount (SIGTERM, as systemd or a Slurm epilog does)
    while its own file is still flushing, and n1 dies meanwhile with several
    files mirrored on n2. The takeover starts during the unmount's wait: the
    unmount waits for it too (it looked at the taken-over files once, at its
    start, then deleted the cache holding their only copies)."""
    # n1 flushes slowly enough (a 300 KiB file takes about 10 s) that all four
    # are still mirrored on n2 once the last is written.
    slow = {"CKPTFS_FLUSH_BANDWIDTH": "32KiB", "CKPTFS_CHUNK_SIZE": "256KiB"}
    draining = {"CKPTFS_FLUSH_BANDWIDTH": "1MiB", "CKPTFS_CHUNK_SIZE": "256KiB"}
    nodes = cluster(mounts, tmp_path, ["n1", "n2"], {"n1": slow, "n2": draining})
    n1, n2 = nodes["n1"], nodes["n2"]
    n2.allowed_log += PEER_LOGS + ["is dead", "taking over", "mirror"]
    theirs = {f"rank{i}.pt": os.urandom(300 * 1024 + i) for i in range(4)}
    for name, data in theirs.items():
        (n1.mnt / name).write_bytes(data)
    assert n2.stat()["mirroring"]["mirrors"] == len(theirs)
    own = os.urandom(5 * MiB + 99)
    (n2.mnt / "own.pt").write_bytes(own)
    os.kill(n2.pid, signal.SIGTERM)
    wait_for(lambda: "flushing, then unmounting" in n2.log(), 10, "n2 starts its unmount")
    n1.kill()
    wait_for(lambda: f"unmounted {n2.mnt}" in n2.log(), 90, "n2's unmount")
    log = n2.log()
    assert "taking over rank3.pt" in log, log
    assert "everything was durable" in log, log
    assert "taken over from a dead buddy not yet durable" not in log, log
    for name in theirs:
        # n1 may have flushed one itself before it died (a loaded machine
        # takes seconds from the writes to the kill): durable from n1 then.
        m = read_manifest(n2.backing / name)
        taken = f"taking over {name} " in log and f"not taking over {name} " not in log
        holder = "n2" if taken else "n1"
        assert m is not None and m.state == "durable" and m.holders == [holder], (name, m)
    c = mounts("c")
    c.mount()
    for name, data in {**theirs, "own.pt": own}.items():
        assert (c.mnt / name).read_bytes() == data, name
    c.umount()


def test_a_taken_over_file_renamed_through_its_new_holder_stays_durable(mounts, tmp_path):
    """n1 dies with a checkpoint directory pending (a finished file and one
    still at its temporary name), n2 takes them over, and the resumed job on
    n2 finishes the save: os.replace of the temporary name, then a rename of
    the directory. The flush from n2 follows both renames (it published at
    the old path, found no name there and dropped the only copy)."""
    # Several chunks each at a slow flush: both stay pending (a file of one
    # chunk may be flushed at once, from what the rate limit has saved up).
    slow = {"CKPTFS_FLUSH_BANDWIDTH": "128KiB", "CKPTFS_CHUNK_SIZE": "256KiB"}
    nodes = cluster(mounts, tmp_path, ["n1", "n2"], {"n1": slow, "n2": slow})
    n1, n2 = nodes["n1"], nodes["n2"]
    n2.allowed_log += PEER_LOGS + ["is dead", "taking over"]
    (n1.mnt / "step-9.tmp").mkdir()
    model, optim = os.urandom(MiB + 1), os.urandom(768 * 1024 + 7)
    (n1.mnt / "step-9.tmp" / "model.pt").write_bytes(model)
    (n1.mnt / "step-9.tmp" / "optim.pt.tmp").write_bytes(optim)
    n1.kill()
    wait_for(lambda: len(n2.stat()["taken_over"]) == 2, 30, "n2 takes both over")
    os.replace(n2.mnt / "step-9.tmp" / "optim.pt.tmp", n2.mnt / "step-9.tmp" / "optim.pt")
    os.replace(n2.mnt / "step-9.tmp", n2.mnt / "step-9")
    assert sorted(f["path"] for f in n2.stat()["taken_over"]) == [
        "step-9/model.pt",
        "step-9/optim.pt",
    ]
    n2.umount()
    assert "no longer names this file" not in n2.log()
    for name in ("model.pt", "optim.pt"):
        m = read_manifest(n2.backing / "step-9" / name)
        assert m is not None and m.state == "durable" and m.holders == ["n2"], (name, m)
    c = mounts("c")
    c.mount()
    assert (c.mnt / "step-9" / "model.pt").read_bytes() == model
    assert (c.mnt / "step-9" / "optim.pt").read_bytes() == optim
    c.umount()


def test_a_restarted_buddy_is_given_the_pending_files_again(mounts, tmp_path):
    """n2 (n1's buddy) crashes and comes back with none of n1's mirrors; n1
    mirrors its pending files to it again, so n1's death after that still
    leaves them to n2's takeover."""
    ports = {"n1": free_port(), "n2": free_port()}
    config = cluster_config(tmp_path, ports)
    n1, n2 = mounts("n1"), mounts("n2")
    n1.mount("--config", str(config), "--node", "n1", env={"CKPTFS_FLUSH_BANDWIDTH": SLOW})
    n2.mount("--config", str(config), "--node", "n2")
    wait_for(lambda: peers_of(n1)["n2"]["alive"] and peers_of(n2)["n1"]["alive"], 30, "alive")
    data = os.urandom(5 * MiB + 77)
    (n1.mnt / "a.pt").write_bytes(data)
    assert n2.stat()["mirroring"]["mirrors"] == 1
    for m in (n1, n2):
        m.allowed_log += PEER_LOGS + ["is dead", "taking over", "unmounted", "timed out"]
    n2.kill()
    n2.mount("--config", str(config), "--node", "n2")
    wait_for(lambda: n2.stat()["mirroring"]["mirrored_bytes"] >= len(data), 30, "mirrored again")
    assert "mirrored again" in n1.log()
    n1.kill()
    wait_for(
        lambda: durable_now(n1.backing / "a.pt"),
        60,
        "n2 makes a.pt durable",
    )
    assert (n2.mnt / "a.pt").read_bytes() == data


def test_a_writer_restarted_with_no_cache_before_its_death_was_noticed_is_taken_over(
    mounts, tmp_path
):
    """n1 crashes, loses its cache (its node's RAM) and is mounted again
    before n2 declared it dead: n2 never sees a death, but the new process
    answers as another incarnation, so n2 takes over what the old one
    committed. What the new process writes stays its own."""
    config = cluster_config(tmp_path, {"n1": free_port(), "n2": free_port()}, timeout=30)
    slow = {"CKPTFS_FLUSH_BANDWIDTH": SLOW}
    n1, n2 = mounts("n1"), mounts("n2")
    n1.mount("--config", str(config), "--node", "n1", env=slow)
    n2.mount("--config", str(config), "--node", "n2")
    wait_for(lambda: peers_of(n1)["n2"]["alive"] and peers_of(n2)["n1"]["alive"], 30, "alive")
    old = os.urandom(5 * MiB + 99)
    (n1.mnt / "old.pt").write_bytes(old)
    info = file_info(n1, "old.pt")
    assert info is not None and info["holders"] == ["n1", "n2"], info
    for m in (n1, n2):
        m.allowed_log += PEER_LOGS + ["is dead", "taking over", "restarted", "timed out"]
    n1.kill()
    shutil.rmtree(n1.cache_dir)
    n1.mount("--config", str(config), "--node", "n1", env=slow)
    wait_for(
        lambda: durable_now(n1.backing / "old.pt"),
        60,
        "n2 makes old.pt durable",
    )
    assert read_manifest(n1.backing / "old.pt").holders == ["n2"]  # type: ignore[union-attr]
    assert "peer n1 restarted: took over 1 mirrored file(s)" in n2.log()
    assert "is dead" not in n2.log()  # never declared dead: the restart was noticed
    # The new process's file is mirrored to n2 and left to it.
    new = os.urandom(3 * MiB + 5)
    (n1.mnt / "new.pt").write_bytes(new)
    info = file_info(n1, "new.pt")
    assert info is not None and info["holders"] == ["n1", "n2"], info
    assert n2.stat()["mirroring"]["takeovers"] == 1
    assert (n2.mnt / "old.pt").read_bytes() == old
    assert (n2.mnt / "new.pt").read_bytes() == new


USER_SAVE = """
path, seed = sys.argv[3], int(sys.argv[4])
g = torch.Generator().manual_seed(seed)
w, b = torch.randn(1500, 1000, generator=g), torch.randn(777, generator=g)
state = {"w": w, "b": b, "step": seed}
torch.save(state, path + ".tmp")
os.replace(path + ".tmp", path)
st = os.stat(path)
print(json.dumps([st.st_uid, st.st_gid]))
"""

USER_LOAD = """
path, seed, mmap = sys.argv[3], int(sys.argv[4]), sys.argv[5] == "1"
g = torch.Generator().manual_seed(seed)
w, b = torch.randn(1500, 1000, generator=g), torch.randn(777, generator=g)
state = torch.load(path, mmap=mmap, weights_only=True)
print(json.dumps([torch.equal(state["w"], w) and torch.equal(state["b"], b), state["step"]]))
"""


def test_an_ordinary_users_checkpoint_outlives_its_node_and_resumes_on_another(
    shared_mounts, tmp_path
):
    """A job running as an ordinary user saves on n1 (torch.save to a
    temporary name, then os.replace) and n1 dies before any flush. Its buddy
    makes the file durable, still the user's; the job resumes on n3 as the
    same user, saves over it, and after an unmount and a mount of n3 with an
    empty cache, and again after another, loads every tensor back."""
    config = cluster_config(tmp_path, {n: free_port() for n in ("n1", "n2", "n3")})
    nodes = {n: shared_mounts(n) for n in ("n1", "n2", "n3")}
    for name, m in nodes.items():
        env = {"CKPTFS_FLUSH_BANDWIDTH": SLOW} if name == "n1" else {}
        m.mount("--config", str(config), "--node", name, env=env)
    n1, n2, n3 = nodes["n1"], nodes["n2"], nodes["n3"]
    for name, m in nodes.items():
        wait_for(lambda m=m: all(p["alive"] for p in peers_of(m).values()), 30, f"{name} alive")
        m.allowed_log += PEER_LOGS + ["is dead", "taking over", "unmounted", "timed out"]
    job = n1.mnt / "job"
    job.mkdir()
    os.chown(job, USER, GROUP)
    rel = "job/model.pt"
    assert run_as(USER, GROUP, USER_SAVE, str(n1.mnt / rel), "1") == [USER, GROUP]
    info = file_info(n1, rel)
    assert info is not None and info["holders"] == ["n1", "n2"], info
    n1.kill()
    n3.allowed_log.append("is not mirrored (buddy n1 is down)")  # n1 was n3's buddy

    wait_for(lambda: durable_now(n1.backing / rel, ["n2"]), 60,
             "n2 makes the user's checkpoint durable")  # fmt: skip
    st = (n1.backing / rel).stat()
    assert (st.st_uid, st.st_gid) == (USER, GROUP)
    assert run_as(USER, GROUP, USER_LOAD, str(n3.mnt / rel), "1", "1") == [True, 1]
    assert run_as(USER, GROUP, USER_SAVE, str(n3.mnt / rel), "2") == [USER, GROUP]
    cold = [Path(f"{n3.cache_dir}-cold{i}") for i in (1, 2)]
    try:
        for i, cache_dir in enumerate(cold):
            n3.umount()
            n3.mount(
                "--config", str(config), "--node", "n3", env={"CKPTFS_CACHE_DIR": str(cache_dir)}
            )
            mmap = str(i)  # a plain load, then an mmap load
            assert run_as(USER, GROUP, USER_LOAD, str(n3.mnt / rel), "2", mmap) == [True, 2]
            assert (n3.mnt / rel).stat().st_uid == USER
        assert (n2.mnt / rel).read_bytes() == (n3.mnt / rel).read_bytes()
        n2.umount()
        n3.umount()
        assert "all well" in n3.cli("check", str(n3.backing)).stdout
    finally:
        for cache_dir in cold:
            subprocess.run(["rm", "-rf", str(cache_dir)], timeout=60)


def test_a_file_recovered_after_a_daemon_crash_and_renamed_is_taken_over_at_its_new_name(
    mounts, tmp_path
):
    """n1's daemon crashes after the close of a temporary file (mirrored to
    n2, pending) and is back before n2 notices; recovery adopts the file from
    the cache, and the job then renames it to its final name, as torch.save
    to a temporary name and os.replace do. When n1's node dies after that,
    n2 must make the file durable at the name it has now, with the bytes
    written, and keep no mirror of n1. (Recovery keeps the version's mirror
    id and page generations, so n1 goes on with n2's copy.)"""
    ports = {"n1": free_port(), "n2": free_port()}
    # A timeout long enough for n1's restart to go unnoticed.
    config = cluster_config(tmp_path, ports, timeout="10")
    n1, n2 = mounts("n1"), mounts("n2")
    # Each life of n1 stores its first missing chunk at once, the next after
    # 64 s: the file stays pending across the restart.
    slow = {"CKPTFS_FLUSH_BANDWIDTH": "16KiB", "CKPTFS_CHUNK_SIZE": "1MiB"}
    n1.mount("--config", str(config), "--node", "n1", env=slow)
    n2.mount("--config", str(config), "--node", "n2")
    wait_for(lambda: peers_of(n1)["n2"]["alive"] and peers_of(n2)["n1"]["alive"], 30, "alive")
    for m in (n1, n2):
        m.allowed_log += PEER_LOGS + ["is dead", "taking over", "not yet durable", "timed out"]
    data = os.urandom(5 * MiB + 99)
    (n1.mnt / "model.pt.tmp").write_bytes(data)
    assert file_info(n1, "model.pt.tmp")["holders"] == ["n1", "n2"]
    assert n2.stat()["mirroring"]["mirrors"] == 1

    n1.kill()
    n1.mount("--config", str(config), "--node", "n1", env=slow)
    assert "recovered model.pt.tmp" in n1.log()
    wait_for(lambda: peers_of(n1)["n2"]["alive"], 30, "n1 sees n2 again")
    info = file_info(n1, "model.pt.tmp")
    assert info is not None and info["holders"] == ["n1", "n2"], info
    assert info["mirror"] == "acked", info
    assert n2.stat()["mirroring"]["mirrors"] == 1  # the copy from before the crash, kept
    os.replace(n1.mnt / "model.pt.tmp", n1.mnt / "model.pt")

    n1.kill()
    wait_for(
        lambda: durable_now(n1.backing / "model.pt"),
        60,
        "n2 makes model.pt durable",
    )
    assert read_manifest(n1.backing / "model.pt").holders == ["n2"]
    assert not (n1.backing / "model.pt.tmp").exists()
    assert (n2.mnt / "model.pt").read_bytes() == data
    wait_for(lambda: n2.stat()["mirroring"]["mirrors"] == 0, 30, "no mirror of n1 left on n2")


# Maps a file (argv: path), reads its first MiB, says "mapped", waits for a
# line on stdin, then reads every mapped byte and prints their SHA-256. A
# read of the mapping that the filesystem fails is SIGBUS, so in a process of
# its own.
MAPPED_READER = """
import hashlib, mmap, sys
with open(sys.argv[1], "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
    m[: 1 << 20]
    print("mapped", flush=True)
    sys.stdin.readline()
    print(hashlib.sha256(m[:]).hexdigest(), flush=True)
"""


def test_the_buddys_open_files_read_their_version_after_the_writer_replaced_it(mounts, tmp_path):
    """n2 (n1's buddy) has a file of n1's open, read from its own mirror, and
    n1 replaces it (torch.save to a temporary name, os.replace): while it was
    pending, and once it was durable. n2's open handles (a read, a mapping)
    read on the whole version they opened from the mirror n2 keeps for them,
    not ESTALE (nor SIGBUS, which killed a torch.load(mmap=True) in CI); a
    new open reads the new file; the kept mirror goes with the last handle."""
    import hashlib

    # A 40 MiB file takes n1 about 10 s to flush: n2 opens it while pending.
    nodes = cluster(mounts, tmp_path, ["n1", "n2"], {"n1": {"CKPTFS_FLUSH_BANDWIDTH": "4MiB"}})
    n1, n2 = nodes["n1"], nodes["n2"]
    for m in (n1, n2):
        m.allowed_log += PEER_LOGS
    for when in ("pending", "durable"):
        name = f"{when}.pt"
        old, new = os.urandom(40 * MiB + 3), os.urandom(40 * MiB + 5)
        (n1.mnt / name).write_bytes(old)
        fd = os.open(n2.mnt / name, os.O_RDONLY | os.O_DIRECT)
        mapped = subprocess.Popen(
            [sys.executable, "-c", MAPPED_READER, str(n2.mnt / name)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            assert mapped.stdout is not None and mapped.stdin is not None
            assert next_line(mapped) == "mapped"
            assert os.pread(fd, MiB, 0) == old[:MiB]
            if when == "durable":
                n1.wait_durable()
            assert read_manifest(n1.backing / name).state == when
            (n1.mnt / "tmp").write_bytes(new)
            os.replace(n1.mnt / "tmp", n1.mnt / name)
            with open(n2.mnt / name, "rb") as f:  # a new open: the new file
                assert f.read(MiB) == new[:MiB]
            assert n2.stat()["mirroring"]["kept_for_readers"] == 1
            shown = n2.cli("stat", str(n2.mnt), "--verbose").stdout
            assert "1 kept for open handles here" in shown
            got, off = bytearray(), 0
            while chunk := os.pread(fd, 4 * MiB, off):
                got += chunk
                off += len(chunk)
            assert got == old, f"{when}: the open handle's bytes differ from its version"
            mapped.stdin.write("go\n")
            mapped.stdin.flush()
            digest = next_line(mapped)
            assert mapped.wait(timeout=60) == 0, f"{when}: mapped reader died: {mapped.returncode}"
            assert digest == hashlib.sha256(old).hexdigest(), f"{when}: mapped bytes differ"
        finally:
            os.close(fd)
            if mapped.poll() is None:
                mapped.kill()
            mapped.wait(timeout=60)
        assert (n2.mnt / name).read_bytes() == new
        assert n2.stat()["lost"] == []
        wait_for(lambda: n2.stat()["mirroring"]["kept_for_readers"] == 0, 30, "kept mirror dropped")
    n1.wait_durable()
    n1.umount()
    n2.umount()
