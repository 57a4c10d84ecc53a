#!/usr/bin/env bash
# Reproduce the allreduce figures of docs/performance.md: hpcdp's ring against the
# MPI library's own MPI_Allreduce, same run, np = 2 and 4, for every MPI venv given.
#
#   tools/bench/allreduce.sh [VENV ...]     (default: .venv, plus .venv-ompi if present)
#   OUT=dir TRIALS=5 SIZES=4k,...,256m EXTRA="--gloo"
#
# Writes one JSON line per size to $OUT/allreduce-<mpi>-np<N>.jsonl and prints a table.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-out/bench}
TRIALS=${TRIALS:-5}
SIZES=${SIZES:-4k,16k,64k,256k,1m,4m,16m,64m,256m}
mkdir -p "$OUT"
venvs=("$@")
if [ ${#venvs[@]} -eq 0 ]; then
  venvs=(.venv)
  [ -x .venv-ompi/bin/python ] && venvs+=(.venv-ompi)
fi
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_btl=^ofi
for v in "${venvs[@]}"; do
  if "$v/bin/mpirun" --version 2>/dev/null | grep -q "Open MPI"; then mpi=ompi; else mpi=mpich; fi
  for np in 2 4; do
    flags=()
    [ "$mpi" = ompi ] && [ "$np" -gt 2 ] && flags=(--oversubscribe)
    f="$OUT/allreduce-$mpi-np$np.jsonl"
    "$v/bin/mpirun" "${flags[@]}" -np "$np" "$v/bin/python" -m hpcdp.cli.bench allreduce \
      --trials "$TRIALS" --sizes "$SIZES" ${EXTRA:-} > "$f"
    "$v/bin/python" - "$f" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    d = json.loads(line)
    print(f"{d['mpi']:>16} np={d['np']} {d['bytes']:>10} B  hpcdp {d['hpcdp_busbw']:6.3f} GB/s  "
          f"native {d['native_busbw']:6.3f} GB/s  ratio {d['ratio']:5.2f}"
          + (f"  gloo {d['gloo_busbw']:6.3f} GB/s" if 'gloo_busbw' in d else ""))
PY
  done
done
