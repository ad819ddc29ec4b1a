#!/usr/bin/env bash
# The main job: mount ckptfs over a local backing directory, run an unmodified
# torch training script that checkpoints into the mount, show `ckptfs stat`,
# unmount (which flushes everything), and show what landed in the backing dir.
set -euo pipefail
cd "$(dirname "$0")/.."
WORK=${CKPTFS_DEMO_DIR:-/var/tmp/ckptfs-demo}
MNT=$WORK/mnt
BACKING=$WORK/backing
CKPTFS=.venv/bin/ckptfs
export CKPTFS_RUN_DIR=${CKPTFS_RUN_DIR:-$WORK/run}

if grep -qs " $MNT fuse.ckptfs " /proc/mounts; then $CKPTFS umount "$MNT"; fi
# A fresh backing directory each run, so the numbers shown are this run's
# (an old one would make every checkpoint a dedup hit).
rm -rf "$BACKING"
mkdir -p "$MNT" "$BACKING"
cleanup() { grep -qs " $MNT fuse.ckptfs " /proc/mounts && fusermount3 -u -z "$MNT" || true; }
trap cleanup EXIT

$CKPTFS mount "$MNT" --backing "$BACKING" --cache-size 2GiB
.venv/bin/python tools/examples/train.py --ckpt-dir "$MNT/run1" --steps 20 --save-every 5 --size-mb 256
echo; echo "== ckptfs stat =="
$CKPTFS stat "$MNT"
echo; echo "== ckptfs umount (flushes everything) =="
$CKPTFS umount "$MNT"
echo; echo "== backing directory =="
find "$BACKING" -path "$BACKING/.ckptfs" -prune -o -type f -print | sort
du -sh "$BACKING/.ckptfs/chunks"
