#!/usr/bin/env bash
# tests/multinode/multinode.sh — spotune across several hosts made on this
# machine: each "node" is a Linux network namespace with its own address
# (192.0.2.0/24, a documentation range, on a bridge that lives in a
# namespace of its own: nothing is routed anywhere, nothing changes in the
# machine's own network), its own host name (a UTS namespace) and its own
# /etc/hosts (ip netns exec's /etc/netns/NS/hosts). mpirun runs on node-a and
# starts the other nodes' daemons through tests/multinode/agent.sh, which
# stands in for ssh (Open MPI's plm_rsh_agent) and gives them the bare
# environment of a login. The S3 test server (scripts/swift-s3.sh) runs on a
# "storage" node, on that namespace's own loopback, behind
# spotune-mn-forward (tests/multinode/mn_forward.c) on the storage node's
# address: its ports are private to the namespace, so it runs alongside the
# other S3 suites. A lost node is every process of its namespace killed; a
# partition is its link taken down (ip link set ... down).
#
# Cases (one per ctest entry, tests/multinode.cmake):
#   trajectory          2 nodes x 2 ranks train the same losses and adapter as
#                       4 ranks on one node (bit for bit: fixed-order sums,
#                       same world size) and as 1 rank with 4x accumulation
#                       (1e-5 relative, as tests/test_distributed.c)
#   launch_hostfile     scripts/launch.sh --hostfile: 2 ranks per node, the
#                       variables it passes by name reach the remote ranks and
#                       others do not, --nodes 1 starts nothing on node-b
#   node_lost           every process of node-b killed: the job ends within
#                       comm.timeout_s + 10 s and node-b is named: by
#                       spotune's roll call ("no answer from ranks 2, 3 on
#                       node-b") when the survivors live until the timeout,
#                       else by Open MPI, whose TCP transport ends them at
#                       once when their connections to node-b are reset
#   partition           node-b's link down: the same (spotune's own roll call
#                       names them), and node-b's ranks and daemon end too
#   storage_partition   the storage node cut off in the middle of a checkpoint
#                       upload (uploads slowed to 400 KB/s so that one lasts
#                       ~0.5 s): training goes on (20 steps or more meanwhile),
#                       every step says the remote is behind, and the
#                       checkpoints reach the bucket (and verify) once the
#                       link is back
#   resume_fewer_ranks  node-b lost; the restart on node-a alone (2 ranks
#                       instead of 4) resumes from the bucket and trains every
#                       sample exactly once (log.samples audit)
#   sharded_shared_dir  full fine-tuning on 2 nodes x 2 ranks whose run.dir is
#                       one directory both see (a shared file system): the
#                       start finds it shared and the checkpoints are
#                       sharded (a file from each of the 4 ranks); the model
#                       is that of 1 node x 4 ranks, bit for bit
#   sharded_spread      the same with run.dir not shared (node-b sees its own
#                       disk there: a bind mount, agent.sh) and a bucket: the
#                       checkpoints are sharded across the machines, whole in
#                       the bucket, node-a keeps its ranks' shards and node-b
#                       none; restarts on both nodes and on node-a alone (2
#                       ranks) read node-a's shards from its disk and the
#                       rest from the bucket (a checkpoint whose shard the
#                       bucket lost is passed over); losses as 1 node x 4;
#                       node-b's shards of a run's last checkpoint, refused
#                       by the bucket past upload_deadline_s, put at the
#                       run's end once it takes them again
#   spot_watch          a spot notice on node-b alone (each node's own metadata
#                       service): scripts/spot-run.sh on node-a, launch.sh's
#                       watcher on node-b signals node-b's ranks only, the
#                       job stops with a checkpoint, the supervisor restarts
#                       and the restart resumes; no watcher is left behind
#   doctor              spotune doctor over 2 nodes x 2 ranks: one report
#                       from rank 0, each node's host and storage lines once,
#                       named by its host; a FAIL on rank 0 ends all with 1
# Timing knobs used: comm.timeout_s 4; SPOTUNE_SIGKILL_TIMEOUT 4 (mpirun
# holds 2 x this after it notices a lost node, handling nothing else: with
# launch.sh's default of 120 s every failure case would take 4 minutes, see
# docs/launching.md); Open MPI's keepalive on its own connections
# 1 s + 2 x 1 s (partitions: below comm.timeout_s, as it must be).
#
# Skips (exit 77) with the reason where namespaces cannot be made: not root,
# no ip/unshare/mpirun, or the kernel refuses. Namespaces, links and every
# process in them are removed on every exit (trap); their names carry this
# shell's pid, and the namespaces and work directory of a run that was
# killed outright are removed by the next run.
# usage: tests/multinode/multinode.sh BUILD_DIR CASE
set -uo pipefail

build=$(cd "${1:?usage: multinode.sh BUILD_DIR CASE}" && pwd)
case_name=${2:?usage: multinode.sh BUILD_DIR CASE}
src=$(cd "$(dirname "$0")/../.." && pwd)
here=$src/tests/multinode
spotune=$build/spotune
store_tool=$build/checkpoint/spotune-store-tool
forward=$build/tests/spotune-mn-forward
audit=$build/tests/spotune-mn-audit
launch=$src/scripts/launch.sh

T=4 # comm.timeout_s of the failure cases
K=4 # SPOTUNE_SIGKILL_TIMEOUT of the failure cases

skip() {
    echo "SKIP: $*"
    exit 77
}
fails=0
check() { # check NAME STATUS DETAIL
    if [[ $2 -eq 0 ]]; then echo "ok   $1"; else
        echo "FAIL $1: $3"
        fails=$((fails + 1))
    fi
}
has() { grep -qE -- "$2" <<<"$1"; }
now() { echo "$EPOCHREALTIME"; }
elapsed() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }
le() { awk -v a="$1" -v b="$2" 'BEGIN { exit !(a <= b) }'; } # a <= b

[[ $(id -u) -eq 0 ]] || skip "network namespaces need root (running as uid $(id -u))"
for t in ip unshare mpirun awk; do
    command -v "$t" >/dev/null 2>&1 || skip "no '$t' command"
done
for f in "$spotune" "$store_tool" "$forward" "$audit"; do
    [[ -x $f ]] || { echo "FAIL: $f is not built"; exit 1; }
done

# ---- namespaces ---------------------------------------------------------------

# A process that exists and is not a zombie (a killed process whose parent
# has not reaped it yet still answers kill -0).
alive() {
    local stat
    stat=$(cat "/proc/$1/stat" 2>/dev/null) || return 1
    stat=${stat##*) }
    [[ ${stat%% *} != Z && ${stat%% *} != X ]]
}

# Namespaces of runs that were killed outright (their owner pid is gone).
for old in $(ip netns list 2>/dev/null | awk '{ print $1 }' | grep -E '^spotune-mn[0-9]+-'); do
    owner=${old#spotune-mn}
    owner=${owner%%-*}
    alive "$owner" && continue
    pids=$(ip netns pids "$old" 2>/dev/null)
    [[ -n $pids ]] && kill -9 $pids 2>/dev/null
    ip netns del "$old" 2>/dev/null
    rm -rf "/etc/netns/$old"
done

id="mn$$-$(printf %04x $RANDOM)"
work=""
etc_netns_made=0 # /etc/netns did not exist before this run
[[ -d /etc/netns ]] || etc_netns_made=1
made=() # namespace suffixes created: sw, a, b, c, s
ns_of() { echo "spotune-$id-$1"; }
host_of() { if [[ $1 == s ]]; then echo storage; else echo "node-$1"; fi; }
addr_of() {
    case $1 in a) echo 192.0.2.1 ;; b) echo 192.0.2.2 ;; c) echo 192.0.2.3 ;; s) echo 192.0.2.100 ;; esac
}

