# shellcheck shell=bash
# Shared by slurm-prolog.sh and slurm-epilog.sh (sourced, not run). Install all
# three files in one directory, e.g. /etc/slurm/ckptfs/.
#
# Site settings go in /etc/default/ckptfs-slurm (sourced if present):
#   CKPTFS_SLURM_BIN=/usr/local/bin/ckptfs     # the ckptfs CLI
#   CKPTFS_SLURM_ROOT=/ckpt                    # jobs see /ckpt/$SLURM_JOB_ID
#   CKPTFS_SLURM_BACKING=/nfs/ckpt/%u          # backing dir; %u = job user, %j = job id
#   CKPTFS_SLURM_CACHE_ROOT=/dev/shm/ckptfs    # RAM cache at <root>/$SLURM_JOB_ID
#   CKPTFS_SLURM_CONFIG=/etc/ckptfs/ckptfs.yaml  # used if it exists
#   CKPTFS_SLURM_MOUNT_TIMEOUT=300             # seconds
#   CKPTFS_SLURM_UMOUNT_TIMEOUT=3600           # seconds; umount flushes to the backing store
#   export CKPTFS_CACHE_SIZE=40%               # any daemon setting, as CKPTFS_<KEY>
#
# A job on several nodes gets peers (mirroring to a buddy, takeover, peer reads)
# with no configuration by its user, if the cluster secret exists:
#   CKPTFS_SLURM_SECRET=/etc/ckptfs/cluster.secret  # root's, mode 0600, same on every node
#   CKPTFS_SLURM_PORT_BASE=17000               # a job's peer port: base + job id % ports
#   CKPTFS_SLURM_PORTS=1000
#   CKPTFS_SLURM_LISTEN=0.0.0.0                # where the daemon listens (its port added)
#   CKPTFS_SLURM_NODE_ADDRESS=%n               # how peers reach node %n (a name or address)
#   CKPTFS_SLURM_SCONTROL=scontrol             # to list the job's nodes and its name
#   CKPTFS_SLURM_RUN=/run/ckptfs/slurm         # per-job config and secret (root only)
#   CKPTFS_SLURM_BY_NAME=1                     # also <root>/by-name/<user>/<job name>
#
# The backing dir defaults to one per user, not per job: a job restarted under a
# new job id must find the checkpoints of the previous one, and the by-name
# link gives it the same path as before.

CKPTFS_SLURM_TAG=ckptfs-slurm

# shellcheck source=/dev/null
[ -r /etc/default/ckptfs-slurm ] && . /etc/default/ckptfs-slurm

: "${CKPTFS_SLURM_BIN:=/usr/local/bin/ckptfs}"
: "${CKPTFS_SLURM_ROOT:=/ckpt}"
: "${CKPTFS_SLURM_BACKING:=/nfs/ckpt/%u}"
: "${CKPTFS_SLURM_CACHE_ROOT:=/dev/shm/ckptfs}"
: "${CKPTFS_SLURM_CONFIG:=/etc/ckptfs/ckptfs.yaml}"
: "${CKPTFS_SLURM_MOUNT_TIMEOUT:=300}"
: "${CKPTFS_SLURM_UMOUNT_TIMEOUT:=3600}"
: "${CKPTFS_SLURM_SECRET:=/etc/ckptfs/cluster.secret}"
: "${CKPTFS_SLURM_PORT_BASE:=17000}"
: "${CKPTFS_SLURM_PORTS:=1000}"
: "${CKPTFS_SLURM_LISTEN:=0.0.0.0}"
: "${CKPTFS_SLURM_NODE_ADDRESS:=%n}"
: "${CKPTFS_SLURM_SCONTROL:=scontrol}"
: "${CKPTFS_SLURM_RUN:=/run/ckptfs/slurm}"
: "${CKPTFS_SLURM_BY_NAME:=1}"

log() { # log PRIORITY MESSAGE...
    local priority=$1
    shift
    # Also on stderr, for runs by hand (slurmd discards it), and where there is
    # no syslog socket (a container), which logger fails on without a word.
    logger -t "$CKPTFS_SLURM_TAG" -p "daemon.$priority" -- "job ${SLURM_JOB_ID:-?}: $*" 2>/dev/null
    echo "$CKPTFS_SLURM_TAG: $priority: job ${SLURM_JOB_ID:-?}: $*" >&2
}

die() {
    log err "$*"
    exit 1
}

