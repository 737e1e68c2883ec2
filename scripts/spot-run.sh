#!/usr/bin/env bash
# spot-run.sh — keeps a spotune training alive on spot/preemptible machines.
#
# Runs COMMAND (e.g. `mpirun -np 8 spotune train run.yaml`, or scripts/launch.sh)
# and, beside it, a watcher that polls the cloud's spot-termination notice:
#   AWS        /latest/meta-data/spot/instance-action, with an IMDSv2 token
#              (IMDSv1 when no token comes back: a container behind the
#              default hop limit of 1)
#   GCP        /computeMetadata/v1/instance/preempted = TRUE, or
#              maintenance-event = TERMINATE_ON_HOST_MAINTENANCE (GPU VMs)
#              (Metadata-Flavor: Google)
#   Azure      /metadata/scheduledevents: an event of type Preempt whose
#              Resources name this VM (Metadata: true)
#   Alibaba    /latest/meta-data/instance/spot/termination-time
# Every request bypasses proxies (the services answer on link-local or
# internal addresses). A service that cannot be asked (no answer, or one
# that is not the documented one) is said on stderr, once a minute, rather
# than taken for "no notice". The watcher sees this machine's notice; on
# several nodes scripts/launch.sh --hostfile starts one more on every node
# (--watch-local, below), told the cloud through SPOTUNE_SPOT_WATCH,
# SPOTUNE_SPOT_METADATA_URL, SPOTUNE_SPOT_POLL and SPOTUNE_SPOT_RUN, which
# this script sets for COMMAND.
# When the notice appears it sends SIGUSR1 to COMMAND (mpirun forwards it to
# every rank): the ranks agree at the next micro-batch, write a checkpoint,
# push it to checkpoint.remote (up to checkpoint.upload_deadline_s) and exit 75.
# The machine is going away, so the supervisor then stops (exit 75); on the
# next machine the same command resumes from the checkpoint.
#
# Exit codes of COMMAND decide what happens next:
#   0        finished: stop, exit 0
#   2, 3     config or input error: restarting cannot help; stop with that code
#   75       checkpointed and stopped (on a signal, or because checkpoint.remote
#            holds a newer checkpoint of the run than the job could see at its
#            start): restart at once (unless it was the spot notice or a signal
#            to this script, which means the machine or the user is stopping us)
#   other    a crash (a rank died, out of memory, ...): restart after a backoff
#            (doubling from --backoff up to --max-backoff), at most --max-restarts
#            crashes in a row; a run that lasted --healthy-after seconds resets
#            the count and the backoff. Graceful stops (75) are not crashes.
# SIGTERM or SIGINT to this script become SIGUSR1 to COMMAND (a graceful stop).
# Once asked to stop, the signal is sent again every --resend seconds until
# COMMAND exits: a notice that is already up when COMMAND starts reaches mpirun
# before its ranks exist (or a rank before its handlers are in), and one signal
# would be lost; spotune takes any number of them as the one request.
# Before a restart, the processes of the previous launch still running on this
# machine are waited for (after SIGKILL to mpirun its ranks can run on for a
# moment, long enough to write into the run directory): each launch carries
# SPOTUNE_SUPERVISOR_TAG in its environment; after --orphan-wait seconds the
# processes that still carry it are killed. (spotune also holds run.dir with
# a lock and checkpoint.remote with a lease, so two jobs never write one.)
#
# usage: scripts/spot-run.sh [options] -- COMMAND [ARGS...]
#   --cloud NAME          aws, gcp, azure, alibaba, auto (default: probe each) or none
#   --metadata-url URL    base URL of the metadata service (tests, proxies)
#   --poll SECONDS        notice polling interval (default 5 on AWS, whose notice
#                         comes 2 minutes ahead; 2 elsewhere: 30 s ahead)
#   --max-restarts N      crashes in a row before giving up (default 20)
#   --backoff SECONDS     first crash backoff (default 10)
#   --max-backoff SECONDS (default 300)
#   --healthy-after SECONDS  a run this long resets the crash count (default 600)
#   --orphan-wait SECONDS before a restart, wait this long for the previous
#                         launch's processes to exit, then kill them (default 30)
#   --resend SECONDS      after a notice or a stop, send SIGUSR1 again this often
#                         until COMMAND exits (default 2)
#   --check-notice        poll once, print "notice", "none" or "cannot ask: WHY",
#                         exit 0/1/2 (diagnostics)
#   --watch-local         no COMMAND: watch this node's notice and, once it comes,
#                         send SIGUSR1 every --resend seconds to this node's
#                         processes of the launch SPOTUNE_SUPERVISOR_TAG names
#                         (its ranks), until killed (scripts/launch.sh runs one
#                         on every node of a hostfile)
set -uo pipefail

