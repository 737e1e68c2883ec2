#!/usr/bin/env bash
# swift-s3.sh — the local S3-compatible test server of spotune: single-node
# OpenStack Swift + s3api + tempauth on 127.0.0.1, from Debian packages
# (scripts/install-s3-test-deps.sh). The S3 tests (tests/store.cmake) and
# scripts/bench_store.sh start and stop it through this script.
#
# Usage: swift-s3.sh start [--clean]  write configs, build rings, start 4 servers,
#                                     wait, print the environment to export
#                                     (--clean: stop ours and wipe $SWIFT_S3_BASE data first)
#        swift-s3.sh stop             stop the servers named in $BASE/run/*.pid
#        swift-s3.sh status           one line per server: name pid running|stopped
#        swift-s3.sh wait [SECS]      health-check loop (default 30 s)
#        swift-s3.sh start-one NAME   (re)start one of account|container|object|proxy
#        swift-s3.sh stop-one NAME    stop one server (fault injection)
#        swift-s3.sh env              print the environment to export
# Env:   SWIFT_S3_BASE (default /tmp/swift-s3)   all state lives here
#        SWIFT_S3_PORT (default 28080)           S3 / Swift proxy port
#        SWIFT_S3_BACKEND_PORT (default 26010)   object=P, container=P+1, account=P+2
#        SWIFT_S3_TIMEOUT (default 30)           seconds "start" waits for readiness
#        SWIFT_S3_RINGS=cli                      build rings with swift-ring-builder
# Test credentials (fixed, public): access key test:tester, secret spotune-local-test-secret-7f3a,
# region us-east-1. The health check reads them from a netrc file under
# $BASE/etc, never from its command line.
set -euo pipefail

BASE=${SWIFT_S3_BASE:-/tmp/swift-s3}
PORT=${SWIFT_S3_PORT:-28080}
BP=${SWIFT_S3_BACKEND_PORT:-26010}
OBJ_PORT=$BP; CONT_PORT=$((BP + 1)); ACCT_PORT=$((BP + 2))
ETC=$BASE/etc; SRV=$BASE/srv; RUN=$BASE/run; LOG=$BASE/log
RUNAS=$(id -un)
SERVERS="account container object proxy"

write_configs() {
  mkdir -p "$ETC" "$SRV/d1" "$RUN" "$LOG"
  (umask 077; printf 'machine 127.0.0.1 login test:tester password spotune-local-test-secret-7f3a\n' >"$ETC/netrc")

  # Swift ALWAYS reads /etc/swift/swift.conf (hash prefix/suffix, storage
  # policies); there is no option to move it. The Debian package ships a usable
  # one; only write it if it is missing.
  if [ ! -f /etc/swift/swift.conf ]; then
    mkdir -p /etc/swift
    cat > /etc/swift/swift.conf <<'EOF'
[swift-hash]
swift_hash_path_suffix = changeme
swift_hash_path_prefix = changeme

[storage-policy:0]
name = Policy-0
default = yes
EOF
  fi

  for s in account container object; do
    case $s in account) p=$ACCT_PORT;; container) p=$CONT_PORT;; object) p=$OBJ_PORT;; esac
    # object server: 1 MiB instead of 64 KiB chunks, GET of big objects ~2x faster
    extra=""; [ $s = object ] && extra="disk_chunk_size = 1048576
network_chunk_size = 1048576"
    cat > "$ETC/$s-server.conf" <<EOF
[DEFAULT]
bind_ip = 127.0.0.1
bind_port = $p
workers = 0
user = $RUNAS
swift_dir = $ETC
devices = $SRV
mount_check = false
log_name = $s-server
log_level = INFO
$extra

[pipeline:main]
pipeline = healthcheck $s-server

[app:$s-server]
use = egg:swift#$s

[filter:healthcheck]
use = egg:swift#healthcheck
EOF
  done

  cat > "$ETC/proxy-server.conf" <<EOF
[DEFAULT]
bind_ip = 127.0.0.1
bind_port = $PORT
workers = 0
user = $RUNAS
swift_dir = $ETC
log_name = proxy-server
log_level = INFO

[pipeline:main]
pipeline = catch_errors gatekeeper healthcheck proxy-logging cache listing_formats s3api tempauth copy slo dlo versioned_writes proxy-logging proxy-server

[app:proxy-server]
use = egg:swift#proxy
account_autocreate = true
# never "error-limit" a backend: with one replica, an error-limited node means
# 503 for 60 s even after the backend is back (matters for fault injection)
error_suppression_interval = 0
# 1 MiB instead of 64 KiB chunks: GET of a large object ~2x faster
object_chunk_size = 1048576
client_chunk_size = 1048576