# Kills every process of a namespace (repeatedly: a dying launcher may start
# more); waits until none is left.
kill_ns() {
    local ns pids i
    ns=$(ns_of "$1")
    for i in $(seq 200); do
        pids=$(ip netns pids "$ns" 2>/dev/null)
        [[ -z $pids ]] && return 0
        kill -9 $pids 2>/dev/null
        sleep 0.02
    done
}

cleanup() {
    local n
    for n in "${made[@]+"${made[@]}"}"; do kill_ns "$n"; done
    for n in "${made[@]+"${made[@]}"}"; do
        ip netns del "$(ns_of "$n")" 2>/dev/null
        rm -rf "/etc/netns/$(ns_of "$n")"
    done
    ((etc_netns_made)) && rmdir /etc/netns 2>/dev/null
    [[ -n $work ]] && rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# topo_up NODE... (a b c s): the switch, then each node on it.
topo_up() {
    local sw n ns out
    sw=$(ns_of sw)
    out=$(ip netns add "$sw" 2>&1) || skip "cannot create a network namespace: $out"
    made+=(sw)
    ip -n "$sw" link set lo up
    out=$(ip -n "$sw" link add br0 type bridge 2>&1) || skip "cannot create a bridge: $out"
    ip -n "$sw" link set br0 up
    for n in "$@"; do
        ns=$(ns_of "$n")
        ip netns add "$ns" || return 1
        made+=("$n")
        ip -n "$ns" link set lo up
        out=$(ip -n "$sw" link add "p$n" type veth peer name eth0 netns "$ns" 2>&1) ||
            skip "cannot create a veth pair: $out"
        ip -n "$sw" link set "p$n" master br0 up
        ip -n "$ns" addr add "$(addr_of "$n")/24" dev eth0
        ip -n "$ns" link set eth0 up
        echo "$(host_of "$n") $ns" >>"$work/hosts.map"
    done
    for n in "$@"; do
        ns=$(ns_of "$n")
        mkdir -p "/etc/netns/$ns"
        {
            echo "127.0.0.1 localhost"
            for m in "$@"; do echo "$(addr_of "$m") $(host_of "$m")"; done
        } >"/etc/netns/$ns/hosts"
    done
}

# link NODE up|down: the node's port on the switch.
link() { ip -n "$(ns_of sw)" link set "p$1" "$2"; }

# on_node NODE CMD...: runs CMD on the node, under its host name.
on_node() {
    local n=$1
    shift
    ip netns exec "$(ns_of "$n")" unshare --uts /bin/sh -c 'hostname "$0" && exec "$@"' \
        "$(host_of "$n")" "$@"
}

# wait_until LIMIT_S CMD...: polls CMD until it succeeds (0) or LIMIT_S pass (1).
wait_until() {
    local limit=$1 t0
    shift
    t0=$(now)
    until "$@"; do
        le "$(elapsed "$t0")" "$limit" || return 1
        sleep 0.05
    done
}
running() { alive "$1"; }

# ---- what every case shares -----------------------------------------------------

mkdir -p "$build/tmp"
# the work directories of killed runs, as their namespaces above
for old in "$build"/tmp/spotune-mn*; do
    [[ -d $old ]] || continue
    owner=${old##*/spotune-mn}
    owner=${owner%%-*}
    alive "$owner" || rm -rf "$old"
done
mkdir "$build/tmp/spotune-$id-$case_name" || exit 1
work=$build/tmp/spotune-$id-$case_name
: >"$work/hosts.map"
printf 'node-a slots=2\nnode-b slots=2\n' >"$work/hosts"

# Open MPI on node-a (mpirun's environment; launch.sh passes the rest by name)
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_plm_rsh_agent=$here/agent.sh OMPI_MCA_plm_rsh_no_tree_spawn=1
export OMPI_MCA_btl_tcp_if_include=192.0.2.0/24 OMPI_MCA_oob_tcp_if_include=192.0.2.0/24
export OMPI_MCA_pml=ob1 OMPI_MCA_btl=tcp,self OMPI_MCA_rmaps_base_oversubscribe=1
export SPOTUNE_MN_HOSTS=$work/hosts.map
# as tests/test_util.c tu_mpirun(): in a sanitizer build, Open MPI's own
# allocations match the leak suppressions only with slow unwinding, and the
# leak check at a rank's exit must not walk the dynamic-TLS blocks the
# runtime records (see tu_mpirun)
export ASAN_OPTIONS="${ASAN_OPTIONS:+$ASAN_OPTIONS:}fast_unwind_on_malloc=0:intercept_tls_get_addr=0"
export LSAN_OPTIONS="${LSAN_OPTIONS:+$LSAN_OPTIONS:}suppressions=$src/tests/lsan.supp:print_suppressions=0"
pass=(-x ASAN_OPTIONS -x LSAN_OPTIONS)
# the BLAS kernels of this machine's environment on every node (a machine
# may set OPENBLAS_CORETYPE; a rank started bare picks other kernels, whose
# last bits differ: the layouts would not give the same bits), as
# scripts/launch.sh passes them
while IFS= read -r v; do pass+=(-x "$v"); done < <(compgen -e | grep -E '^OPENBLAS_' || true)
[[ -n ${UBSAN_OPTIONS:-} ]] && pass+=(-x UBSAN_OPTIONS)
# the test server's fixed, public credentials (scripts/swift-s3.sh), and
# nothing of another store's
unset AWS_SESSION_TOKEN AWS_ENDPOINT_URL AWS_ENDPOINT_URL_S3 AWS_CA_BUNDLE AWS_PROFILE
export AWS_ACCESS_KEY_ID=test:tester AWS_SECRET_ACCESS_KEY=spotune-local-test-secret-7f3a
export AWS_REGION=us-east-1

# The tiny model and data of the other training tests, and a LoRA run.
inputs() {
    mkdir -p "$work/in"
    "$src/scripts/make_demo_text.sh" "$work/in/text.txt" 3 >/dev/null &&
        "$spotune" prepare-text "$work/in/text.txt" "$work/in/data" --val-fraction 0 >/dev/null &&
        "$spotune" init-model --preset tiny --seed 5 "$work/in/model" >/dev/null ||
        { echo "FAIL: could not make the inputs"; exit 1; }
    cat >"$work/run.yaml" <<EOF
run:
  seed: 21
model:
  path: $work/in/model
train:
  mode: lora
  steps: 20
  seq_len: 32
  micro_batch: 2
  grad_accum: 1
  lr: 3e-3
  warmup_steps: 4
lora:
  r: 4
  alpha: 8
  dropout: 0.1
  targets: [q_proj, v_proj, down_proj]
data:
  train: $work/in/data.train.h5
log:
  every: 1
runtime:
  backend: cpu
  threads: 1
comm:
  timeout_s: $T
checkpoint:
  every_minutes: 0
  keep: 2
EOF
}

# train_cmd NAME [--set ...]: spotune train on the run config, in WORK/NAME
train_cmd() {
    local name=$1
    shift
    echo "$spotune" train "$work/run.yaml" --set "run.dir=$work/$name" "$@"
}

# launch_bg LOG [launch.sh options --] PROGRAM...: launch.sh on node-a in the
# background; sets $job (mpirun's pid, through exec).
launch_bg() {
    local log=$1
    shift
    on_node a env SPOTUNE_SIGKILL_TIMEOUT=$K "$launch" --hostfile "$work/hosts" --tcp \
        "${pass[@]}" "$@" >"$log" 2>&1 &
    job=$!
}

metrics() { cat "$work/$1/metrics.jsonl" 2>/dev/null; }
# the loss of every train record, one a line, as written (%.17g)
losses() { metrics "$1" | grep -o '"event":"train","step":[0-9]*,"loss":[^,]*' | sed 's/.*"loss"://'; }
steps_logged() { metrics "$1" | grep -c '"event":"train"'; }
reached() { metrics "$1" | grep -q "\"event\":\"train\",\"step\":$2,"; }

# procs_of NODE NAME: pids of processes called NAME on the node
procs_of() {
    local p
    for p in $(ip netns pids "$(ns_of "$1")" 2>/dev/null); do
        [[ $(cat "/proc/$p/comm" 2>/dev/null) == "$2" ]] && echo "$p"
    done
}
no_procs() { [[ -z $(procs_of "$1" "$2") ]]; }

# The storage node: the S3 test server on its loopback, the forwarder on its
# address (port 8080), a bucket. $1: the forwarder's rate limit (bytes/s, 0: none).
storage_up() {
    local rate=$1 out
    out=$(on_node s env SWIFT_S3_BASE="$work/swift" bash "$src/scripts/swift-s3.sh" start 2>&1) ||
        { echo "FAIL: the S3 test server did not start on the storage node: $out"; exit 1; }
    on_node s "$forward" "$(addr_of s):8080" 127.0.0.1:28080 --rate "$rate" \
        --log "$work/forward.log" --refuse "$work/refuse" >/dev/null 2>&1 &
    wait_until 10 grep -q listening "$work/forward.log" 2>/dev/null ||
        { echo "FAIL: the forwarder did not start"; exit 1; }
    endpoint=http://storage:8080
    url=s3://spotune-mn/run-$id
    out=$(on_node a "$store_tool" --endpoint "$endpoint" --path-style mb "$url" 2>&1) ||
        { echo "FAIL: no bucket: $out"; exit 1; }
    keep "$out"
    cat >>"$work/run.yaml" <<EOF
  remote: $url
  endpoint: $endpoint
  region: us-east-1
  addressing: path
EOF
}

# keep TEXT: the output of a program run in the foreground, for the
# sanitizer scan of report()
keep() { printf '%s\n' "$1" >>"$work/outputs.log"; }

report() {
    local f found
    # a sanitizer report in any rank's output (they reach the logs, not ctest)
    found=$(grep -lE "ERROR: (LeakSanitizer|AddressSanitizer)|runtime error:" "$work"/*.log 2>/dev/null)
    [[ -z $found ]]
    check "no sanitizer report in the programs' output" $? "$found"
    if ((fails > 0)); then
        for f in "$@"; do
            [[ -f $f ]] || continue
            echo "---- $f (last 40 lines)"
            tail -n 40 "$f"
        done
        echo "$fails check(s) failed"
        exit 1
    fi
    echo "all $case_name checks passed"
    exit 0
}

# ---- cases -----------------------------------------------------------------------

case_trajectory() {
    topo_up a b
    inputs
    local out rc before after
    # where the ranks of "2 nodes x 2" land
    out=$(on_node a mpirun --hostfile "$work/hosts" -np 4 --map-by ppr:2:node --bind-to none \
        sh -c 'echo "rank $OMPI_COMM_WORLD_RANK on $(hostname)"' 2>&1)
    has "$out" "rank 0 on node-a" && has "$out" "rank 1 on node-a" &&
        has "$out" "rank 2 on node-b" && has "$out" "rank 3 on node-b"
    check "2 ranks on each node" $? "$out"

    before=$(ip -n "$(ns_of sw)" -s -j link show pb | grep -o '"bytes":[0-9]*' | head -1 | cut -d: -f2)
    out=$(on_node a mpirun --hostfile "$work/hosts" -np 4 --map-by ppr:2:node --bind-to none \
        "${pass[@]}" $(train_cmd two-nodes) 2>&1)
    rc=$?
    keep "$out"
    after=$(ip -n "$(ns_of sw)" -s -j link show pb | grep -o '"bytes":[0-9]*' | head -1 | cut -d: -f2)
    check "2 nodes x 2 ranks train" $rc "$out"
    ((after - before > 100000))
    check "the gradients crossed the link to node-b ($((after - before)) bytes)" $? \
        "only $((after - before)) bytes went through node-b's port"
    out=$(on_node a mpirun --host node-a:4 -np 4 --bind-to none "${pass[@]}" \
        $(train_cmd one-node) 2>&1)
    check "1 node x 4 ranks trains" $? "$out"
    keep "$out"
    out=$(on_node a $(train_cmd one-rank --set train.grad_accum=4) 2>&1)
    check "1 rank x 4 micro-batches trains" $? "$out"
    keep "$out"

    local a b c
    a=$(losses two-nodes)
    b=$(losses one-node)
    c=$(losses one-rank)
    [[ $(wc -l <<<"$a") -eq 20 && $(wc -l <<<"$b") -eq 20 && $(wc -l <<<"$c") -eq 20 ]]
    check "20 steps logged by each run" $? "$(wc -l <<<"$a") / $(wc -l <<<"$b") / $(wc -l <<<"$c")"
    [[ "$a" == "$b" ]]
    check "2 nodes: the losses of 1 node, bit for bit" $? "$(paste <(echo "$a") <(echo "$b"))"
    cmp -s "$work/two-nodes/adapter/adapter_model.safetensors" \
        "$work/one-node/adapter/adapter_model.safetensors"
    check "2 nodes: the adapter of 1 node, bit for bit" $? "the adapters differ"
    out=$(paste <(echo "$a") <(echo "$c") |
        awk '{ d = $1 - $2; if (d < 0) d = -d; r = $2 < 0 ? -$2 : $2
               if (d > 1e-5 * r) { printf "step %d: %.9g vs %.9g\n", NR, $1, $2; bad = 1 } }
             END { exit bad }')
    check "2 nodes: the losses of 1 rank within 1e-5 relative" $? "$out"
    report "$work/two-nodes/metrics.jsonl"
}

case_launch_hostfile() {
    topo_up a b
    local out probe='echo "rank=$OMPI_COMM_WORLD_RANK host=$(hostname) probe=${SPOTUNE_MN_PROBE:-unset} key=${AWS_ACCESS_KEY_ID:-unset} other=${MN_OTHER:-unset}"'
    out=$(on_node a env -u OMPI_MCA_oob_tcp_keepalive_time SPOTUNE_MN_PROBE=p-19 MN_OTHER=o-23 \
        "$launch" --hostfile "$work/hosts" -g 2 --tcp -- sh -c "$probe" 2>&1)
    check "launch.sh --hostfile runs" $? "$out"
    has "$out" "\+ mpirun --hostfile $work/hosts -np 4 --map-by ppr:2:node --bind-to none"
    check "the mpirun command: hostfile, 4 ranks, 2 per node" $? "$out"
    has "$out" "-x PATH" && has "$out" "-x SPOTUNE_MN_PROBE" && has "$out" "-x AWS_SECRET_ACCESS_KEY"
    check "PATH, SPOTUNE_* and AWS_* passed by name" $? "$out"
    ! grep '^+ ' <<<"$out" | grep -q "$AWS_SECRET_ACCESS_KEY"
    check "no secret on the command line" $? "$out"
    has "$out" "--mca oob_tcp_keepalive_time [0-9]+ --mca oob_tcp_keepalive_intvl [0-9]+ --mca oob_tcp_keepalive_probes [0-9]+"
    check "mpirun told to notice a silent node (TCP keepalive)" $? "$out"
    has "$out" "rank=0 host=node-a" && has "$out" "rank=1 host=node-a" &&
        has "$out" "rank=2 host=node-b" && has "$out" "rank=3 host=node-b"
    check "ranks 0, 1 on node-a and 2, 3 on node-b" $? "$out"
    [[ $(grep -c "probe=p-19 key=test:tester" <<<"$out") -eq 4 ]]
    check "the variables passed by name reach every rank" $? "$out"
    has "$out" "rank=2 host=node-b probe=p-19 key=test:tester other=unset" &&
        has "$out" "rank=3 host=node-b probe=p-19 key=test:tester other=unset"
    check "a variable not passed does not reach node-b (a bare login)" $? "$out"

    # --nodes 1 while node-b cannot be reached: nothing may be started there
    link b down
    out=$(on_node a timeout 60 "$launch" --hostfile "$work/hosts" -g 2 --nodes 1 --tcp -- sh -c "$probe" 2>&1)
    check "--nodes 1 runs with node-b cut off" $? "$out"
    [[ $(grep -c "host=node-a" <<<"$out") -eq 2 ]] && ! has "$out" "host=node-b"
    check "--nodes 1: 2 ranks, both on node-a" $? "$out"
    has "$out" "--host node-a:2"
    check "--nodes 1 names the host it uses" $? "$out"
    link b up

    # a real collective across the nodes
    if [[ -x $build/tests/spotune-comm-prog ]]; then
        out=$(on_node a env SPOTUNE_SIGKILL_TIMEOUT=$K timeout 120 "$launch" --hostfile "$work/hosts" \
            -g 2 --tcp "${pass[@]}" -- "$build/tests/spotune-comm-prog" allreduce 2>&1)
        keep "$out"
        has "$out" "ok allreduce on 4 rank\(s\)"
        check "an all-reduce across the nodes" $? "$out"
    fi
    report
}

# pids of the spot watchers (spot-run.sh --watch-local) on a node
watchers_on() {
    local p
    for p in $(ip netns pids "$(ns_of "$1")" 2>/dev/null); do
        tr '\0' ' ' 2>/dev/null <"/proc/$p/cmdline" | grep -q -- "--watch-local" && echo "$p"
    done
}

watchers_on_both() { [[ -n $(watchers_on a) && -n $(watchers_on b) ]]; }
watchers_gone() { [[ -z $(watchers_on a)$(watchers_on b) ]]; }

# A spot notice on a worker: scripts/spot-run.sh on node-a runs
# scripts/launch.sh --hostfile, which starts a watcher on each node through
# a second mpirun. Each node has its own metadata service (the same URL,
# on its own loopback: a machine's link-local service is its own); only
# node-b's gives a notice. Its watcher sends SIGUSR1 to node-b's ranks,
# and to them alone; the job stops with a checkpoint (exit 75); the
# supervisor, whose own node has no notice, restarts it, and the restart
# resumes (the notice is taken down once seen, as if node-b had been
# spared, so that the restart can run); SIGTERM to the supervisor ends it
# all with 75; every step is trained and logged once, and no watcher is
# left on either node.
case_spot_watch() {
    topo_up a b
    inputs
    local port=18169 n log=$work/watch.log
    for n in a b; do
        on_node "$n" python3 "$src/tests/tools/fake_metadata.py" --port "$port" \
            --trigger "$work/notice-$n" >"$work/meta-$n.out" 2>&1 &
    done
    wait_until 30 grep -qx "$port" "$work/meta-a.out" &&
        wait_until 30 grep -qx "$port" "$work/meta-b.out"
    check "a metadata service on each node's loopback" $? "$(cat "$work"/meta-*.out)"
    # (the background job is a subshell running on_node: the supervisor's
    # own pid comes from the file, its exit status from the subshell)
    on_node a sh -c 'echo $$ >"$0" && exec "$@"' "$work/sup.pid" \
        env SPOTUNE_SIGKILL_TIMEOUT=$K "$src/scripts/spot-run.sh" --cloud aws \
        --metadata-url "http://127.0.0.1:$port" --poll 0.2 --resend 1 --orphan-wait 20 -- \
        "$launch" --hostfile "$work/hosts" -g 2 --tcp "${pass[@]}" -- \
        $(train_cmd watch --set train.steps=100000) >"$log" 2>&1 &
    local sup=$!
    wait_until 120 reached watch 5
    check "training runs on 2 nodes under spot-run.sh" $? "$(tail -20 "$log")"
    wait_until 30 watchers_on_both
    check "a watcher on each node" $? "a: $(watchers_on a); b: $(watchers_on b)"
    local ranks_b
    ranks_b=$(procs_of b spotune | sort -n | xargs)
    [[ $(wc -w <<<"$ranks_b") -eq 2 ]]
    check "node-b runs 2 ranks" $? "$ranks_b"

    touch "$work/notice-b"
    wait_until 30 grep -q "spot termination notice from aws on node-b" "$log"
    check "node-b's watcher sees node-b's notice" $? "$(tail -20 "$log")"
    wait_until 30 grep -q "on node-b: SIGUSR1 sent to pids" "$log"
    rm -f "$work/notice-b"
    local sent
    sent=$(grep -o "on node-b: SIGUSR1 sent to pids .*" "$log" | head -1 | sed 's/.*pids //' |
        tr ' ' '\n' | sort -n | xargs)
    [[ $sent == "$ranks_b" ]]
    check "it signals node-b's ranks and nothing else" $? \
        "sent to '$sent', node-b's ranks '$ranks_b'"
    wait_until 60 grep -q "checkpointed and stopped (exit 75): restarting to resume" "$log"
    check "the job stops with a checkpoint (75) and the supervisor restarts it" $? \
        "$(tail -30 "$log")"
    # rank 0 (node-a) got no signal of its own: node-b's ranks told it
    has "$(cat "$log")" "stop requested \(another rank\): committing checkpoint" &&
        ! has "$(cat "$log")" "stop requested \(SIG"
    check "rank 0 stops for another rank's signal, not its own" $? "$(grep "stop requested" "$log")"
    local before
    before=$(steps_logged watch)
    wait_until 120 bash -c "grep -q 'resumed from' '$log' && \
        (( \$(grep -c '\"event\":\"train\"' '$work/watch/metrics.jsonl') > $before + 3 ))"
    check "the restart resumes and trains on" $? "$(tail -30 "$log")"

    kill -TERM "$(cat "$work/sup.pid")"
    wait_until 120 bash -c "! kill -0 $sup 2>/dev/null"
    local rc
    if running "$sup"; then
        kill -9 "$sup"
        rc=-1
    else
        wait "$sup"
        rc=$?
    fi
    keep "$(cat "$log")"
    ((rc == 75)) &&
        has "$(cat "$log")" "checkpointed and stopped \(exit 75\); this machine is going away"
    check "SIGTERM to the supervisor: a checkpoint and exit 75 (exit $rc)" $? "$(tail -20 "$log")"
    ! has "$(cat "$log")" "notice from aws on node-a"
    check "node-a's watchers see no notice" $? "$(grep "notice" "$log")"
    local dup last count
    dup=$(metrics watch | grep -o '"event":"train","step":[0-9]*' | sort | uniq -d | head -3)
    last=$(metrics watch | grep -o '"event":"train","step":[0-9]*' | sed 's/.*://' |
        sort -n | tail -1)
    count=$(steps_logged watch)
    [[ -z $dup && $count -eq $last && $(grep -c 'resumed from' "$log") -eq 1 ]]
    check "steps 1-$last logged once each, one resume" $? "duplicates: $dup; $count records"
    wait_until 20 watchers_gone
    check "no watcher left on either node" $? "pids $(watchers_on a) $(watchers_on b)"
    ! grep -q "^Terminated" "$log"
    check "the watchers end without a word (no 'Terminated' from their shells)" $? \
        "$(grep -c "^Terminated" "$log") line(s)"
    report "$log"
}

# Waits for the job to end (up to 120 s); sets $rc and $took.
wait_job() {
    local t0=$1
    wait_until 120 bash -c "! kill -0 $job 2>/dev/null"
    if running "$job"; then
        kill -9 "$job"
        rc=-1
    else
        wait "$job"
        rc=$?
    fi
    took=$(elapsed "$t0")
}

# The end of a job after node-b failed: fast, non-zero, node-b named. $3:
# "ours" when spotune's own roll call must be the one to name it (a
# partition: the ranks wait until comm.timeout_s); "any" when Open MPI may
# name it first (a node killed: the survivors' connections to it are reset
# at once, and Open MPI ends them and the job before any timeout).
expect_ends_naming_node_b() {
    local what=$1 log=$2 who=$3 bound=$((T + 10)) ours theirs
    ((rc != 0 && rc != -1))
    check "$what: the job fails (exit $rc)" $? "$(tail -20 "$log")"
    le "$took" "$bound"
    check "$what: the job ended ${took} s after (within comm.timeout_s $T + 10 s)" $? \
        "it took $took s"
    ours=$(grep -E "^spotune: rank [01] on node-a: collective [a-z_]+ timed out after $T s \(a peer may have died\); no answer from .*ranks 2, 3 on node-b" "$log" | head -1)
    theirs=$(grep -E "^ *(Remote daemon: .* on node node-b|Peer host: +node-b)\$" "$log" | head -1)
    if [[ $who == ours ]]; then
        [[ -n $ours ]]
        check "$what: spotune names ranks 2, 3 on node-b${ours:+ ($ours)}" $? "$(grep -E 'spotune:|node-b' "$log")"
    else
        [[ -n $ours || -n $theirs ]]
        check "$what: node-b is named (${ours:-${theirs:-nowhere}})" $? "$(grep -E 'spotune:|node' "$log")"
    fi
    wait_until 10 no_procs a spotune
    check "$what: no rank left on node-a" $? "$(procs_of a spotune)"
}

case_node_lost() {
    topo_up a b
    inputs
    launch_bg "$work/lost.log" -g 2 -- $(train_cmd lost --set train.steps=100000)
    wait_until 120 reached lost 5
    check "training runs on 2 nodes" $? "$(tail -20 "$work/lost.log")"
    local t0
    t0=$(now)
    kill_ns b # node-b is lost: every process on it
    wait_job "$t0"
    expect_ends_naming_node_b "node lost" "$work/lost.log" any
    report "$work/lost.log"
}

case_partition() {
    topo_up a b
    inputs
    # mpirun notices a silent node after 1 s + 2 x 1 s of keepalive (launch.sh
    # takes these from the environment instead of its defaults)
    export OMPI_MCA_oob_tcp_keepalive_time=1 OMPI_MCA_oob_tcp_keepalive_intvl=1 \
        OMPI_MCA_oob_tcp_keepalive_probes=2
    launch_bg "$work/part.log" -g 2 -- $(train_cmd part --set train.steps=100000)
    wait_until 120 reached part 5
    check "training runs on 2 nodes" $? "$(tail -20 "$work/part.log")"
    local t0 bound=$((T + 10))
    t0=$(now)
    link b down
    wait_job "$t0"
    expect_ends_naming_node_b "partition" "$work/part.log" ours
    wait_until "$bound" bash -c "[[ -z \$(ip netns pids '$(ns_of b)') ]]"
    check "partition: node-b's ranks and daemon end too (within $bound s)" $? \
        "still running on node-b after $(elapsed "$t0") s: $(for p in $(ip netns pids "$(ns_of b)"); do cat "/proc/$p/comm"; done | tr '\n' ' ')"
    report "$work/part.log"
}

case_storage_partition() {
    topo_up a b s
    inputs
    storage_up 400000 # bytes/s: a checkpoint's state.h5 (0.2 MiB) takes ~0.5 s
    printf 'node-a slots=1\nnode-b slots=1\n' >"$work/hosts"
    # Steps take ~6 ms here, and a checkpoint taken while an upload is under
    # way supersedes the one waiting: the run is long enough that the second
    # upload (the first after step 10's) starts well before its end on a
    # machine several times faster, whichever step it picks.
    local steps=400
    launch_bg "$work/sp.log" -g 1 -- $(train_cmd sp --set train.steps=$steps \
        --set checkpoint.every_steps=10 --set checkpoint.keep=3 --set comm.timeout_s=60)
    # the link goes down right after the upload of a checkpoint's state began
    # (one from step 20 on, that leaves 40 steps or more to train)
    local put step t_down t_up s_down
    mid_put() {
        grep -oE "> PUT /spotune-mn/run-$id/step-[0-9]{8}/state.h5" "$work/forward.log" 2>/dev/null |
            awk -v last=$((steps - 40)) '{ s = substr($0, index($0, "/step-") + 6, 8) + 0
                if (s >= 20 && s <= last) { print; exit } }'
    }
    mid_put_seen() { [[ -n $(mid_put) ]] || ! kill -0 "$job" 2>/dev/null; }
    wait_until 120 mid_put_seen
    put=$(mid_put)
    link s down
    t_down=$(now)
    check "an upload was under way when the storage node was cut off" $([[ -n $put ]]; echo $?) \
        "no upload seen: $(tail -5 "$work/forward.log")"
    step=$(sed -E 's|.*/step-0*([0-9]+)/state.h5.*|\1|' <<<"$put")
    s_down=$(steps_logged sp)
    # cut off for 20 steps (two checkpoints taken meanwhile) and at least 4 s,
    # at most 25 s: the upload in flight must not reach its 30 s stall limit
    wait_until 25 bash -c "(( \$(grep -c '\"event\":\"train\"' '$work/sp/metrics.jsonl') >= $s_down + 20 )) || ! kill -0 $job"
    while ! le 4 "$(elapsed "$t_down")"; do sleep 0.05; done
    link s up
    t_up=$(now)
    wait_job "$t_down"
    check "the run ends well (exit $rc)" $rc "$(tail -20 "$work/sp.log")"

    # the train records written while the storage node was cut off
    local during
    during=$(metrics sp | awk -v a="$t_down" -v b="$t_up" '/"event":"train"/ {
        match($0, /"time":[0-9.]+/); t = substr($0, RSTART + 7, RLENGTH - 7) + 0
        if (t > a && t < b) { match($0, /"remote_behind":[0-9-]+/)
            print substr($0, RSTART + 16, RLENGTH - 16) } }')
    local n last min
    n=$(grep -c . <<<"$during")
    last=$(tail -1 <<<"$during")
    min=$(sort -n <<<"$during" | head -1)
    ((n >= 20))
    check "training went on: $n steps while the storage node was cut off" $? "only $n steps"
    [[ -n $min ]] && ((min >= 1 && last >= 2))
    check "every step meanwhile says the remote is behind (at least 1; $last at the end)" $? \
        "remote_behind: $(tr '\n' ' ' <<<"$during")"
    grep -qE "^step +[0-9]+/$steps \|.*\| remote behind [1-9]" "$work/sp.log"
    check "the progress line says the remote is behind" $? "$(grep '^step' "$work/sp.log" | tail -3)"
    local up_at
    up_at=$(metrics sp | grep "\"event\":\"checkpoint_uploaded\"" | grep "step-$(printf %08d "$step")" |
        grep -o '"time":[0-9.]*' | head -1 | cut -d: -f2)
    [[ -n $up_at ]] && le "$t_up" "$up_at"
    check "the upload cut off (step $step) completed after the link came back" $? \
        "uploaded at ${up_at:-never}, link back at $t_up"
    local early
    early=$(metrics sp | awk -v a="$t_down" -v b="$t_up" '/"event":"checkpoint_uploaded"/ {
        match($0, /"time":[0-9.]+/); t = substr($0, RSTART + 7, RLENGTH - 7) + 0
        if (t > a + 1 && t < b) n++ } END { print n + 0 }')
    ((early == 0))
    check "nothing reached the bucket while it was cut off" $? "$early uploads"
    grep -q "checkpoint_uploaded: $url/step-$(printf %08d $steps)" "$work/sp.log"
    check "the final checkpoint reached the bucket" $? "$(grep -i upload "$work/sp.log" | tail -5)"
    local ls ok=0 ck v
    ls=$(on_node a "$spotune" ckpt list "$url" --endpoint "$endpoint" --path-style 2>&1)
    keep "$ls"
    has "$ls" "step-$(printf %08d $steps).*complete"
    check "the bucket lists step $steps complete" $? "$ls"
    for ck in $(grep -oE 'step-[0-9]{8}' <<<"$ls" | sort -u); do
        v=$(on_node a "$spotune" ckpt verify "$url/$ck" --endpoint "$endpoint" --path-style 2>&1) ||
            { ok=1; echo "$v"; }
        keep "$v"
    done
    check "every checkpoint in the bucket verifies ($(grep -oE 'step-[0-9]{8}' <<<"$ls" | sort -u | tr '\n' ' '))" $ok "see above"
    report "$work/sp.log" "$work/forward.log"
}

case_resume_fewer_ranks() {
    topo_up a b s
    inputs
    storage_up 0
    local extra=(--set train.steps=40 --set checkpoint.every_steps=5 --set checkpoint.keep=3
        --set log.samples=true)
    launch_bg "$work/first.log" -g 2 -- $(train_cmd run "${extra[@]}")
    # node-b is lost after a checkpoint reached the bucket
    wait_until 120 grep -qE "checkpoint_uploaded: $url/step-000000(1[05]|2[05])" "$work/first.log"
    check "a checkpoint of the 4-rank run reached the bucket" $? "$(tail -20 "$work/first.log")"
    local t0
    t0=$(now)
    kill_ns b
    link b down
    wait_job "$t0"
    ((rc != 0 && rc != -1))
    check "the 4-rank job ends when node-b is lost (exit $rc, ${took} s)" $? "$(tail -20 "$work/first.log")"
    local G
    G=$(grep -oE "global batch [0-9]+" "$work/first.log" | head -1 | awk '{ print $3 }')
    # node-a's disk does not count: only the bucket (the run directory is gone)
    mv "$work/run/samples" "$work/first-samples"
    rm -rf "$work/run"
    local out rc2 at sample
    out=$(on_node a env SPOTUNE_SIGKILL_TIMEOUT=$K timeout 300 "$launch" --hostfile "$work/hosts" \
        --nodes 1 -g 2 --tcp "${pass[@]}" -- $(train_cmd run "${extra[@]}") 2>&1)
    rc2=$?
    echo "$out" >"$work/second.log"
    check "the restart on node-a alone (2 ranks) completes" $rc2 "$(tail -20 <<<"$out")"
    has "$out" "downloading s3://" && has "$out" "train.grad_accum is now 2"
    check "it resumes from the bucket with twice the accumulation" $? "$out"
    at=$(grep -oE "resumed from .*: step [0-9]+, sample [0-9]+" <<<"$out" | head -1 | sed -E 's/.*: step ([0-9]+), sample ([0-9]+)/\1 \2/')
    sample=${at#* }
    at=${at% *}
    [[ -n $at && -n $G ]] && ((at >= 10 && sample == at * G))
    check "resumed at step $at, sample $sample (global batch $G)" $? "$(grep resumed <<<"$out")"
    [[ $(steps_logged run) -eq 40 ]]
    check "the run's metrics hold its 40 steps once" $? "$(steps_logged run) train records"
    local vocab
    vocab=$(grep -o '"vocab_size": *[0-9]*' "$work/in/model/config.json" | grep -o '[0-9]*$')
    out=$("$audit" "$work/in/data.train.h5" 32 "$vocab" 21 40 "$G" "$at" \
        "$work"/first-samples/rank-*.tsv -- "$work"/run/samples/rank-*.tsv 2>&1)
    check "every sample trained exactly once, in its step, as its window" $? "$out"
    keep "$out"
    echo "$out" | tail -1
    report "$work/first.log" "$work/second.log"
}

case_sharded_shared_dir() {
    topo_up a b
    inputs
    local full=(--set train.mode=full --set train.steps=10 --set checkpoint.every_steps=5)
    local out rc
    out=$(on_node a mpirun --hostfile "$work/hosts" -np 4 --map-by ppr:2:node --bind-to none \
        "${pass[@]}" $(train_cmd two-nodes "${full[@]}") 2>&1)
    rc=$?
    keep "$out"
    check "2 nodes x 2 ranks fine-tune in full" $rc "$out"
    has "$out" "checkpoints are sharded: every rank, on every machine, sees run.dir"
    check "the start finds run.dir shared by both nodes and shards the checkpoints" $? "$out"
    local ck=$work/two-nodes/checkpoints/step-00000010
    [[ -f $ck/shard-00000-of-00004.h5 && -f $ck/shard-00001-of-00004.h5 &&
        -f $ck/shard-00002-of-00004.h5 && -f $ck/shard-00003-of-00004.h5 ]]
    check "step 10 holds a shard file from each of the 4 ranks" $? "$(ls "$ck" 2>&1)"
    out=$("$spotune" ckpt verify "$ck" 2>&1)
    check "it verifies as a sharded checkpoint" $? "$out"
    has "$out" "sharded"
    check "ckpt verify says sharded" $? "$out"
    out=$(on_node a mpirun --host node-a:4 -np 4 --bind-to none "${pass[@]}" \
        $(train_cmd one-node "${full[@]}") 2>&1)
    check "1 node x 4 ranks fine-tunes in full" $? "$out"
    keep "$out"
    cmp -s "$work/two-nodes/model/model.safetensors" "$work/one-node/model/model.safetensors"
    check "2 nodes: the model of 1 node, bit for bit" $? "the models differ"
    report "$work/two-nodes/metrics.jsonl"
}

# Full fine-tuning on 2 nodes x 2 ranks whose run.dir is not shared: node-b
# sees a disk of its own at the same path. The checkpoints are sharded
# across the machines, the bucket holds them whole, node-a keeps its ranks'
# shards and node-b nothing; a restart on both nodes reads node-a's shards
# from its disk and node-b's from the bucket, a restart on node-a alone with
# 2 ranks reads the same; the trajectory is that of 1 node x 4 ranks.
case_sharded_spread() {
    topo_up a b s
    inputs
    storage_up 0
    mkdir -p "$work/spread" "$work/b-disk"
    awk -v d="$work/b-disk:$work/spread" '$1 == "node-b" { $0 = $0 " " d } { print }' \
        "$work/hosts.map" >"$work/hosts.map.new" && mv "$work/hosts.map.new" "$work/hosts.map"
    local full=(--set train.mode=full --set checkpoint.every_steps=5 --set checkpoint.keep=3)
    # every rank puts its own shard: the store's credentials reach node-b's too
    local two=(on_node a mpirun --hostfile "$work/hosts" -np 4 --map-by ppr:2:node --bind-to none
        "${pass[@]}" -x AWS_ACCESS_KEY_ID -x AWS_SECRET_ACCESS_KEY -x AWS_REGION)
    local out rc ck=$work/spread/checkpoints
    out=$("${two[@]}" $(train_cmd spread "${full[@]}" --set train.steps=10) 2>&1)
    rc=$?
    keep "$out"
    echo "$out" >"$work/first.log"
    check "2 nodes x 2 ranks without a shared run.dir fine-tune in full" $rc "$out"
    has "$out" "checkpoints are sharded across machines that do not share run.dir"
    check "the start finds run.dir not shared and shards the checkpoints across the machines" $? "$out"
    [[ -f $ck/step-00000010/MANIFEST.json && -f $ck/step-00000010/shard-00000-of-00004.h5 &&
        -f $ck/step-00000010/shard-00001-of-00004.h5 && ! -e $ck/step-00000010/shard-00002-of-00004.h5 &&
        ! -e $ck/step-00000010/shard-00003-of-00004.h5 ]]
    check "node-a's step 10 holds MANIFEST and the shards of ranks 0 and 1 only" $? "$(ls -R "$ck" 2>&1)"
    [[ -d $work/b-disk/checkpoints && -z $(find "$work/b-disk" -name 'shard-*' -o -name '.tmp-*') ]]
    check "node-b's own disk keeps no shard once it is in the bucket" $? "$(ls -laR "$work/b-disk" 2>&1)"
    out=$("$spotune" ckpt verify "$ck/step-00000010" 2>&1)
    check "node-a's copy verifies" $? "$out"
    has "$out" "2 shard file\(s\) were written on other machines"
    check "ckpt verify says 2 shards are only in the store" $? "$out"
    keep "$out"
    out=$(on_node a "$spotune" ckpt verify "$url/step-00000010" --endpoint "$endpoint" --path-style 2>&1)
    check "the bucket's step 10 verifies whole" $? "$out"
    keep "$out"
    out=$("$spotune" export "$ck/step-00000010" --merged "$work/merged" 2>&1)
    ((rc = $?, rc == 3)) && has "$out" "only in the remote store"
    check "export refuses node-a's partial copy, naming the store (exit $rc)" $? "$out"
    # the same machines again: node-a's shards from its disk, node-b's from the bucket
    out=$("${two[@]}" $(train_cmd spread "${full[@]}" --set train.steps=15) 2>&1)
    rc=$?
    keep "$out"
    echo "$out" >"$work/second.log"
    check "the restart on both nodes trains on to step 15" $rc "$out"
    has "$out" "resumed from .*/step-00000010 \\(the shards of other machines from $url/step-00000010\\): step 10" &&
        has "$out" "read 2 shard file\(s\) from their own machines. disks and 2 from $url"
    check "it resumes from step 10: ranks 0 and 1 read their shards on node-a, ranks 2 and 3 from the bucket" $? "$out"
    # the references: 1 node x 4 ranks (their own prefixes) to step 10, then
    # on to 15 (one-node) and, from a copy of it at step 10, to 20 (one-node20)
    local one=(on_node a mpirun --host node-a:4 -np 4 --bind-to none "${pass[@]}")
    out=$("${one[@]}" $(train_cmd one-node "${full[@]}" --set train.steps=10 \
        --set checkpoint.remote="$url-ref") 2>&1) && cp -a "$work/one-node" "$work/one-node20" &&
        out=$("${one[@]}" $(train_cmd one-node "${full[@]}" --set train.steps=15 \
            --set checkpoint.remote="$url-ref") 2>&1) &&
        out=$("${one[@]}" $(train_cmd one-node20 "${full[@]}" --set train.steps=20 \
            --set checkpoint.remote="$url-ref20") 2>&1)
    check "1 node x 4 ranks fine-tunes to step 10, then to 15 and (a copy) to 20" $? "$out"
    keep "$out"
    cmp -s <(losses spread) <(losses one-node)
    check "2 nodes, restarted: the losses of 1 node, bit for bit" $? \
        "$(paste <(losses spread) <(losses one-node))"
    # without the store, node-a's copy cannot be restored: said, never a fresh start
    out=$(on_node a mpirun --host node-a:2 -np 2 --bind-to none "${pass[@]}" \
        $(train_cmd spread "${full[@]}" --set train.steps=20 --set checkpoint.remote=) 2>&1)
    rc=$?
    keep "$out"
    ((rc == 2)) && has "$out" "only in the remote store" && has "$out" "checkpoint.remote" &&
        [[ $(steps_logged spread) -eq 15 ]]
    check "without checkpoint.remote the restart stops (exit $rc), naming it, and trains nothing" $? "$out"
    # sharded without a store across machines that do not share run.dir: refused
    out=$("${two[@]}" $(train_cmd spread "${full[@]}" --set train.steps=20 \
        --set checkpoint.remote= --set checkpoint.layout=sharded) 2>&1)
    rc=$?
    keep "$out"
    ((rc == 2)) && has "$out" "checkpoint.layout is sharded, but the machines do not share run.dir" &&
        [[ $(steps_logged spread) -eq 15 ]]
    check "layout sharded without a store across machines is refused (exit $rc)" $? "$out"
    # step 15 loses a shard of node-b's in the bucket: node-a's copy of it is
    # incomplete, so step 10 is restored
    out=$(on_node a "$store_tool" --endpoint "$endpoint" --path-style rm "$url" \
        step-00000015/shard-00002-of-00004.h5 2>&1)
    check "shard 2 of step 15 deleted from the bucket" $? "$out"
    # node-a alone, 2 ranks: rank 0 keeps what shards 0 and 1 hold (on node-a),
    # rank 1 what shards 2 and 3 hold (only in the bucket)
    out=$(on_node a mpirun --host node-a:2 -np 2 --bind-to none "${pass[@]}" \
        $(train_cmd spread "${full[@]}" --set train.steps=20) 2>&1)
    rc=$?
    keep "$out"
    echo "$out" >"$work/third.log"
    check "node-a alone (2 ranks) trains on to step 20" $rc "$out"
    has "$out" "skipping checkpoint step-00000015: its shard shard-00002-of-00004.h5, written on another machine, is not in $url"
    check "node-a's step 15 is passed over, naming the shard the bucket lacks" $? "$out"
    has "$out" "resumed from .*/step-00000010 \\(the shards of other machines from $url/step-00000010\\): step 10" &&
        has "$out" "read 2 shard file\(s\) from their own machines. disks and 2 from $url" &&
        has "$out" "train.grad_accum is now 2" && [[ $(steps_logged spread) -eq 20 ]]
    check "it resumes from node-a's step 10: shards 0 and 1 from its disk, 2 and 3 from the bucket" $? "$out"
    out=$(paste <(losses spread | tail -10) <(losses one-node20 | tail -10) |
        awk 'NF != 2 { bad = 1 } { d = $1 - $2; if (d < 0) d = -d; r = $2 < 0 ? -$2 : $2
               if (d > 1e-5 * r) { printf "step %d: %.9g vs %.9g\n", NR + 10, $1, $2; bad = 1 } }
             END { exit bad || NR != 10 }')
    check "steps 11-20 on 2 ranks: the losses of 1 node x 4 within 1e-5 relative" $? "$out"
    # both nodes again to step 25, whose checkpoint is the run's last: the
    # bucket refuses node-b's puts of its shards of step 25 (503) past
    # upload_deadline_s, then takes them again; the run's end puts them
    # (rank 0 cannot: node-a lacks them), the bucket's step 25 is whole and
    # node-b's disk empty
    local s25=/spotune-mn/run-$id/step-00000025/shard-0000
    printf '%s\n' "PUT ${s25}2" "POST ${s25}2" "PUT ${s25}3" "POST ${s25}3" >"$work/refuse"
    "${two[@]}" $(train_cmd spread "${full[@]}" --set train.steps=25 \
        --set checkpoint.upload_deadline_s=3 --set checkpoint.final_upload_timeout_s=120) \
        >"$work/fourth.log" 2>&1 &
    local job4=$!
    wait_until 180 grep -qE "step-00000025/shard-0000[23]-of-00004.h5 was not put" "$work/fourth.log"
    check "node-b's put of its final shard fails past upload_deadline_s while the bucket refuses it" $? \
        "$(tail -20 "$work/fourth.log")"
    rm -f "$work/refuse"
    wait "$job4"
    rc=$?
    out=$(cat "$work/fourth.log")
    keep "$out"
    check "the run to step 25 ends 0 once the bucket takes puts again" $rc "$out"
    has "$out" "shard-0000[23]-of-00004.h5 of step 25: its put is tried again"
    check "node-b tries its kept shard of the last checkpoint again at the run's end" $? "$out"
    out=$(on_node a "$spotune" ckpt verify "$url/step-00000025" --endpoint "$endpoint" --path-style 2>&1)
    check "the bucket's step 25 verifies whole" $? "$out"
    keep "$out"
    [[ -z $(find "$work/b-disk" -name 'shard-*') ]]
    check "node-b's disk keeps no shard once the bucket holds it" $? "$(ls -laR "$work/b-disk" 2>&1)"
    report "$work/first.log" "$work/second.log" "$work/third.log" "$work/fourth.log"
}

# spotune doctor over 2 nodes x 2 ranks: one report from rank 0 holding each
# host's own host and storage lines (the first rank of each node runs them),
# every line named by its host, 4 ranks on 2 hosts, every rank exits 0.
case_doctor() {
    topo_up a b
    local out rc
    out=$(cd "$work" && on_node a mpirun --hostfile "$work/hosts" -np 4 --map-by ppr:2:node \
        --bind-to none "${pass[@]}" "$spotune" doctor --cloud none --io-mib 4 2>&1)
    rc=$?
    keep "$out"
    check "mpirun -np 4 spotune doctor over 2 nodes exits 0" $rc "$out"
    has "$out" "4 ranks on 2 hosts \(node-a, node-b\)"
    check "the report names 4 ranks on the 2 hosts" $? "$out"
    [[ $(grep -c "spotune doctor .* on node-a" <<<"$out") -eq 1 &&
        $(grep -c "spotune doctor " <<<"$out") -eq 1 ]]
    check "one report, from rank 0 on node-a" $? "$out"
    # PASS or WARN: the write speed depends on what else the machine is doing
    grep -qE "^(PASS|WARN) +\[node-a\] storage.write" <<<"$out" &&
        grep -qE "^(PASS|WARN) +\[node-b\] storage.write" <<<"$out"
    check "each node's storage line, named by its host" $? "$out"
    [[ $(grep -cE "^[A-Z]+ +\[node-.\] host.cpu" <<<"$out") -eq 2 ]]
    check "host lines once per node, not per rank" $? "$out"
    out=$(cd "$work" && on_node a mpirun --hostfile "$work/hosts" -np 4 --map-by ppr:2:node \
        --bind-to none "${pass[@]}" "$spotune" doctor --cloud none --io-mib 1 \
        --remote s3://b/p --endpoint http://127.0.0.1:9 2>&1)
    rc=$?
    keep "$out"
    ((rc == 1))
    check "a FAIL on rank 0: the job exits 1" $? "exit $rc: $out"
    report
}

case "$case_name" in
trajectory | launch_hostfile | node_lost | partition | storage_partition | resume_fewer_ranks | \
    sharded_shared_dir | sharded_spread | doctor | spot_watch)
    "case_$case_name" ;;
*)
    echo "unknown case $case_name" >&2
    exit 2
    ;;
esac