cloud=auto
meta_url=""
poll=
max_restarts=20
backoff=10
max_backoff=300
healthy_after=600
orphan_wait=30
resend=2
check_only=0
watch_local=0
while [ $# -gt 0 ]; do
  case "$1" in
    --cloud) cloud=$2; shift 2 ;;
    --metadata-url) meta_url=$2; shift 2 ;;
    --poll) poll=$2; shift 2 ;;
    --resend) resend=$2; shift 2 ;;
    --max-restarts) max_restarts=$2; shift 2 ;;
    --backoff) backoff=$2; shift 2 ;;
    --max-backoff) max_backoff=$2; shift 2 ;;
    --healthy-after) healthy_after=$2; shift 2 ;;
    --orphan-wait) orphan_wait=$2; shift 2 ;;
    --check-notice) check_only=1; shift ;;
    --watch-local) watch_local=1; shift ;;
    --) shift; break ;;
    -h|--help) sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "spot-run: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
done
for v in max-restarts:"$max_restarts" backoff:"$backoff" max-backoff:"$max_backoff" \
         healthy-after:"$healthy_after" orphan-wait:"$orphan_wait"; do
  case "${v#*:}" in
    ''|*[!0-9]*) echo "spot-run: --${v%%:*} takes a whole number, got '${v#*:}'" >&2; exit 2 ;;
  esac
done
if [ -n "$poll" ] && ! [[ "$poll" =~ ^[0-9]+(\.[0-9]+)?$ ]]; then
  echo "spot-run: --poll takes a number of seconds, got '$poll'" >&2
  exit 2
fi
if [ "$check_only" = 0 ] && [ "$watch_local" = 0 ] && [ $# -eq 0 ]; then
  echo "spot-run: no command given (usage: spot-run.sh [options] -- COMMAND ...)" >&2
  exit 2
fi

say() { echo "spot-run: $(date -u +%H:%M:%SZ) $*" >&2; }

base_for() {
  if [ -n "$meta_url" ]; then echo "$meta_url"; return; fi
  case "$1" in
    aws|azure) echo "http://169.254.169.254" ;;
    gcp) echo "http://metadata.google.internal" ;;
    alibaba) echo "http://100.100.100.200" ;;
  esac
}

# curl for the metadata services: silent, never through a proxy
mcurl() { curl -s --noproxy '*' "$@" 2>/dev/null; }

# HTTP status and body of a GET: sets $code and $body ("000": no answer)
get() {
  local out
  out=$(mcurl -m 2 -w '\n%{http_code}' "$@") || true
  code=${out##*$'\n'}
  body=${out%$'\n'*}
  [ "$out" = "$code" ] && body=""
  [ -n "$code" ] || code=000
}

# Azure: this VM's name, which its Preempt events list in Resources
azure_name=""

# Whether the cloud has scheduled our termination: returns 0 (a notice),
# 1 (none) or 2 (the service could not be asked: $why says why).
notice_for() {
  local c=$1 b token
  b=$(base_for "$c")
  why=""
  case "$c" in
    aws)
      token=$(mcurl -m 2 -f -X PUT "$b/latest/api/token" \
        -H "X-aws-ec2-metadata-token-ttl-seconds: 300") || token=""
      if [ -n "$token" ]; then
        get -H "X-aws-ec2-metadata-token: $token" "$b/latest/meta-data/spot/instance-action"
      else # no token (IMDSv1 only, or a container past the hop limit)
        get "$b/latest/meta-data/spot/instance-action"
      fi
      case "$code" in
        200) return 0 ;;
        404) return 1 ;;
      esac
      why="HTTP $code from $b/latest/meta-data/spot/instance-action${token:+ (with a token)}" ;;
    gcp)
      get -H "Metadata-Flavor: Google" "$b/computeMetadata/v1/instance/preempted"
      if [ "$code" = 200 ]; then
        [ "$body" = TRUE ] && return 0
        get -H "Metadata-Flavor: Google" "$b/computeMetadata/v1/instance/maintenance-event"
        [ "$code" = 200 ] && [ "$body" = TERMINATE_ON_HOST_MAINTENANCE ] && return 0
        return 1
      fi
      why="HTTP $code from $b/computeMetadata/v1/instance/preempted" ;;
    azure)
      if [ -z "$azure_name" ]; then
        get -H "Metadata: true" \
          "$b/metadata/instance/compute/name?api-version=2021-02-01&format=text"
        [ "$code" = 200 ] && azure_name=$body
      fi
      get -H "Metadata: true" "$b/metadata/scheduledevents?api-version=2020-07-01"
      if [ "$code" = 200 ]; then
        preempt_for "$azure_name" <<< "$body"
        case $? in 0) return 0 ;; 1) return 1 ;; esac
        why="unreadable scheduled events from $b: ${body:0:80}"
      else
        why="HTTP $code from $b/metadata/scheduledevents"
      fi ;;
    alibaba)
      get "$b/latest/meta-data/instance/spot/termination-time"
      case "$code" in
        200) return 0 ;;
        404) return 1 ;;
      esac
      why="HTTP $code from $b/latest/meta-data/instance/spot/termination-time" ;;
    *) return 1 ;;
  esac
  return 2
}

