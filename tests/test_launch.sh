#!/usr/bin/env bash
# tests/test_launch.sh — scripts/launch.sh: the mpirun command it builds for
# one node (ranks from CUDA_VISIBLE_DEVICES or --gpus-per-node) and for
# several (hostfile, --nodes, ppr mapping), the variables it passes by name
# only (never a value: secrets stay off command lines), its errors, one
# real launch of 2 ranks of the comm test program, and a stop of 2 spotune
# ranks through it (SIGUSR1, SIGTERM): exit 75 at once.
# usage: tests/test_launch.sh BUILD_DIR
set -uo pipefail
build=$1
here=$(cd "$(dirname "$0")/.." && pwd)
launch="$here/scripts/launch.sh"
# shellcheck source=tests/check.sh
source "$here/tests/check.sh" # $tmp, check, has

# one node, ranks from CUDA_VISIBLE_DEVICES
out=$(env -i PATH="$PATH" HOME="$tmp" CUDA_VISIBLE_DEVICES=0,1,2 "$launch" --dry-run prog a b 2>&1)
has "$out" " -np 3 --map-by slot --bind-to none" && has "$out" " prog a b"
check "three visible GPUs give 3 ranks" $? "$out"
has "$out" "-x CUDA_VISIBLE_DEVICES"
check "CUDA_VISIBLE_DEVICES passed on" $? "$out"
has "$out" "--mca odls_base_sigkill_timeout 120"
check "mpirun gives ranks 120 s after SIGTERM" $? "$out"

# secrets by name only
out=$(env -i PATH="$PATH" HOME="$tmp" AWS_SECRET_ACCESS_KEY=s3cr3t-value-x AWS_ACCESS_KEY_ID=AKIDxyz \
    NCCL_SOCKET_IFNAME=eth9 SPOTUNE_FOO=1 OTHER=2 "$launch" -g 2 --dry-run prog 2>&1)
has "$out" "-x AWS_SECRET_ACCESS_KEY" && has "$out" "-x AWS_ACCESS_KEY_ID" &&
    has "$out" "-x NCCL_SOCKET_IFNAME" && has "$out" "-x SPOTUNE_FOO"
check "NCCL_*, SPOTUNE_*, AWS_* passed by name" $? "$out"
! has "$out" "s3cr3t-value-x" && ! has "$out" "AKIDxyz" && ! has "$out" "eth9"
check "no value printed" $? "$out"
! has "$out" "-x OTHER"
check "other variables not passed" $? "$out"
has "$out" " -np 2 "
check "--gpus-per-node sets the rank count" $? "$out"

# several nodes
printf '# two nodes\nnode-a slots=8\n\nnode-b slots=8\n' >"$tmp/hosts"
out=$(env -i PATH="$PATH" HOME="$tmp" LD_LIBRARY_PATH=/opt/lib "$launch" --hostfile "$tmp/hosts" -g 8 --dry-run prog 2>&1)
has "$out" "--hostfile $tmp/hosts -np 16 --map-by ppr:8:node" && has "$out" "-x PATH" &&
    has "$out" "-x LD_LIBRARY_PATH"
check "hostfile: 2 nodes x 8 ranks, PATH passed" $? "$out"
out=$(env -i PATH="$PATH" HOME="$tmp" "$launch" --hostfile "$tmp/hosts" -g 4 --nodes 1 --dry-run prog 2>&1)
has "$out" " -np 4 --map-by ppr:4:node"
check "--nodes 1 of 2" $? "$out"

