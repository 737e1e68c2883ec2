#!/usr/bin/env bash
# scripts/launch.sh — starts a spotune job under mpirun (Open MPI), one rank
# per GPU, on one node or on several listed in a hostfile. It passes the
# NCCL_*, SPOTUNE_*, AWS_* and OPENBLAS_* variables that are set (by name: values, AWS
# secrets included, are never printed), prints the mpirun command, and runs
# it (or only prints it with --dry-run). See docs/launching.md.
set -euo pipefail

usage() {
    cat <<'EOF'
usage: scripts/launch.sh [options] [--] PROGRAM [ARGS...]

  e.g. scripts/launch.sh build/spotune train configs/llama-7b-lora.yaml

options:
  -g, --gpus-per-node N  ranks per node (default: GPUs that nvidia-smi lists,
                         or the entries of CUDA_VISIBLE_DEVICES; 1 without GPUs)
  --hostfile FILE        run on the hosts in FILE (see scripts/hostfile.example)
  --nodes N              use the first N hosts of the hostfile (default: all)
  --bind none|numa       CPU binding of each rank (default: none, which leaves
                         the CUDA, NCCL and OpenMP threads free to move)
  --tcp                  MPI over TCP only (--mca btl tcp,self): for containers
                         where shared-memory transport fails, or to rule it out
  -x NAME                also pass variable NAME (repeatable)
  --mpirun PATH          the mpirun to use (default: mpirun on PATH)
  --dry-run              print the command and exit
  -h, --help             this text
EOF
}

gpus_here() {
    if [[ -n "${CUDA_VISIBLE_DEVICES:-}" ]]; then
        local IFS=,
        local ids=($CUDA_VISIBLE_DEVICES)
        echo "${#ids[@]}"
    elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
        nvidia-smi -L | grep -c '^GPU' || true
    else
        echo 1
    fi
}

# Hosts in an Open MPI hostfile: non-empty lines that are not comments.
hostfile_nodes() {
    { grep -v '^[[:space:]]*\(#\|$\)' "$1" || true; } | wc -l
}

# The first N of them, as mpirun's --host wants them: "a:SLOTS,b:SLOTS".
hostfile_first() {
    awk -v n="$2" -v s="$3" '!/^[[:space:]]*(#|$)/ && k < n { printf "%s%s:%s", k++ ? "," : "", $1, s }' "$1"
}

die() {
    echo "launch.sh: $*" >&2
    exit 2
}

gpus="" hostfile="" nodes="" bind="none" tcp=0 dry=0 mpirun="mpirun"
extra_vars=()
while [[ $# -gt 0 ]]; do
    case "$1" in
    -g | --gpus-per-node) gpus="${2:?}"; shift 2 ;;
    --hostfile) hostfile="${2:?}"; shift 2 ;;
    --nodes) nodes="${2:?}"; shift 2 ;;
    --bind) bind="${2:?}"; shift 2 ;;
    --tcp) tcp=1; shift ;;
    -x) extra_vars+=("${2:?}"); shift 2 ;;
    --mpirun) mpirun="${2:?}"; shift 2 ;;
    --dry-run) dry=1; shift ;;
    -h | --help) usage; exit 0 ;;
    --) shift; break ;;
    -*) usage >&2; die "unknown option $1" ;;
    *) break ;;
    esac