# Azure's scheduled events on stdin: 0 when one is a Preempt of VM $1 (of
# any VM when $1 is empty: the name could not be read), 1 when none is, 2
# when the document cannot be read. Events reach every VM of a scale or
# availability set; Resources says which they are for.
preempt_for() {
  python3 -c '
import json, sys
try:
    events = json.load(sys.stdin).get("Events", [])
except ValueError:
    sys.exit(2)
name = sys.argv[1]
sys.exit(0 if any(e.get("EventType") == "Preempt" and (not name or name in e.get("Resources", []))
                  for e in events) else 1)' "$1"
}

# The cloud DMI says this machine is in, or nothing.
dmi_cloud() {
  local v
  v=$(cat /sys/class/dmi/id/sys_vendor /sys/class/dmi/id/product_name \
        /sys/class/dmi/id/chassis_asset_tag 2>/dev/null | tr '\n' ' ')
  case "$v" in
    *"Amazon EC2"*) echo aws ;;
    *Google*) echo gcp ;;
    *7783-7084-3265-9085-8269-3286-77*) echo azure ;;
    *Alibaba*) echo alibaba ;;
  esac
}

# Which cloud answers (auto): the first whose metadata service gives its
# documented answer (HTTP 200; a proxy's or a captive portal's page is
# not one). Three tries: a service can be slow to answer at boot.
detect_cloud() {
  local b _
  for _ in 1 2 3; do
    b=$(base_for aws)
    if [ "$(mcurl -m 2 -o /dev/null -X PUT "$b/latest/api/token" \
            -H "X-aws-ec2-metadata-token-ttl-seconds: 60" -w '%{http_code}')" = 200 ] ||
       [ "$(mcurl -m 2 -o /dev/null -w '%{http_code}' "$b/latest/meta-data/instance-id")" = 200 ]
    then echo aws; return; fi
    b=$(base_for gcp)
    get -H "Metadata-Flavor: Google" "$b/computeMetadata/v1/instance/id"
    if [ "$code" = 200 ]; then echo gcp; return; fi
    b=$(base_for azure)
    get -H "Metadata: true" "$b/metadata/instance?api-version=2021-02-01"
    if [ "$code" = 200 ] && [[ "$body" == *compute* ]]; then echo azure; return; fi
    b=$(base_for alibaba)
    get "$b/latest/meta-data/instance-id"
    if [ "$code" = 200 ]; then echo alibaba; return; fi
    [ -n "$(dmi_cloud)" ] || break # not a cloud machine: no need to ask again
    sleep 1
  done
  echo none
}

if [ "$cloud" = auto ]; then cloud=$(detect_cloud); fi
if [ -z "$poll" ]; then
  case "$cloud" in aws|none) poll=5 ;; *) poll=2 ;; esac
