#!/bin/bash
# Slurm Epilog: flush the job's checkpoints to the backing store and unmount
# /ckpt/$SLURM_JOB_ID (`ckptfs umount` flushes first), then free the job's RAM cache.
#
# Installation and settings: see slurm-prolog.sh and slurm-common.sh.
#
# Idempotent: with nothing mounted and no cache left it does nothing. If the
# daemon died, its RAM cache (tmpfs) is recovered by remounting, then flushed.
# The RAM cache is removed only after a successful umount: until then it may hold
# the only copy of a checkpoint. On failure the exit status is 1, which drains the
# node so that an operator recovers the cache before the node runs another job.
set -u -o pipefail

# shellcheck source=SCRIPTDIR/slurm-common.sh
. "$(dirname -- "$(realpath -- "$0")")/slurm-common.sh" || exit 1

cache_has_data() {
    [ -d "$JOB_CACHE" ] && [ -n "$(find "$JOB_CACHE" -mindepth 1 -print -quit 2>/dev/null)" ]
}

job_umount() {
    local out status umount_cmd=("$CKPTFS_SLURM_BIN" umount "$JOB_MNT")
    # The config may set run_dir, where the daemon's control socket is.
    if [ -r "$JOB_RUN/config.yaml" ]; then
        umount_cmd+=(--config "$JOB_RUN/config.yaml")
    elif [ -r "$CKPTFS_SLURM_CONFIG" ]; then
        umount_cmd+=(--config "$CKPTFS_SLURM_CONFIG")
    fi
    out=$(mktemp) || die "mktemp failed"
    timeout --kill-after=10 "$CKPTFS_SLURM_UMOUNT_TIMEOUT" "${umount_cmd[@]}" >"$out" 2>&1 </dev/null
    status=$?
    if [ "$status" -eq 0 ] && ! in_mount_table "$JOB_MNT"; then
        rm -f -- "$out"
        return 0
    fi
    log err "ckptfs umount $JOB_MNT failed (exit $status), cache kept in $JOB_CACHE:" \
        "$(tail -c 2000 -- "$out" | tr '\n' ' ')"
    rm -f -- "$out"
    return 1
}

main() {
    job_setup
    local state
    state=$(mount_state "$JOB_MNT")
    if [ "$state" = dead ]; then
        log warning "$JOB_MNT is a dead mount (daemon gone); remounting to flush its cache"
        detach "$JOB_MNT" || die "cannot detach the dead mount at $JOB_MNT"
        state=none
    fi
    if [ "$state" = none ] && cache_has_data; then
        # A daemon that died before flushing left its cache behind; a new daemon
        # on the same cache dir picks it up, and umount then flushes it.
        log warning "found an unflushed cache in $JOB_CACHE; remounting to flush it"
        job_mount || die "cannot remount $JOB_MNT to flush $JOB_CACHE"
        state=live
    fi
    if [ "$state" = live ]; then
        job_umount || exit 1
        log info "flushed and unmounted $JOB_MNT (backing $JOB_BACKING)"
    fi
    # Only now is everything in the backing store; the RAM is the node's again.
    rm -rf -- "$JOB_CACHE" || die "cannot remove the cache dir $JOB_CACHE"
    rm -rf -- "$JOB_RUN" || log warning "cannot remove $JOB_RUN"
    local link
    if link=$(job_name_link) && [ "$(readlink -- "$link" 2>/dev/null)" = "$JOB_MNT" ]; then
        rm -f -- "$link"
    fi
    if [ -d "$JOB_MNT" ] && ! rmdir -- "$JOB_MNT" 2>/dev/null; then
        log warning "$JOB_MNT is not empty after unmount (written while not mounted?); left in place"
    fi
    return 0
}

main "$@"
