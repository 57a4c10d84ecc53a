# env.sh — source this (job scripts, tests, interactive shells) to use the local cluster:
#
#     . tools/cluster/env.sh        # then: sbatch --wait job.sh / srun -N2 -n2 ...
#
# It points the Slurm clients at the cluster's slurm.conf and makes MPI traffic really
# cross the shaped veth links between the node namespaces. All the nodes share one
# kernel, so without these settings pip MPICH's default UCX netmod reaches the "other
# node" through shared memory / CMA and 0 bytes cross the link (check with
# `harness.tc_bytes` or `tc -s qdisc`). A value already set by the caller wins.
#
# Sourced, not executed: no `set -euo pipefail` here (that would change the caller's
# shell options), no exit, only exports.
# shellcheck shell=bash

export HPCDP_CLUSTER_DIR="${HPCDP_CLUSTER_DIR:-/tmp/hpcdp-cluster}"
# The values up.sh recorded (node count, rate, subnet, SLURM_CONF), if the cluster is up.
if [ -r "$HPCDP_CLUSTER_DIR/cluster.env" ]; then
    while IFS='=' read -r _hpcdp_k _hpcdp_v; do
        case $_hpcdp_k in
            HPCDP_CLUSTER_NODES|HPCDP_CLUSTER_RATE|HPCDP_CLUSTER_SUBNET) export "$_hpcdp_k=$_hpcdp_v" ;;
        esac
    done <"$HPCDP_CLUSTER_DIR/cluster.env"
    unset _hpcdp_k _hpcdp_v
fi

# Slurm: our own slurm.conf (the system /etc/slurm is not used); the daemons live in
# /usr/sbin on Debian, which a non-login root shell may lack.
export SLURM_CONF="$HPCDP_CLUSTER_DIR/etc/slurm.conf"
case ":$PATH:" in *:/usr/sbin:*) ;; *) export PATH="$PATH:/usr/sbin" ;; esac
# srun's --mpi default (slurm.conf also has MpiDefault=pmi2). pip MPICH needs PMI-2;
# --mpi=none would silently give N singletons (each rank 0 of size 1).
export SLURM_MPI_TYPE="${SLURM_MPI_TYPE:-pmi2}"

# pip MPICH (5.x): use the OFI netmod with libfabric's tcp provider, i.e. real TCP over
# eth0. (UCX_TLS=tcp with the UCX netmod works too.) MPICH decides "same node" by
# hostname, and every node has its own, so intra-node shm is not used across nodes.
export MPIR_CVAR_CH4_NETMOD="${MPIR_CVAR_CH4_NETMOD:-ofi}"
export FI_PROVIDER="${FI_PROVIDER:-tcp}"

# pip Open MPI (5.x) with `srun --mpi=pmix`: its ob1/tcp btl uses eth0 across nodes by
# default; skip the ofi btl (1 s MPI_Init delay here) and use PMIx's native security
# (Slurm asks for munge, which the pip PMIx lacks). (Also set OPAL_PREFIX=PMIX_PREFIX=<venv>
# for its help files; the harness does, see docs/cluster.md.)
export OMPI_MCA_btl="${OMPI_MCA_btl:-^ofi}"
export PMIX_MCA_psec="${PMIX_MCA_psec:-native}"
# Its UCX one-sided component finds no UCX transport here and prints an "Error:" line per
# window (Open MPI issue 14086); shared windows take the shared-memory one anyway.
export OMPI_MCA_osc="${OMPI_MCA_osc:-^ucx}"
# Every node's Slurm CPUs are the same two cores of this machine, so a node that looks
# fully subscribed to Open MPI is oversubscribed in fact; without yielding, its busy-polling
# ranks starve each other (a 64 MiB MPI_Allreduce on 2 nodes x 2 ranks took 8.3 s instead
# of 0.57 s). MPICH yields every 1000 polls by default.
export OMPI_MCA_mpi_yield_when_idle="${OMPI_MCA_mpi_yield_when_idle:-1}"
# hpcdp's compression kernels: one thread per rank. hpcdp gives a rank its node's CPUs
# divided by the node's ranks, but every emulated node's CPUs are the same two cores of this
# machine: 4 nodes x 1 rank ran 8 kernel threads on 2 cores, and a 64 KiB fp16 allreduce
# took 166 ms instead of 1.9 ms. (HPCDP_CLUSTER_PIN=1 gives nodes disjoint cores instead.)
export NUMBA_NUM_THREADS="${NUMBA_NUM_THREADS:-1}"
# Large messages over its tcp btl without the emulated RDMA put (the btl's "put" flag): with
# it, every message above 64 KiB waits for a put request from the receiver, which queues
# behind the receiver's own bulk data on a loaded link; a flat ring's 64 MiB allreduce on
# 2 nodes x 1 rank took 0.95 s instead of 0.56 (jobs/multinode.sbatch sets the same).
export OMPI_MCA_btl_tcp_flags="${OMPI_MCA_btl_tcp_flags:-send,inplace,need-ack,need-csum}"