fi
if [ "$check_only" = 1 ]; then
  notice_for "$cloud"
  case $? in
    0) echo notice; exit 0 ;;
    1) echo none; exit 1 ;;
    *) echo "cannot ask: $why"; exit 2 ;;
  esac
fi
if [ "$cloud" = none ]; then
  dmi=$(dmi_cloud)
  if [ -n "$dmi" ]; then
    say "WARNING: this machine is on $dmi (DMI) but its metadata service does not answer:" \
      "the spot-notice watcher is off, and a spot notice will be missed" \
      "(a container without the host's network? pass --cloud $dmi to keep asking)"
  else
    say "no cloud metadata service: the spot-notice watcher is off"
  fi
fi
if [ "$cloud" = azure ]; then # the service starts on the first request: up to 2 minutes
  mcurl -m 120 -o /dev/null -H "Metadata: true" \
    "$(base_for azure)/metadata/scheduledevents?api-version=2020-07-01" &
fi

state=$(mktemp -d "${TMPDIR:-/tmp}/spot-run.XXXXXX")
trap 'rm -rf "$state"' EXIT
child=""
resender=""
# SIGUSR1 to pid $1 now and every --resend seconds while it runs
keep_asking() {
  while kill -USR1 "$1" 2>/dev/null; do sleep "$resend"; done
}
on_signal() {
  say "$1 received: asking the run to checkpoint and stop (SIGUSR1)"
  touch "$state/stopping"
  if [ -n "$child" ] && [ -z "$resender" ]; then keep_asking "$child" & resender=$!; fi
}
trap 'on_signal SIGTERM' TERM
trap 'on_signal SIGINT' INT

watch() { # $1: pid to signal
  local said_at=-60 rc
  while kill -0 "$1" 2>/dev/null; do
    notice_for "$cloud"
    rc=$?
    if [ "$rc" = 0 ]; then
      say "spot termination notice from $cloud: sending SIGUSR1 to the run (pid $1)"
      touch "$state/notice"
      keep_asking "$1"
      return
    fi
    if [ "$rc" = 2 ] && [ $((SECONDS - said_at)) -ge 60 ]; then
      say "WARNING: cannot ask $cloud for a spot notice ($why): a notice now would be missed"
      said_at=$SECONDS
    fi
    sleep "$poll"
  done
}

