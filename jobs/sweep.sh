#!/bin/bash
# jobs/sweep.sh: a scaling sweep. Submits jobs/multinode.sbatch once per (node count,
# compression), waits for all of them, and collects their traces, logs and exit statuses
# in one directory, with a scaling table per compression (python -m hpcdp.trace.cli scaling).
#
#   jobs/sweep.sh                                              # 1, 2 nodes x none, fp16
#   HPCDP_SWEEP_NODES="1 2 4 8" HPCDP_SWEEP_COMPRESSION="none fp16 onebit" \
#     HPCDP_SWEEP_SBATCH_ARGS="--ntasks-per-node=4 --gpus-per-node=4 --time=20" jobs/sweep.sh
#
# Run it on a login node (it calls sbatch). Knobs:
#
#   HPCDP_SWEEP_NODES         node counts (default: "1 2")
#   HPCDP_SWEEP_COMPRESSION   compressions (default: "none fp16")
#   HPCDP_SWEEP_FLAG          how the command takes the compression (default: --compression)
#   HPCDP_SWEEP_DIR           output directory (default: sweep-YYYYmmdd-HHMMSS); it gets
#                             traces/<job name>-<job id>/, logs/, index.tsv, scaling-<compression>.txt
#   HPCDP_SWEEP_SCRIPT        batch script (default: multinode.sbatch next to this file)
#   HPCDP_SWEEP_SBATCH_ARGS   extra sbatch options for every job (default: none)
#   HPCDP_SWEEP_TIMEOUT       give up waiting after this many seconds (default: 86400)
#
# Everything multinode.sbatch reads (HPCDP_VENV, HPCDP_CMD, HPCDP_ARGS, HPCDP_LAUNCHER,
# HPCDP_MPI, HPCDP_FABRIC, ...) is passed through. The sweep turns checkpoints off
# (HPCDP_CKPT_DIR=""): a benchmark that gets preempted is rerun, not resumed.
# Exit status: 0 when every job succeeded, 1 otherwise (index.tsv says which).
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
nodes=${HPCDP_SWEEP_NODES:-1 2}
compressions=${HPCDP_SWEEP_COMPRESSION:-none fp16}
flag=${HPCDP_SWEEP_FLAG:---compression}
dir=${HPCDP_SWEEP_DIR:-sweep-$(date +%Y%m%d-%H%M%S)}
script=${HPCDP_SWEEP_SCRIPT:-$here/multinode.sbatch}
read -r -a sbatch_args <<<"${HPCDP_SWEEP_SBATCH_ARGS:-}"
limit=${HPCDP_SWEEP_TIMEOUT:-86400}

[[ -r $script ]] || { echo "sweep: batch script $script not found" >&2; exit 2; }
mkdir -p "$dir/traces" "$dir/logs"
dir=$(cd "$dir" && pwd)
python=${HPCDP_VENV:+$HPCDP_VENV/bin/}python

# One `sbatch --wait` per job, in the background: each returns its job's exit status.
names=() pids=() cfg=()
for n in $nodes; do
    for c in $compressions; do
        name=sweep-n$n-$c
        HPCDP_ARGS="${HPCDP_ARGS:-} $flag $c" HPCDP_TRACE_DIR=$dir/traces HPCDP_CKPT_DIR="" \
            timeout "$limit" sbatch --wait --nodes="$n" --job-name="$name" \
            --output="$dir/logs/%x-%j.out" "${sbatch_args[@]}" "$script" >"$dir/logs/$name.submit" 2>&1 &
        names+=("$name") pids+=($!) cfg+=("$n $c")
    done
done
echo "sweep: ${#names[@]} job(s) submitted, waiting; output in $dir"

failed=0
printf 'nodes\tcompression\tjob_id\texit_status\ttrace\n' >"$dir/index.tsv"
for i in "${!names[@]}"; do
    rc=0
    wait "${pids[$i]}" || rc=$?
    read -r n c <<<"${cfg[$i]}"
    jobid=$(grep -o 'Submitted batch job [0-9]*' "$dir/logs/${names[$i]}.submit" | awk '{print $4}' || true)
    trace=$dir/traces/${names[$i]}-$jobid
    [[ -n $jobid && -d $trace ]] || trace=-
    ((rc == 0)) || failed=1
    printf '%s\t%s\t%s\t%s\t%s\n' "$n" "$c" "${jobid:--}" "$rc" "$trace" >>"$dir/index.tsv"
    echo "sweep: ${names[$i]}: job ${jobid:-not submitted}, exit status $rc"
done

# A scaling table per compression over the traces that exist (first step left out: warm-up).
for c in $compressions; do
    runs=$(awk -F'\t' -v c="$c" 'NR > 1 && $2 == c && $5 != "-" {print $5}' "$dir/index.tsv")
    [[ -n $runs ]] || continue
    # shellcheck disable=SC2086  # one argument per run directory (no blanks in them)
    "$python" -m hpcdp.trace.cli scaling --skip 1 $runs >"$dir/scaling-$c.txt" 2>&1 \
        || { echo "sweep: scaling table for $c failed, see $dir/scaling-$c.txt" >&2; failed=1; }
done
column -t -s $'\t' "$dir/index.tsv" 2>/dev/null || cat "$dir/index.tsv"
exit "$failed"
