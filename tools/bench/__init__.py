"""Benchmarks: scripts that print measured numbers (none asserts a threshold).

Each mounts what it measures itself and always unmounts it; run one with
``python -m ckptfs.tools.bench.<name>`` (``--help`` lists its options):

- ``bench_save_load``: torch.save and torch.load of a GPT-like state dict
  through ckptfs, against tmpfs and local disk + fsync; close -> durable time.
  ``python -m ckptfs.tools.bench.bench_save_load [--size-gib 2] [--runs 3]``
- ``bench_restore``: restore through ckptfs against plain disk and tmpfs: cold
  torch.load, reads of cached and evicted files, many readers at once.
  ``python -m ckptfs.tools.bench.bench_restore [--size-gib 2] [--runs 3]``
- ``bench_dedup``: bytes stored per checkpoint of a fine-tuning job that
  freezes most of the model, and whether hashing keeps up with the flusher.
  ``python -m ckptfs.tools.bench.bench_dedup [--size-gib 1] [--checkpoints 3]``
- ``bench_fuse``: where the time of a FUSE write goes, on a tiny pyfuse3
  filesystem of its own (no ckptfs).
  ``python -m ckptfs.tools.bench.bench_fuse [--size-mib 1024] [--runs 3]``
- ``bench_meta``: latency of stat, open, create, rename and unlink through
  ckptfs against a plain directory, and the mmap reopen window of
  ``torch.load(mmap=True)``.
  ``python -m ckptfs.tools.bench.bench_meta [--ops 300] [--rounds 5]``
- ``bench_replace``: a writer replacing a checkpoint (``torch.save`` to a
  temporary name, ``os.replace``) while readers ``torch.load(mmap=True)`` it:
  torn loads, the race window inside torch.load (also of each new version's
  first load), the writer's rename.
  ``python -m ckptfs.tools.bench.bench_replace [--readers 2] [--gap 0] [--runs 3]``
- ``bench_flush``: the flusher's drain rate against the disk's own write +
  fsync, its CPU per GiB, and a training loop's slowdown while it runs, per
  ``flush.workers`` and ``flush.bandwidth``.
  ``python -m ckptfs.tools.bench.bench_flush [--size-gib 2] [--runs 3]``
- ``bench_buddy``: three daemons on loopback: the save with ``durability:
  buddy`` against local and tmpfs, and a restore from a peer's RAM against
  one from local RAM.
  ``python -m ckptfs.tools.bench.bench_buddy [--size-gib 1] [--runs 3]``

- ``bench_cluster``: cold restore of one checkpoint by several nodes at once
  (daemons on this machine sharing a counting backing mount): wall time
  against one node, and backing-store bytes read per checkpoint size, with
  and without representative fetch.
  ``python -m ckptfs.tools.bench.bench_cluster [--nodes 4] [--size-mib 512] [--runs 3]``

- ``bench_readdir``: ``ls -l`` of a directory of 20,000 files (plain files
  put in the backing directory, and files written through the mount) against
  the backing directory itself, and how long a ``stat`` of another file waits
  meanwhile.
  ``python -m ckptfs.tools.bench.bench_readdir [--files 20000] [--runs 5]``

``benchlib`` is what they share (memory warm-up, tables, mounting through the
CLI, cleanup); it is not a public API.
"""