# The pids of processes (other than this script) whose environment holds
# SPOTUNE_SUPERVISOR_TAG=$1.
tagged() {
  local d pid net
  # $2 = local: only the processes of this network namespace (a node: the
  # containers of several nodes may share one PID namespace)
  [ "${2:-}" = local ] && net=$(readlink /proc/self/ns/net 2>/dev/null)
  for d in /proc/[0-9]*; do
    pid=${d#/proc/}
    # (this shell, and the subshell running this function: a fork carries
    # the environment this script started with)
    [ "$pid" = "$$" ] || [ "$pid" = "$BASHPID" ] && continue
    [ -n "${net:-}" ] && [ "$(readlink "$d/ns/net" 2>/dev/null)" != "$net" ] && continue
    # (grep reads it all: with pipefail, -q would let tr die of SIGPIPE)
    tr "\\0" "\\n" 2>/dev/null < "$d/environ" | grep -xF "SPOTUNE_SUPERVISOR_TAG=$1" >/dev/null &&
      echo "$pid"
  done
  return 0
}

# Waits up to --orphan-wait seconds for launch $1's processes to exit, then
# kills the rest.
wait_orphans() {
  local left said=0 t0=$SECONDS
  while left=$(tagged "$1") && [ -n "$left" ]; do
    if [ $((SECONDS - t0)) -ge "$orphan_wait" ]; then
      say "killing what is left of the previous launch after ${orphan_wait}s: pids $(echo $left)"
      kill -KILL $left 2>/dev/null
      sleep 0.2
      continue
    fi
    if [ "$said" = 0 ]; then
      say "waiting for the previous launch's processes to exit: pids $(echo $left)"
      said=1
    fi
    sleep 0.2
  done
}

# --watch-local: this node's notice, then SIGUSR1 to this node's ranks
if [ "$watch_local" = 1 ]; then
  tag=${SPOTUNE_SUPERVISOR_TAG:-}
  if [ -z "$tag" ]; then
    echo "spot-run: --watch-local needs SPOTUNE_SUPERVISOR_TAG (the launch whose ranks to signal)" >&2
    exit 2
  fi
  unset SPOTUNE_SUPERVISOR_TAG # this watcher's own children are not ranks
  trap 'exit 0' TERM INT
  # mpirun ends the watchers with SIGTERM to their process groups: a sleep
  # in the foreground would die of it first and bash say "Terminated"
  nap() { sleep "$1" & wait $!; }
  # the watchers' mpirun carries the launch's tag too, so another node's
  # watcher on a shared PID namespace, or a node's notice sent to the
  # supervisor's launch, may forward SIGUSR1 here: not a rank's signal
  trap '' USR1
  host=$(hostname)
  said_at=-60
  while :; do
    notice_for "$cloud"
    rc=$?
    if [ "$rc" = 0 ]; then
      say "spot termination notice from $cloud on $host: sending SIGUSR1 to this node's ranks"
      named=0
      while :; do # ranks may not exist yet, or lose the first signal
        pids=$(tagged "$tag" local)
        [ -n "$pids" ] && kill -USR1 $pids 2>/dev/null
        if [ -n "$pids" ] && [ "$named" = 0 ]; then
          say "on $host: SIGUSR1 sent to pids $(echo $pids)"
          named=1
        fi
        nap "$resend"
      done
    fi
    if [ "$rc" = 2 ] && [ $((SECONDS - said_at)) -ge 60 ]; then
      say "WARNING: on $host: cannot ask $cloud for a spot notice ($why): a notice now would" \
        "be missed"
      said_at=$SECONDS
    fi
    nap "$poll"
  done
fi

# for scripts/launch.sh: the watcher it starts on every node of a hostfile
if [ "$cloud" != none ]; then
  SPOTUNE_SPOT_RUN="$(cd "$(dirname "$0")" && pwd)/$(basename "$0")"
  export SPOTUNE_SPOT_WATCH=$cloud SPOTUNE_SPOT_METADATA_URL=$meta_url SPOTUNE_SPOT_POLL=$poll
  export SPOTUNE_SPOT_RUN
fi

crashes=0
delay=$backoff
launch=0
while :; do
  rm -f "$state/notice"
  if [ "$launch" -gt 0 ]; then wait_orphans "$tag"; fi
  launch=$((launch + 1))
  tag="spot-run-$$-$launch"
  say "starting: $*"
  started=$SECONDS
  SPOTUNE_SUPERVISOR_TAG=$tag "$@" &
  child=$!
  watcher=""
  if [ "$cloud" != none ]; then watch "$child" & watcher=$!; fi
  while :; do
    wait "$child"; rc=$?
    # a trapped signal interrupts wait; the child is still running then
    kill -0 "$child" 2>/dev/null || break
  done
  [ -n "$watcher" ] && kill "$watcher" 2>/dev/null && wait "$watcher" 2>/dev/null
  [ -n "$resender" ] && kill "$resender" 2>/dev/null && wait "$resender" 2>/dev/null
  child=""
  resender=""
  if [ $((SECONDS - started)) -ge "$healthy_after" ]; then crashes=0; delay=$backoff; fi
  case "$rc" in
    0) say "finished"; exit 0 ;;
    2|3) say "exit $rc: a config or input error; not restarting"; exit "$rc" ;;
    75)
      if [ -e "$state/notice" ] || [ -e "$state/stopping" ]; then
        say "checkpointed and stopped (exit 75); this machine is going away"
        exit 75
      fi
      say "checkpointed and stopped (exit 75): restarting to resume" ;;
    *)
      if [ -e "$state/stopping" ]; then say "stopped (exit $rc)"; exit "$rc"; fi
      if [ -e "$state/notice" ]; then
        say "exit $rc after the spot notice: this machine is going away; not restarting"
        exit "$rc"
      fi
      if [ "$crashes" -ge "$max_restarts" ]; then
        say "exit $rc after $crashes restart(s) (crashes in a row): giving up"
        exit "$rc"
      fi
      crashes=$((crashes + 1))
      say "exit $rc (a crash): restarting in ${delay}s"
      sleep "$delay" &
      wait $! 2>/dev/null
      [ -e "$state/stopping" ] && exit "$rc"
      delay=$(( delay * 2 > max_backoff ? max_backoff : delay * 2 )) ;;
  esac
done