[filter:s3api]
use = egg:swift#s3api
location = us-east-1
# virtual-host addressing on http://BUCKET.localhost:PORT (curl resolves
# *.localhost to loopback itself); http://127.0.0.1:PORT stays path-style
storage_domain = localhost

[filter:tempauth]
use = egg:swift#tempauth
# S3 access key = "<account>:<user>", secret = the value
user_test_tester = spotune-local-test-secret-7f3a .admin
user_admin_admin = admin .admin .reseller_admin

[filter:cache]
use = egg:swift#memcache
# No memcached is run: tempauth only needs the cache *object* in the env.
# Silence the per-request "Error connecting to memcached" lines.
memcache_servers = 127.0.0.1:11211
set log_level = CRITICAL

[filter:catch_errors]
use = egg:swift#catch_errors
[filter:gatekeeper]
use = egg:swift#gatekeeper
[filter:healthcheck]
use = egg:swift#healthcheck
[filter:proxy-logging]
use = egg:swift#proxy_logging
[filter:listing_formats]
use = egg:swift#listing_formats
[filter:copy]
use = egg:swift#copy
[filter:slo]
use = egg:swift#slo
[filter:dlo]
use = egg:swift#dlo
[filter:versioned_writes]
use = egg:swift#versioned_writes
EOF
}

