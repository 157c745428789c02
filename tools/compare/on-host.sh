#!/bin/bash
# Runs one rank of tools/compare-mpi or tools/cpu-account on its device: rank i on host i's
# device and address when ACROSS is set (the veth case), else every rank on rxe0 (none with
# RXE_NO_DEVICE: the TCP comparison). The rank comes from Open MPI or rdmacomm-run.
r=${OMPI_COMM_WORLD_RANK:-${RANK:-0}}
# PER_HOST=k: ranks k to a host (rank i on host i / k), said to rdmacomm by RDMACOMM_HOST_ID.
[ -n "${PER_HOST:-}" ] && { r=$((r / PER_HOST)); export RDMACOMM_HOST_ID=vmhost$r; }
if [ -n "${ACROSS:-}" ]; then
  dev=$(eval echo \$RXE_DEV_$r); ip=$(eval echo \$RXE_IP_$r)
  export UCX_NET_DEVICES=$dev:1 RDMACOMM_IB_DEVICE=$dev RDMACOMM_BIND_ADDR=$ip
elif [ -z "${RXE_NO_DEVICE:-}" ]; then
  export UCX_NET_DEVICES=rxe0:1 RDMACOMM_IB_DEVICE=rxe0
fi
exec "$@"
