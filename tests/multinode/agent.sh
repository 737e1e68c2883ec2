#!/usr/bin/env bash
# tests/multinode/agent.sh — the launch agent of the multi-node tests, in
# place of ssh (Open MPI's plm_rsh_agent). Open MPI runs it as
#   agent.sh HOST COMMAND-LINE...
# and it runs the command line with /bin/sh on HOST: inside the network
# namespace of that host (from the map in $SPOTUNE_MN_HOSTS, lines
# "HOST NAMESPACE"), under the host's own name (a UTS namespace of its own),
# with the bare environment a login over ssh gives. Whatever the ranks need
# beyond that (AWS_*, SPOTUNE_*, LD_LIBRARY_PATH...) must be passed by
# mpirun (-x), as on real nodes.
#
# A host line may carry a third field, SRC:DST: the host then sees directory
# SRC at DST (a bind mount in a mount namespace of its own), as a machine
# sees its own disk where another has another: run directories that the
# nodes do not share.
#
# Like the ssh client, the agent itself stays on the launching node (it is
# not one of HOST's processes, so it outlives them), returns the remote
# command's exit status, and 255 when the remote side was killed or the host
# is unknown.
set -u
host=${1:?usage: agent.sh HOST COMMAND...}
shift
map=${SPOTUNE_MN_HOSTS:?agent.sh: SPOTUNE_MN_HOSTS is not set}
ns=$(awk -v h="$host" '$1 == h { print $2; exit }' "$map" 2>/dev/null)
disk=$(awk -v h="$host" '$1 == h { print $3; exit }' "$map" 2>/dev/null)
if [ -z "$ns" ] || [ ! -e "/run/netns/$ns" ]; then
    echo "agent.sh: $host: no such host" >&2
    exit 255
fi
if [ -n "$disk" ]; then
    ip netns exec "$ns" env -i HOME="${HOME:-/root}" USER="$(id -un)" LOGNAME="$(id -un)" \
        SHELL=/bin/sh PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
        SPOTUNE_MN_HOSTS="$map" \
        unshare --uts --mount --propagation private /bin/sh -c \
        'hostname "$0" && mount --bind "${2%%:*}" "${2#*:}" && exec /bin/sh -c "$1"' \
        "$host" "$*" "$disk"
else
    ip netns exec "$ns" env -i HOME="${HOME:-/root}" USER="$(id -un)" LOGNAME="$(id -un)" \
        SHELL=/bin/sh PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
        SPOTUNE_MN_HOSTS="$map" \
        unshare --uts /bin/sh -c 'hostname "$0" && exec /bin/sh -c "$1"' "$host" "$*"
fi
rc=$?
[ "$rc" -gt 128 ] && exit 255
exit "$rc"
