#!/usr/bin/env bash
# Reproduce the allreduce figures of docs/performance.md: hpcdp's default algorithm
# against the MPI library's own MPI_Allreduce, same run, np = 2 and 4 (NPS), for every MPI
# venv given, ROUNDS rounds (each round runs every MPI and np once, so drift hits all alike).
#
#   tools/bench/allreduce.sh [VENV ...]     (default: .venv, plus .venv-ompi and .venv-impi if present)
#   OUT=dir ROUNDS=5 TRIALS=5 NPS="2 4" SIZES=4k,...,256m EXTRA="--algos ring"
#
# The cost model's one-node measurements (tools/bench/validate_model.py), each round after
# its own calibration ($OUT/calibration-round<R>.json, hpcdp-bench calibrate at np = 2):
#   OUT=out/model ROUNDS=10 NPS="1 2 3 4 5 6 7 8" SIZES=4k,64k,1m,16m EXTRA="--algos ring,shm" \
#       CALIBRATE=1 tools/bench/allreduce.sh .venv
#
# torch.distributed over the "hpcdp" backend against gloo (docs/torch-distributed.md):
#   OUT=out/backend NPS=2 SIZES=4k,64k,1m,16m,64m,256m EXTRA=--backend-compare tools/bench/allreduce.sh
#
# Writes one JSON line per size and round to $OUT/allreduce-<mpi>-np<N>.jsonl (field
# "round"), then the summary of every point over the rounds (tools/bench/rounds.py) to
# $OUT/allreduce-rounds.jsonl, and prints it.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-out/bench}
ROUNDS=${ROUNDS:-5}
TRIALS=${TRIALS:-5}
SIZES=${SIZES:-4k,64k,256k,1m,4m,16m,64m,256m}
NPS=${NPS:-2 4}
mkdir -p "$OUT"
venvs=("$@")
if [ ${#venvs[@]} -eq 0 ]; then
  venvs=(.venv)
  [ -x .venv-ompi/bin/python ] && venvs+=(.venv-ompi)
  [ -x .venv-impi/bin/python ] && venvs+=(.venv-impi)
fi
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_btl=^ofi
# (Open MPI 5 from PyPI: the UCX one-sided component fails its query on every window and
# says so; the shared-memory one is what a one-node window uses anyway)
export OMPI_MCA_osc=sm
# mpirun_in VENV ARGS...: that venv's mpirun, its bin first on PATH (Intel MPI's mpirun
# runs mpiexec.hydra from there)
mpirun_in() { local v=$1; shift; PATH="$v/bin:$PATH" "$v/bin/mpirun" "$@"; }
mpi_of() {
  case "$(mpirun_in "$1" --version 2>/dev/null)" in
    *"Open MPI"*) echo ompi ;; *Intel*) echo impi ;; *) echo mpich ;;
  esac
}
for v in "${venvs[@]}"; do
  for np in $NPS; do : >"$OUT/allreduce-$(mpi_of "$v")-np$np.jsonl"; done
done
for ((round = 1; round <= ROUNDS; round++)); do
  if [ -n "${CALIBRATE:-}" ]; then
    echo "round $round/$ROUNDS: calibrate" >&2
    mpirun_in "${venvs[0]}" -np 2 "${venvs[0]}/bin/python" -m hpcdp.cli.bench calibrate \
      --out "$OUT/calibration-round$round.json" >/dev/null
  fi
  for v in "${venvs[@]}"; do
    mpi=$(mpi_of "$v")
    for np in $NPS; do
      flags=()
      [ "$mpi" = ompi ] && flags=(--oversubscribe)
      echo "round $round/$ROUNDS: $mpi np=$np" >&2
      mpirun_in "$v" "${flags[@]}" -np "$np" "$v/bin/python" -m hpcdp.cli.bench allreduce \
        --trials "$TRIALS" --sizes "$SIZES" ${EXTRA:-} |
        ROUND=$round python3 -c 'import json, os, sys
for line in sys.stdin:
    print(json.dumps(dict(json.loads(line), round=int(os.environ["ROUND"]))))' \
        >>"$OUT/allreduce-$mpi-np$np.jsonl"
    done
  done
done
summary=()
case " ${EXTRA:-} " in *" --backend-compare "*) summary=(--backend) ;; esac
python3 tools/bench/rounds.py "${summary[@]}" "$OUT"/allreduce-*-np*.jsonl >"$OUT/allreduce-rounds.jsonl"
cat "$OUT/allreduce-rounds.jsonl"