# Checks the Slurm environment and sets JOB_MNT, JOB_BACKING, JOB_CACHE, JOB_RUN
# (the job's generated config and secret, if it has peers) and JOB_ROOT.
job_setup() {
    # The job id ends up in an `rm -rf` path in the epilog: accept digits only.
    [[ ${SLURM_JOB_ID:-} =~ ^[0-9]+$ ]] || die "SLURM_JOB_ID '${SLURM_JOB_ID:-}' is not a job id"
    [ -n "${SLURMD_NODENAME:-}" ] || die "SLURMD_NODENAME is not set"
    [[ ${SLURM_JOB_USER:-} =~ ^[A-Za-z0-9_][A-Za-z0-9_.-]*$ ]] ||
        die "SLURM_JOB_USER '${SLURM_JOB_USER:-}' is not a user name"
    [ -x "$CKPTFS_SLURM_BIN" ] || die "ckptfs CLI $CKPTFS_SLURM_BIN is not executable"
    local root
    root=$(realpath -m -- "$CKPTFS_SLURM_ROOT") || die "bad CKPTFS_SLURM_ROOT '$CKPTFS_SLURM_ROOT'"
    [ "$root" != / ] || die "CKPTFS_SLURM_ROOT must not be /"
    JOB_ROOT=$root
    JOB_MNT="$root/$SLURM_JOB_ID"
    JOB_BACKING=${CKPTFS_SLURM_BACKING//%u/$SLURM_JOB_USER}
    JOB_BACKING=${JOB_BACKING//%j/$SLURM_JOB_ID}
    [ -n "${CKPTFS_SLURM_CACHE_ROOT%/}" ] || die "CKPTFS_SLURM_CACHE_ROOT must not be /"
    # One cache dir per job, so that the epilog can tell whether this job left
    # unflushed data behind and free exactly this job's RAM afterwards.
    JOB_CACHE="${CKPTFS_SLURM_CACHE_ROOT%/}/$SLURM_JOB_ID"
    [ -n "${CKPTFS_SLURM_RUN%/}" ] || die "CKPTFS_SLURM_RUN must not be /"
    JOB_RUN="${CKPTFS_SLURM_RUN%/}/$SLURM_JOB_ID"
}

# FIELD: one field of `scontrol show job -o` for this job, if it is there
# once and its value is one word. The user chooses some fields (the job name,
# the comment, paths), and one of those could hold " NodeList=..." or
# " JobName=...": a field seen twice, or a value followed by a word that is
# no FIELD=, is not trusted.
scontrol_job() {
    "$CKPTFS_SLURM_SCONTROL" show job -o "$SLURM_JOB_ID" 2>/dev/null | awk -v key="$1" '
        { for (i = 1; i <= NF; i++) if (index($i, key "=") == 1) { n++; at = i } }
        END {
            if (n != 1 || (at < NF && $(at + 1) !~ /^[A-Za-z]+=/)) exit 1
            print substr($at, length(key) + 2)
        }'
}

job_nodes() { # the job's nodes, one per line, in Slurm's order (the same on every node)
    local list=${SLURM_JOB_NODELIST:-${SLURM_NODELIST:-}}
    [ -n "$list" ] || list=$(scontrol_job NodeList)
    [ -n "$list" ] || return 1
    local node
    "$CKPTFS_SLURM_SCONTROL" show hostnames "$list" | while read -r node; do
        # Names go into the job's YAML config and must be ckptfs node names.
        [[ $node =~ ^[A-Za-z0-9_.-]{1,64}$ ]] || { log err "bad node name '$node'"; exit 1; }
        echo "$node"
    done
}

job_name_link() { # the by-name link of this job: <root>/by-name/<user>/<job name>
    local name
    name=${SLURM_JOB_NAME:-$(scontrol_job JobName)}
    # A name that is not one path component is not used (no link, no error).
    [[ $name =~ ^[A-Za-z0-9_.-]{1,128}$ && $name != . && $name != .. ]] || return 1
    echo "$JOB_ROOT/by-name/$SLURM_JOB_USER/$name"
}

mount_args() { # the `ckptfs mount` command line for this job
    MOUNT_CMD=("$CKPTFS_SLURM_BIN" mount "$JOB_MNT" --backing "$JOB_BACKING"
        --cache-dir "$JOB_CACHE" --node "$SLURMD_NODENAME")
    # A job with peers has its own config: the site's, and its peers section.
    if [ -r "$JOB_RUN/config.yaml" ]; then
        MOUNT_CMD+=(--config "$JOB_RUN/config.yaml")
    elif [ -r "$CKPTFS_SLURM_CONFIG" ]; then
        MOUNT_CMD+=(--config "$CKPTFS_SLURM_CONFIG")
    fi
}

in_mount_table() { # true if something is mounted exactly at $1
    awk -v m="$1" '$2 == m { found = 1 } END { exit !found }' /proc/self/mounts
}

# Prints live (mounted and answering), dead (mounted, daemon gone: ENOTCONN) or none.
mount_state() {
    if ! in_mount_table "$1"; then
        echo none
    elif stat -- "$1" >/dev/null 2>&1; then
        echo live
    else
        echo dead
    fi
}

detach() { # lazily unmount $1; the caller decides whether that was safe
    fusermount3 -u -z -- "$1" 2>/dev/null || umount -l -- "$1" 2>/dev/null
    ! in_mount_table "$1"
}

# Mounts this job's ckptfs; on failure leaves nothing mounted and returns 1.
job_mount() {
    local out status
    mount_args
    mkdir -p -- "$JOB_MNT" || die "cannot create mountpoint $JOB_MNT"
    # Output goes to a file, not a pipe: a daemon that inherited the pipe would
    # keep a $(...) waiting long after `ckptfs mount` itself returned.
    out=$(mktemp) || die "mktemp failed"
    timeout --kill-after=10 "$CKPTFS_SLURM_MOUNT_TIMEOUT" "${MOUNT_CMD[@]}" >"$out" 2>&1 </dev/null
    status=$?
    if [ "$status" -eq 0 ] && [ "$(mount_state "$JOB_MNT")" = live ]; then
        rm -f -- "$out"
        return 0
    fi
    log err "ckptfs mount $JOB_MNT (backing $JOB_BACKING) failed (exit $status):" \
        "$(tail -c 2000 -- "$out" | tr '\n' ' ')"
    rm -f -- "$out"
    if in_mount_table "$JOB_MNT"; then
        detach "$JOB_MNT" || log err "could not detach the failed mount at $JOB_MNT"
    fi
    return 1
}