build_rings() {
  # Rings depend only on IP/ports (stamp file): reuse them if ports unchanged.
  # Replicas 1, one device "d1" per ring, 2^8 partitions.
  [ "$(cat "$ETC/rings.stamp" 2>/dev/null)" = "127.0.0.1:$BP" ] &&
    [ -f "$ETC/object.ring.gz" ] && [ -f "$ETC/container.ring.gz" ] &&
    [ -f "$ETC/account.ring.gz" ] && return 0
  rm -f "$ETC"/*.ring.gz "$ETC"/*.builder "$ETC/rings.stamp"
  if [ "${SWIFT_S3_RINGS:-python}" = cli ]; then
    # canonical CLI way: 9 python start-ups, ~7 s on 2 cores
    for r in account:$ACCT_PORT container:$CONT_PORT object:$OBJ_PORT; do
      name=${r%%:*}; p=${r##*:}
      (cd "$ETC" &&
        swift-ring-builder "$name.builder" create 8 1 1 >/dev/null &&
        swift-ring-builder "$name.builder" add --region 1 --zone 1 \
          --ip 127.0.0.1 --port "$p" --device d1 --weight 100 >/dev/null &&
        { swift-ring-builder "$name.builder" rebalance >/dev/null || [ $? -eq 1 ]; })
    done
  else
    # same result through swift's RingBuilder API in one process, ~0.7 s
    /usr/bin/python3 - "$ETC" "$BP" <<'PYEOF'
import sys
from swift.common.ring import RingBuilder
etc, bp = sys.argv[1], int(sys.argv[2])
for name, port in (('object', bp), ('container', bp + 1), ('account', bp + 2)):
    b = RingBuilder(8, 1, 1)   # part_power=8, replicas=1, min_part_hours=1
    b.add_dev({'id': 0, 'region': 1, 'zone': 1, 'ip': '127.0.0.1',
               'port': port, 'replication_ip': '127.0.0.1',
               'replication_port': port, 'device': 'd1', 'weight': 100,
               'meta': ''})
    b.rebalance()
    b.get_ring().save('%s/%s.ring.gz' % (etc, name))
    b.save('%s/%s.builder' % (etc, name))
PYEOF
  fi
  for name in account container object; do
    [ -f "$ETC/$name.ring.gz" ] || { echo "ring $name not built" >&2; exit 1; }
  done
  echo "127.0.0.1:$BP" > "$ETC/rings.stamp"
}

# alive PID: exists and is not a zombie. Killed servers are re-parented to PID 1,
# which may reap them late; "kill -0" alone reports zombies as alive.
# (Reads /proc directly: no dependency on procps' ps.)
alive() {
  local line
  case ${1:-} in ''|*[!0-9]*) return 1;; esac
  read -r line 2>/dev/null < "/proc/$1/stat" || return 1
  line=${line##*) }                 # 3rd field = state, after "(comm) "
  [ "${line%% *}" != Z ] && [ "${line%% *}" != X ]
}

start_one() {
  local s=$1 pidf=$RUN/$1.pid
  if [ -f "$pidf" ] && alive "$(cat "$pidf")"; then return 0; fi
  # -v: also log to stderr (there is no /dev/log here, syslog would drop it)
  nohup "/usr/bin/swift-$s-server" "$ETC/$s-server.conf" -v \
    >>"$LOG/$s.log" 2>&1 </dev/null &
  echo $! > "$pidf"
}

port_busy() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

wait_ready() {
  local deadline=$((SECONDS + ${1:-30})) p s
  # 1) every server answers GET /healthcheck with "OK"
  for p in $ACCT_PORT $CONT_PORT $OBJ_PORT $PORT; do
    until [ "$(curl -s -m 1 "http://127.0.0.1:$p/healthcheck" 2>/dev/null)" = OK ]; do
      if [ $SECONDS -ge $deadline ]; then echo "port $p not ready" >&2; return 1; fi
      for s in $SERVERS; do
        alive "$(cat "$RUN/$s.pid" 2>/dev/null)" ||
          { echo "swift-$s-server died; see $LOG/$s.log" >&2; tail -n 20 "$LOG/$s.log" >&2; return 1; }
      done
      sleep 0.1
    done
  done
  # 2) a real SigV4 S3 request (ListBuckets) through s3api + tempauth
  until [ "$(curl -s -m 5 -o /dev/null -w '%{http_code}' --aws-sigv4 aws:amz:us-east-1:s3 \
            -H x-amz-content-sha256:UNSIGNED-PAYLOAD \
            --netrc-file "$ETC/netrc" "http://127.0.0.1:$PORT/")" = 200 ]; do
    if [ $SECONDS -ge $deadline ]; then echo "S3 ListBuckets never returned 200" >&2; return 1; fi
    sleep 0.1
  done
}

stop_one() {
  local s=$1 pid
  [ -f "$RUN/$s.pid" ] || return 0
  pid=$(cat "$RUN/$s.pid")
  if alive "$pid"; then
    kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 50); do alive "$pid" || break; sleep 0.1; done
    if alive "$pid"; then kill -KILL "$pid" 2>/dev/null || true; fi
  fi
  rm -f "$RUN/$s.pid"
}

stop_all() {
  local s
  for s in proxy object container account; do stop_one "$s"; done
}

print_env() {
  cat <<ENVEOF
export AWS_ACCESS_KEY_ID=test:tester AWS_SECRET_ACCESS_KEY=spotune-local-test-secret-7f3a
export AWS_REGION=us-east-1 AWS_DEFAULT_REGION=us-east-1 AWS_EC2_METADATA_DISABLED=true
export AWS_ENDPOINT_URL=http://127.0.0.1:$PORT SPOTUNE_TEST_S3_ENDPOINT=http://127.0.0.1:$PORT
ENVEOF
}

case ${1:-} in
  start)
    if [ "${2:-}" = --clean ]; then
      stop_all
      case $BASE in /|'') echo "refusing to wipe '$BASE'" >&2; exit 2;; esac
      rm -rf "$SRV" "$RUN" "$LOG"
    fi
    write_configs
    build_rings
    n=0; for s in $SERVERS; do alive "$(cat "$RUN/$s.pid" 2>/dev/null)" && n=$((n + 1)); done
    if [ $n -lt 4 ]; then
      stop_all                      # our own leftovers only (by PID file)
      for p in $ACCT_PORT $CONT_PORT $OBJ_PORT $PORT; do
        if port_busy "$p"; then echo "127.0.0.1:$p is already in use" >&2; exit 1; fi
      done
      for s in $SERVERS; do start_one "$s"; done
    fi
    wait_ready "${SWIFT_S3_TIMEOUT:-30}"
    echo "swift-s3 ready: http://127.0.0.1:$PORT (base $BASE); environment:"
    print_env
    ;;
  start-one) start_one "${2:?server name}" ;;   # e.g. restart just the proxy
  stop-one)  stop_one "${2:?server name}" ;;    # e.g. kill just the proxy
  env)   print_env ;;
  wait)  wait_ready "${2:-30}" ;;
  stop)  stop_all ;;
  status)
    for s in $SERVERS; do
      pid=$(cat "$RUN/$s.pid" 2>/dev/null || echo -)
      if alive "$pid"; then echo "$s $pid running"; else echo "$s $pid stopped"; fi
    done ;;
  *) echo "usage: $0 start [--clean]|stop|status|wait [secs]|start-one SERVER|stop-one SERVER|env" >&2; exit 2 ;;
esac
