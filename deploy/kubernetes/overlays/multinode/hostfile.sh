#!/bin/sh
# Writes the MPI hostfile of this LeaderWorkerSet group: the leader, then workers 1..size-1, each with
# GPUS_PER_NODE slots, so that ranks 0..7 land on the leader, 8..15 on worker 1, and so on. Pod names follow
# LWS's scheme: leader <name>-<group>, workers <name>-<group>-<index>, under the group's headless service.
set -eu
leader=$LWS_LEADER_ADDRESS            # <name>-<group>.<service>.<namespace>
host=${leader%%.*}
domain=${leader#*.}
{
  echo "$leader slots=$GPUS_PER_NODE"
  i=1
  while [ "$i" -lt "$LWS_GROUP_SIZE" ]; do
    echo "$host-$i.$domain slots=$GPUS_PER_NODE"
    i=$((i + 1))
  done
} > /etc/mpi/hostfile
cat /etc/mpi/hostfile
