#!/bin/sh
# Launch agent of the multi-host test bed: ssh for "hosts" that are network namespaces.
#
#   netns_agent.sh MAP [ssh options...] HOST COMMAND...
#
# MPI launchers call their agent the way they call ssh: the host, then the remote
# command as words for a shell (Hydra may put ssh options such as -x first).  MAP
# holds one "ADDRESS NAMESPACE" pair a line.  Like sshd, the agent starts the
# command in a login-like environment (HOME, USER, a bare PATH, nothing else
# inherited from mpirun), so the test bed sees what psrun must forward to ranks on
# other machines.  Each host also gets its own UTS namespace with the namespace's
# name as hostname, since MPI tells hosts apart by hostname.
set -eu
map=$1
shift
while [ $# -gt 0 ] && [ "${1#-}" != "$1" ]; do
    shift  # ssh options, e.g. Hydra's -x
done
if [ $# -lt 2 ]; then
    echo "usage: netns_agent.sh MAP [options] HOST COMMAND..." >&2
    exit 255
fi
host=$1
shift
namespace=$(awk -v host="$host" '$1 == host { print $2 }' "$map")
if [ -z "$namespace" ]; then
    echo "netns_agent.sh: host $host is not in $map" >&2
    exit 255  # what ssh returns when it cannot reach a host
fi
# Open MPI's daemon crashes (SIGSEGV) without HOME, which an ssh login always sets.
exec env -i HOME="${HOME:-/root}" USER="$(id -un)" LOGNAME="$(id -un)" SHELL=/bin/sh \
    PATH=/usr/local/bin:/usr/bin:/bin \
    ip netns exec "$namespace" unshare --uts \
    sh -c 'hostname "$1" && shift && exec sh -c "$*"' agent "$namespace" "$@"