# under spot-run.sh (SPOTUNE_SPOT_WATCH ...): a watcher on every node, through
# a second mpirun of one process a node; none on one node, none without it
spot=(SPOTUNE_SUPERVISOR_TAG=t1 SPOTUNE_SPOT_WATCH=gcp SPOTUNE_SPOT_RUN=/opt/s/spot-run.sh
    SPOTUNE_SPOT_METADATA_URL=http://127.0.0.1:9 SPOTUNE_SPOT_POLL=2)
out=$(env -i PATH="$PATH" HOME="$tmp" "${spot[@]}" "$launch" --hostfile "$tmp/hosts" -g 8 \
    --dry-run prog 2>&1)
has "$out" "--hostfile $tmp/hosts -np 2 --map-by ppr:1:node --bind-to none" &&
    has "$out" "-x SPOTUNE_SUPERVISOR_TAG -x PATH bash /opt/s/spot-run.sh --cloud gcp --watch-local --metadata-url http://127.0.0.1:9 --poll 2" &&
    has "$out" "-np 16 --map-by ppr:8:node"
check "spot-run, 2 nodes: a watcher on each node" $? "$out"
out=$(env -i PATH="$PATH" HOME="$tmp" "${spot[@]}" "$launch" --hostfile "$tmp/hosts" -g 8 \
    --nodes 1 --dry-run prog 2>&1)
! has "$out" "--watch-local"
check "spot-run, 1 node of 2: no watcher (spot-run.sh watches this one)" $? "$out"
out=$(env -i PATH="$PATH" HOME="$tmp" "$launch" --hostfile "$tmp/hosts" -g 8 --dry-run prog 2>&1)
! has "$out" "--watch-local"
check "no spot-run: no watcher" $? "$out"

# errors: exit 2 and a message naming the problem
out=$(env -i PATH="$PATH" HOME="$tmp" "$launch" --hostfile "$tmp/hosts" --nodes 3 --dry-run prog 2>&1)
rc=$?
[[ $rc -eq 2 ]] && has "$out" "--nodes 3, but $tmp/hosts lists 2 host(s)"
check "more nodes than the hostfile lists" $? "rc $rc: $out"
out=$(env -i PATH="$PATH" HOME="$tmp" "$launch" -g zero --dry-run prog 2>&1)
rc=$?
[[ $rc -eq 2 ]] && has "$out" "expected a positive number, got 'zero'"
check "bad --gpus-per-node" $? "rc $rc: $out"
out=$(env -i PATH="$PATH" HOME="$tmp" "$launch" --hostfile "$tmp/none" --dry-run prog 2>&1)
rc=$?
[[ $rc -eq 2 ]] && has "$out" "cannot read hostfile $tmp/none"
check "missing hostfile" $? "rc $rc: $out"
out=$(env -i PATH="$PATH" HOME="$tmp" "$launch" --dry-run 2>&1)
rc=$?
[[ $rc -eq 2 ]] && has "$out" "no program to launch"
check "no program" $? "rc $rc: $out"

# a real launch: 2 ranks of the comm test program agree on an all-reduce
if [[ -x "$build/tests/spotune-comm-prog" ]]; then prog="$build/tests/spotune-comm-prog"
else prog=$(find "$build" -name spotune-comm-prog -type f | head -1); fi
if [[ -n "$prog" ]]; then
    # as tests/test_util.c tu_mpirun(): the ob1 transport (no UCX start-up), and
    # in a sanitizer build slow unwinding, so Open MPI's own allocations match
    # the leak suppressions (they lack frame pointers)
    asan=${ASAN_OPTIONS:-}
    out=$(OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 CUDA_VISIBLE_DEVICES= \
        OMPI_MCA_pml=ob1 ASAN_OPTIONS="${asan:+$asan:}fast_unwind_on_malloc=0:intercept_tls_get_addr=0" \
        SPOTUNE_SIGKILL_TIMEOUT=5 timeout 120 "$launch" -g 2 --tcp -- "$prog" allreduce 2>&1)
    rc=$?
    [[ $rc -eq 0 ]] && has "$out" "ok "
    check "2 ranks launched for real" $? "rc $rc: $out"
else
    check "2 ranks launched for real" 1 "spotune-comm-prog not found under $build"
fi

# A stop with a checkpoint: the ranks exit 0 and rank 0 writes 75 into
# launch.sh's status file, so mpirun ends at once (a rank's non-zero exit
# would hold it 2 x odls_base_sigkill_timeout, 2 x 30 s here) and launch.sh
# exits 75; SIGTERM to launch.sh is the same stop (passed on as SIGUSR1).
# Without launch.sh's file, or with another nonce in it, rank 0 exits 75
# itself.
spotune="$build/spotune"
if [[ -x "$spotune" ]]; then
    d="$tmp/stop"
    mkdir -p "$d"
    "$here/scripts/make_demo_text.sh" "$d/text.txt" 3 >/dev/null &&
        "$spotune" prepare-text "$d/text.txt" "$d/data" --val-fraction 0 >/dev/null &&
        "$spotune" init-model --preset tiny --seed 5 "$d/model" >/dev/null
    check "the stop's inputs" $? "$d"
    cat >"$d/run.yaml" <<EOF
model:
  path: $d/model
train:
  mode: lora
  steps: 100000
  seq_len: 32
  micro_batch: 2
  lr: 3e-3
lora:
  r: 4
  alpha: 8
  targets: [q_proj, v_proj]
data:
  train: $d/data.train.h5
log:
  every: 1
runtime:
  backend: cpu
  threads: 1
checkpoint:
  every_minutes: 0
EOF
    asan=${ASAN_OPTIONS:-}
    mpienv=(env OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 CUDA_VISIBLE_DEVICES=
        OMPI_MCA_pml=ob1 OMPI_MCA_rmaps_base_oversubscribe=1
        ASAN_OPTIONS="${asan:+$asan:}fast_unwind_on_malloc=0:intercept_tls_get_addr=0")
    trained() { grep -q '"event":"train","step":3,' "$1/metrics.jsonl" 2>/dev/null; }
    for sig in USR1 TERM; do
        "${mpienv[@]}" TMPDIR="$d" SPOTUNE_SIGKILL_TIMEOUT=30 "$launch" -g 2 --tcp -- \
            "$spotune" train "$d/run.yaml" --set run.dir="$d/$sig" >"$d/$sig.log" 2>&1 &
        pid=$!
        for _ in $(seq 1200); do trained "$d/$sig" && break; sleep 0.1; done
        t0=$(date +%s%N)
        kill -"$sig" "$pid"
        wait "$pid"
        rc=$?
        dt=$((($(date +%s%N) - t0) / 1000000))
        out=$(grep -v '^step ' "$d/$sig.log")
        [[ $rc -eq 75 ]] && has "$out" "stopped by a signal after committing checkpoint step"
        check "SIG$sig to launch.sh: a checkpoint, exit 75" $? "rc $rc: $out"
        ((dt < 20000))
        check "SIG$sig: mpirun ends at once, not 2 x 30 s later (${dt} ms)" $? "$out"
    done
    [[ -z $(find "$d" -maxdepth 1 -name 'spotune-exit.*') ]]
    check "launch.sh removes its status file" $? "$(ls "$d")"
    # no status file where TMPDIR cannot hold one: said, and the stop is 75 still
    "${mpienv[@]}" TMPDIR="$d/no-such-dir" SPOTUNE_SIGKILL_TIMEOUT=1 "$launch" -g 2 --tcp -- \
        "$spotune" train "$d/run.yaml" --set run.dir="$d/notmp" >"$d/notmp.log" 2>&1 &
    pid=$!
    for _ in $(seq 1200); do trained "$d/notmp" && break; sleep 0.1; done
    kill -USR1 "$pid"
    wait "$pid"
    rc=$?
    out=$(grep -v '^step ' "$d/notmp.log")
    [[ $rc -eq 75 ]] && has "$out" "launch.sh: cannot make a status file in $d/no-such-dir"
    check "no status file (TMPDIR not a directory): said, and exit 75" $? "rc $rc: $out"
    # a second SIGTERM: passed on to mpirun as SIGTERM, which ends ranks that
    # ignore the stop (here a stand-in that ignores SIGUSR1)
    "${mpienv[@]}" TMPDIR="$d" SPOTUNE_SIGKILL_TIMEOUT=1 "$launch" -g 2 --tcp -- \
        sh -c 'trap "" USR1; echo up; while :; do sleep 0.1; done' >"$d/second.log" 2>&1 &
    pid=$!
    for _ in $(seq 300); do [[ $(grep -c '^up' "$d/second.log") -eq 2 ]] && break; sleep 0.1; done
    kill -TERM "$pid"
    sleep 1
    alive=0
    kill -0 "$pid" 2>/dev/null && alive=1
    t0=$(date +%s%N)
    kill -TERM "$pid"
    wait "$pid"
    rc=$?
    dt=$((($(date +%s%N) - t0) / 1000000))
    out=$(cat "$d/second.log")
    ((alive && rc != 0 && rc != 75 && dt < 15000)) &&
        [[ $(grep -c "asking the ranks to checkpoint and stop" <<<"$out") -eq 1 ]]
    check "a second SIGTERM has mpirun end ranks that ignore the stop (exit $rc, ${dt} ms)" $? \
        "alive after the first: $alive; $out"
    # plain mpirun, a status file with another nonce, then none
    echo other >"$d/status"
    for v in "SPOTUNE_EXIT_STATUS_FILE=$d/status" "SPOTUNE_EXIT_STATUS_FILE=$d/none"; do
        "${mpienv[@]}" "$v" SPOTUNE_EXIT_STATUS_NONCE=0123456789abcdef mpirun -np 2 --bind-to none \
            -x SPOTUNE_EXIT_STATUS_FILE -x SPOTUNE_EXIT_STATUS_NONCE "$spotune" train \
            "$d/run.yaml" --set run.dir="$d/plain" >"$d/plain.log" 2>&1 &
        pid=$!
        for _ in $(seq 1200); do trained "$d/plain" && break; sleep 0.1; done
        # (mpirun forwards SIGUSR1 to the ranks)
        kill -USR1 "$pid"
        wait "$pid"
        rc=$?
        [[ $rc -eq 75 && $(cat "$d/status") == other && ! -e "$d/none" ]]
        check "${v%%=*} not launch.sh's (${v##*/}): rank 0 exits 75 itself" $? \
            "rc $rc, status file: $(cat "$d/status"): $(grep -v '^step ' "$d/plain.log")"
        rm -rf "$d/plain"
    done
else
    check "a stop through launch.sh" 1 "$spotune is not built"
fi

if [[ $fails -gt 0 ]]; then echo "$fails check(s) failed"; exit 1; fi
echo "all launch.sh checks passed"
