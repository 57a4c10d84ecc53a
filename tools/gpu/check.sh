#!/usr/bin/env bash
# Run hpcdp's GPU checks on a CUDA machine: what the machine and MPI report, then every
# test marked `gpu` (the device code paths: hpcdp's collectives and compression on CUDA
# buffers, DDP, the "hpcdp" torch.distributed backend with torch DDP and FSDP2 on CUDA,
# the benchmarks' --device cuda), serial and under mpirun. Ranks share the GPUs the machine
# has; a test that needs what is absent (CUDA, a CUDA-aware MPI) skips and says why (-rs).
#
#   HPCDP_GPU_NP   world sizes for the multi-rank tests (default: "1 2")
#   HPCDP_GPU_LOG  folder for the logs (default: out/gpu-check)
# Run it from the repository root, with python/mpirun of the environment to test on PATH.
set -uo pipefail
cd "$(dirname "$0")/../.."
LOG=${HPCDP_GPU_LOG:-out/gpu-check}
mkdir -p "$LOG"
export PYTHONUNBUFFERED=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
rc=0
nvidia-smi -L || true
python -c "import torch, numba, h5py, mpi4py; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'numba', numba.__version__, 'h5py', h5py.__version__, 'mpi4py', mpi4py.__version__)"
mpirun -np 2 python -m hpcdp.info | tee "$LOG/info.txt"
echo "== serial device tests"
python -m pytest -q -rs -m gpu tests 2>&1 | tee "$LOG/serial.txt" || rc=1
for n in ${HPCDP_GPU_NP:-1 2}; do
  echo "== multi-rank device tests, np=$n"
  timeout --kill-after=15 900 mpirun -np "$n" python -m pytest -q -rs --only-mpi -m gpu \
    --timeout-method=thread tests 2>&1 | tee "$LOG/mpi-np$n.txt" || rc=1
done
exit $rc