done
[[ $# -gt 0 ]] || { usage >&2; die "no program to launch"; }

[[ -n "$gpus" ]] || gpus=$(gpus_here)
[[ "$gpus" =~ ^[1-9][0-9]*$ ]] || die "--gpus-per-node: expected a positive number, got '$gpus'"
[[ "$bind" == none || "$bind" == numa ]] || die "--bind: none or numa, got '$bind'"

cmd=("$mpirun")
if [[ -n "$hostfile" ]]; then
    [[ -r "$hostfile" ]] || die "cannot read hostfile $hostfile"
    avail=$(hostfile_nodes "$hostfile")
    [[ -n "$nodes" ]] || nodes=$avail
    [[ "$nodes" =~ ^[1-9][0-9]*$ ]] || die "--nodes: expected a positive number, got '$nodes'"
    ((nodes <= avail)) || die "--nodes $nodes, but $hostfile lists $avail host(s)"
    cmd+=(--hostfile "$hostfile" -np $((nodes * gpus)) --map-by "ppr:${gpus}:node")
    # mpirun starts a daemon on every host of the file, whether it gets
    # ranks or not: with fewer nodes, name the ones to use, so that a host
    # that is gone (the reason to run on fewer) is left alone
    ((nodes < avail)) && cmd+=(--host "$(hostfile_first "$hostfile" "$nodes" "$gpus")")
else
    [[ -z "$nodes" || "$nodes" == 1 ]] || die "--nodes needs --hostfile"
    cmd+=(-np "$gpus" --map-by slot)
fi
cmd+=(--bind-to "$bind")
# On SIGTERM mpirun kills the ranks after odls_base_sigkill_timeout seconds
# (default 1): give a rank's stop checkpoint and upload time to finish.
sigkill_timeout=${SPOTUNE_SIGKILL_TIMEOUT:-120}
cmd+=(--mca odls_base_sigkill_timeout "$sigkill_timeout")
((tcp)) && cmd+=(--mca btl tcp,self)
# Several nodes: mpirun notices a node that went silent (a partition, a
# machine gone without a word) only through TCP keepalive on its connections
# to the other nodes' daemons, 300 s + 9 x 20 s by default, and while it has
# not, it cannot end the job. 10 s + 3 x 5 s instead; keep comm.timeout_s
# above that (a job that aborts first leaves mpirun waiting on the lost node
# for TCP's retransmission limit, about 15 minutes). OMPI_MCA_oob_tcp_keepalive_*
# in the environment take precedence.
if [[ -n "$hostfile" && -z "${OMPI_MCA_oob_tcp_keepalive_time:-}" ]]; then
    cmd+=(--mca oob_tcp_keepalive_time 10 --mca oob_tcp_keepalive_intvl 5
        --mca oob_tcp_keepalive_probes 3)
fi
[[ $(id -u) -eq 0 ]] && cmd+=(--allow-run-as-root)

# How the ranks say that they stopped with a complete checkpoint (exit 75):
# Open MPI's mpirun takes any non-zero exit of a rank for a failed job and
# then waits 2 x odls_base_sigkill_timeout (above) before it exits, whether
# the ranks are still there or not: 4 minutes after every stop. So the ranks
# exit 0 and rank 0 writes 75 into this file (one that it can open and that
# starts with this nonce: on a machine that does not see the file, it exits
# 75 itself), and this script exits 75.
status_file=""
if ((! dry)); then
    if status_file=$(mktemp "${TMPDIR:-/tmp}/spotune-exit.XXXXXX" 2>/dev/null); then
        trap 'rm -f "$status_file"' EXIT
        nonce=$(od -An -N8 -tx8 /dev/urandom | tr -d ' ')
        echo "$nonce" >"$status_file"
        export SPOTUNE_EXIT_STATUS_FILE=$status_file SPOTUNE_EXIT_STATUS_NONCE=$nonce
    else
        status_file=""
        echo "launch.sh: cannot make a status file in ${TMPDIR:-/tmp}: a stop (exit 75)" \
            "will end only after mpirun's 2 x odls_base_sigkill_timeout" >&2
    fi
fi

# Variables to pass, by name only: mpirun copies the value from here.
vars=()
while IFS= read -r name; do
    vars+=("$name")
done < <(compgen -e | grep -E '^(NCCL_|SPOTUNE_|AWS_|OPENBLAS_)' || true)
for name in CUDA_VISIBLE_DEVICES OMP_NUM_THREADS; do
    [[ -n "${!name+x}" ]] && vars+=("$name")
done
# Remote nodes start with a bare environment: give them ours for finding
# the program and its libraries.
[[ -n "$hostfile" ]] && vars+=(PATH LD_LIBRARY_PATH)
for name in "${extra_vars[@]+"${extra_vars[@]}"}"; do
    [[ -n "${!name+x}" ]] && vars+=("$name") || echo "launch.sh: -x $name: not set, skipped" >&2
done
for name in "${vars[@]+"${vars[@]}"}"; do
    [[ -n "${!name+x}" ]] && cmd+=(-x "$name")
done

# Prints the command as a shell would take it back, quoting only where needed.
show() {
    local line="+" a
    for a in "$@"; do
        if [[ "$a" =~ ^[A-Za-z0-9_./:=,+@%-]+$ ]]; then line+=" $a"; else line+=" $(printf '%q' "$a")"; fi
    done
    echo "$line" >&2
}

cmd+=("$@")
show "${cmd[@]}"

# Several nodes under scripts/spot-run.sh (SPOTUNE_SPOT_WATCH names the
# cloud it watches on this node): a watcher on every node too, through a
# second mpirun (spot-run.sh --watch-local, one a node, no MPI), which
# sends SIGUSR1 to its node's ranks when that node's notice comes; the
# ranks agree at the next micro-batch, so one node's notice stops the
# whole job with a checkpoint. This script then stays, forwards the
# signals to the job's mpirun and stops the watchers when it ends.
wcmd=()
if [[ -n "$hostfile" && "$nodes" -gt 1 && -n "${SPOTUNE_SPOT_WATCH:-}" &&
      -n "${SPOTUNE_SUPERVISOR_TAG:-}" && -n "${SPOTUNE_SPOT_RUN:-}" ]]; then
    wcmd=("$mpirun" --hostfile "$hostfile" -np "$nodes" --map-by ppr:1:node --bind-to none)
    ((nodes < avail)) && wcmd+=(--host "$(hostfile_first "$hostfile" "$nodes" 1)")
    [[ -z "${OMPI_MCA_oob_tcp_keepalive_time:-}" ]] &&
        wcmd+=(--mca oob_tcp_keepalive_time 10 --mca oob_tcp_keepalive_intvl 5
            --mca oob_tcp_keepalive_probes 3)
    [[ $(id -u) -eq 0 ]] && wcmd+=(--allow-run-as-root)
    wcmd+=(-x SPOTUNE_SUPERVISOR_TAG -x PATH)
    wcmd+=(bash "$SPOTUNE_SPOT_RUN" --cloud "$SPOTUNE_SPOT_WATCH" --watch-local)
    [[ -n "${SPOTUNE_SPOT_METADATA_URL:-}" ]] &&
        wcmd+=(--metadata-url "$SPOTUNE_SPOT_METADATA_URL")
    [[ -n "${SPOTUNE_SPOT_POLL:-}" ]] && wcmd+=(--poll "$SPOTUNE_SPOT_POLL")
    show "${wcmd[@]}"
fi
((dry)) && exit 0
# This script stays in front of mpirun (which, as a background job of a
# script, ignores SIGINT): SIGUSR1 goes on to it; the first SIGTERM or
# SIGINT (docker stop, a pod's end, Ctrl-C) becomes SIGUSR1 too, a stop with
# a checkpoint, where mpirun itself would kill the ranks after its timeout;
# a second one is passed on as SIGTERM (mpirun's own way to end the ranks:
# SIGTERM after odls_base_sigkill_timeout, SIGKILL after twice that).
job="" pending=""
# pass: a signal to the job, or (not started yet) kept for when it starts;
# (|| true: under set -e a failed kill in a trap, the job just gone, would
# end this script)
pass() {
    if [[ -n "$job" ]]; then kill -"$1" "$job" 2>/dev/null || true; else pending=$1; fi
}
asked=0
on_stop() {
    asked=$((asked + 1))
    if ((asked == 1)); then
        echo "launch.sh: $1: asking the ranks to checkpoint and stop (SIGUSR1 to mpirun);" \
            "a second SIGINT or SIGTERM has mpirun kill them (SIGTERM after" \
            "${sigkill_timeout} s, SIGKILL after twice that)" >&2
        pass USR1
    else
        pass TERM
    fi
}
trap 'sig=1; pass USR1' USR1
trap 'sig=1; on_stop SIGTERM' TERM
trap 'sig=1; on_stop SIGINT' INT
watchers=""
if ((${#wcmd[@]})); then
    "${wcmd[@]}" </dev/null >&2 &
    watchers=$!
fi
"${cmd[@]}" &
job=$!
[[ -n "$pending" ]] && pass "$pending"
while :; do
    sig=0 rc=0
    wait "$job" || rc=$?
    ((sig)) || break                       # the job ended: rc is its status
    kill -0 "$job" 2>/dev/null && continue # a trapped signal ended the wait
    # the job ended as a signal came: its status (if that wait had it, 127)
    first=$rc rc=0
    wait "$job" 2>/dev/null || rc=$?
    ((rc == 127)) && rc=$first
    break
done
if [[ -n "$watchers" ]]; then
    kill -TERM "$watchers" 2>/dev/null
    wait "$watchers" 2>/dev/null || true
fi
# rank 0 writes 75 after every rank agreed on the stop and its checkpoint
# was committed: that is the job's end, whatever mpirun made of its own
# (a signal passed on while it shuts down can make it exit 1)
[[ -n "$status_file" && $(sed -n 2p "$status_file" 2>/dev/null) == 75 ]] && rc=75
exit "$rc"
