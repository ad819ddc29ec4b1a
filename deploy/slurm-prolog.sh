#!/bin/bash
# Slurm Prolog: mount ckptfs for the job at /ckpt/$SLURM_JOB_ID on this node.
#
# slurm.conf:
#   Prolog=/etc/slurm/ckptfs/slurm-prolog.sh
#   Epilog=/etc/slurm/ckptfs/slurm-epilog.sh
#   PrologFlags=Alloc          # mount on every node at allocation, before any step
#   PrologEpilogTimeout=3700   # > CKPTFS_SLURM_UMOUNT_TIMEOUT: the epilog flushes
# Settings: see slurm-common.sh. Runs as root; logs to syslog (tag ckptfs-slurm).
#
# Idempotent: a live mount is left alone, a dead one (daemon gone) is replaced.
# On failure nothing stays mounted and the exit status is 1, so Slurm drains the
# node and requeues the job instead of letting it write into a plain directory.
set -u -o pipefail

# shellcheck source=SCRIPTDIR/slurm-common.sh
. "$(dirname -- "$(realpath -- "$0")")/slurm-common.sh" || exit 1

prepare_dirs() {
    # The daemon runs as root; the job user owns its checkpoint tree.
    if [ ! -d "$JOB_BACKING" ]; then
        mkdir -p -- "$JOB_BACKING" || die "cannot create backing dir $JOB_BACKING"
        chown -- "${SLURM_JOB_UID:-$SLURM_JOB_USER}:${SLURM_JOB_GID:-}" "$JOB_BACKING" ||
            die "cannot chown backing dir $JOB_BACKING to $SLURM_JOB_USER"
    fi
    mkdir -p -- "$JOB_MNT" || die "cannot create mountpoint $JOB_MNT"
    chown -- "${SLURM_JOB_UID:-$SLURM_JOB_USER}:${SLURM_JOB_GID:-}" "$JOB_MNT" ||
        die "cannot chown mountpoint $JOB_MNT to $SLURM_JOB_USER"
}

main() {
    job_setup
    case $(mount_state "$JOB_MNT") in
    live)
        log info "$JOB_MNT is already mounted"
        return 0
        ;;
    dead)
        # The daemon died; its RAM cache in $JOB_CACHE is picked up by the new mount.
        log warning "$JOB_MNT is a dead mount (daemon gone); remounting"
        detach "$JOB_MNT" || die "cannot detach the dead mount at $JOB_MNT"
        ;;
    esac
    prepare_dirs
    if ! job_mount; then
        # Leave no empty mountpoint behind either; rmdir never removes data.
        rmdir -- "$JOB_MNT" 2>/dev/null
        exit 1
    fi
    log info "mounted $JOB_MNT (backing $JOB_BACKING, cache $JOB_CACHE, node $SLURMD_NODENAME)"
}

main "$@"
