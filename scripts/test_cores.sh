#!/usr/bin/env bash
# test_cores.sh — how many cores each test keeps busy: runs ctest in BUILD_DIR
# (one test at a time, whatever the arguments) while sampling the machine's
# busy time from /proc/stat, then prints each test's wall time and the cores
# busy over it (CPU time / wall time), longest first, and the total.
# A test near 1 core or below, and whose timings leave slack, may join the
# list of tests that run two at a time (the end of tests/CMakeLists.txt);
# run it with nothing else busy on the machine.
# usage: scripts/test_cores.sh BUILD_DIR [ctest arguments, e.g. -LE cuda_emu]
set -euo pipefail
[ $# -ge 1 ] && [ -d "$1" ] || { echo "usage: scripts/test_cores.sh BUILD_DIR [ctest args]" >&2; exit 2; }
build=$1
shift
work=$(mktemp -d)
trap 'kill "$sampler" 2>/dev/null || true; rm -rf "$work"' EXIT
# /proc/stat's first line every 0.5 s, after a monotonic timestamp
(while :; do
   read -r up _ </proc/uptime
   echo "$up $(head -1 /proc/stat)"
   sleep 0.5
 done) >"$work/stat" &
sampler=$!
rc=0
(cd "$build" && ctest --output-on-failure "$@" -j 1) | while IFS= read -r line; do
  read -r up _ </proc/uptime
  echo "$up $line"
done >"$work/log" || rc=$?
kill "$sampler"
python3 - "$work/stat" "$work/log" <<'EOF'
import bisect, os, re, sys
cores = os.cpu_count()
t, busy, total = [], [], []
for line in open(sys.argv[1]):
    f = line.split()
    v = list(map(int, f[2:10]))  # user nice system idle iowait irq softirq steal
    t.append(float(f[0]))
    total.append(sum(v))
    busy.append(sum(v) - v[3] - v[4])
rows = []
for line in open(sys.argv[2]):
    m = re.match(r"(\S+) +\d+/\d+ Test +#\d+: (\S+) \.*\s*(\*\*\*)?(\w+).*?([\d.]+) sec", line)
    if not m:
        continue
    end, name, status, wall = float(m.group(1)), m.group(2), m.group(4), float(m.group(5))
    i = min(bisect.bisect_left(t, end - wall), len(t) - 1)
    j = min(bisect.bisect_left(t, end), len(t) - 1)
    if j > i and total[j] > total[i]:
        used = "%.2f" % ((busy[j] - busy[i]) / (total[j] - total[i]) * cores)
    else:
        used = "-"  # shorter than a sample
    rows.append((wall, name, used, status))
rows.sort(reverse=True)
print("| test | wall s | cores busy (of %d) | result |" % cores)
print("| --- | ---: | ---: | --- |")
for wall, name, used, status in rows:
    print("| %s | %.1f | %s | %s |" % (name, wall, used, status))
print("| all | %.1f | | |" % sum(r[0] for r in rows))
EOF
exit "$rc"
