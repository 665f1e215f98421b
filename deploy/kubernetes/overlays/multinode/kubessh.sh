#!/bin/sh
# Open MPI's remote launch agent for this LeaderWorkerSet group (mpirun -mca plm_rsh_agent, set by
# launcher.mpi from MPI_RSH_AGENT): mpirun calls it as it would call ssh, `kubessh.sh POD COMMAND...`, to start
# its daemon (orted) on a worker pod. Here COMMAND runs in POD's rank-host container through the API server
# (`kubectl exec`, as the leader's ServiceAccount tritonllm-mpi-launcher: pods get, pods/exec create), in that
# container's own environment (the image's ENV and the pod's env, unlike a login through sshd), as its uid.
# No SSH server, key or passwd lookup on the workers. Like ssh, the words of COMMAND are joined and run by a
# shell (mpirun quotes what needs quoting for one).
#
# A worker pod that is not ready yet (LWS starts the group's pods together) is waited for, up to
# KUBESSH_WAIT_S seconds (default 600), so that the engine starts once the whole group is up.
set -eu
if [ $# -lt 2 ]; then
  echo "usage: kubessh.sh POD COMMAND..." >&2
  exit 2
fi
pod=$1
shift
container=${KUBESSH_CONTAINER:-rank-host}
limit=${KUBESSH_WAIT_S:-600}
waited=0
until [ "$(kubectl get pod "$pod" -o 'jsonpath={.status.conditions[?(@.type=="Ready")].status}')" = True ]; do
  if [ "$waited" -ge "$limit" ]; then
    echo "kubessh: pod $pod is not ready after ${limit} s (kubectl describe pod $pod)" >&2
    exit 1
  fi
  echo "kubessh: waiting for pod $pod to be ready ..." >&2
  sleep 5
  waited=$((waited + 5))
done
exec kubectl exec "$pod" -c "$container" -- /bin/sh -c "$*"
