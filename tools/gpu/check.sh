#!/usr/bin/env bash
# Run hpcdp's GPU checks on a CUDA machine: what the machine and MPI report,
# the serial device tests, and the multi-rank device tests (ranks share the
# GPUs the machine has; the real-GPU tests skip where CUDA is absent).
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
python -m pytest -q -rs -p no:cacheprovider tests/test_compress_device.py tests/test_runtime.py \
  tests/test_bench_allreduce.py tests/test_train.py::test_device_flag_puts_the_model_on_the_gpu_or_refuses_without_one \
  tests/test_bench_train.py::test_device_cuda_times_every_mode_on_the_gpu_or_is_refused_without_one \
  2>&1 | tee "$LOG/serial.txt" || rc=1
for n in ${HPCDP_GPU_NP:-1 2}; do
  echo "== multi-rank device tests, np=$n"
  timeout --kill-after=15 500 mpirun -np "$n" python -m pytest -q -rs -p no:cacheprovider --only-mpi \
    --timeout=120 --timeout-method=thread tests/test_device_mpi.py 2>&1 | tee "$LOG/mpi-np$n.txt" || rc=1
done
exit $rc
