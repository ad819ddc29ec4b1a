#!/bin/bash
# Slurm Prolog: mount ckptfs for the job at /ckpt/$SLURM_JOB_ID on this node,
# with the job's other nodes as peers, and link /ckpt/by-name/<user>/<job name>
# to it (the same path when the same run is submitted again).
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

# A job on several nodes: this node's config with the job's peers, and the
# job's secret, derived from the cluster secret and the job id (HMAC-SHA256), so
# that no secret is distributed per job and one job's cannot open another's.
# Returns 1 (nodes mount alone) for a job of one node or without a cluster secret.
job_peers() {
    local nodes node port address listed
    # Without a cluster secret the site does not use peers: every node alone.
    [ -r "$CKPTFS_SLURM_SECRET" ] || return 1
    listed=$(job_nodes) || die "cannot list the job's nodes (scontrol)"
    mapfile -t nodes <<<"$listed"
    [ "${#nodes[@]}" -ge 2 ] || return 1
    if [ -r "$CKPTFS_SLURM_CONFIG" ] && grep -q '^peers:' -- "$CKPTFS_SLURM_CONFIG"; then
        die "$CKPTFS_SLURM_CONFIG sets peers: a Slurm job's peers come from its node list"
    fi
    port=$((CKPTFS_SLURM_PORT_BASE + SLURM_JOB_ID % CKPTFS_SLURM_PORTS))
    # The parents as any run directory (/run/ckptfs holds the control sockets
    # every user reaches), the job's own for root alone.
    (umask 022 && mkdir -p -- "${CKPTFS_SLURM_RUN%/}") || die "cannot create $CKPTFS_SLURM_RUN"
    install -d -m 0700 -- "$JOB_RUN" || die "cannot create $JOB_RUN"
    # The key is read inside python, never on a command line (ps would show it).
    (umask 077 && python3 -c '
import hashlib, hmac, sys
key = open(sys.argv[1], "rb").read().strip()
sys.stdout.write(hmac.new(key, b"ckptfs-slurm-job:" + sys.argv[2].encode(), hashlib.sha256).hexdigest() + "\n")
' "$CKPTFS_SLURM_SECRET" "$SLURM_JOB_ID" >"$JOB_RUN/secret") || die "cannot derive the job's secret"
    {
        if [ -r "$CKPTFS_SLURM_CONFIG" ]; then
            cat -- "$CKPTFS_SLURM_CONFIG"
            echo
        fi
        echo "peers:"
        echo "  secret_file: '$JOB_RUN/secret'"
        echo "  listen: '$CKPTFS_SLURM_LISTEN:$port'"
        echo "  nodes:"
        for node in "${nodes[@]}"; do
            address=${CKPTFS_SLURM_NODE_ADDRESS//%n/$node}
            echo "    '$node': '$address:$port'"
        done
    } >"$JOB_RUN/config.yaml" || die "cannot write $JOB_RUN/config.yaml"
    log info "peers: ${nodes[*]} on port $port"
}

link_by_name() {
    local link target
    [ "$CKPTFS_SLURM_BY_NAME" = 1 ] || return 0
    link=$(job_name_link) || return 0
    if [ -L "$link" ]; then
        target=$(readlink -- "$link")
        if [ "$target" != "$JOB_MNT" ] && [ "$(mount_state "$target")" = live ]; then
            log warning "$link is job ${target##*/}'s, still mounted: not linked to this job"
            return 0
        fi
    fi
    mkdir -p -- "${link%/*}" && ln -sfn -- "$JOB_MNT" "$link" ||
        log warning "could not link $link to $JOB_MNT"
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
    job_peers || rm -rf -- "$JOB_RUN"
    if ! job_mount; then
        # Leave no empty mountpoint behind either; rmdir never removes data.
        rmdir -- "$JOB_MNT" 2>/dev/null
        exit 1
    fi
    link_by_name
    log info "mounted $JOB_MNT (backing $JOB_BACKING, cache $JOB_CACHE, node $SLURMD_NODENAME)"
}

main "$@"
