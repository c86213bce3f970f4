#!/usr/bin/env bash
# Time a kernel change against its predecessor in one device call (issue 13's method: the same
# inputs, the same run, side by side), then the per-kernel tile sweep with pointer and TMA loads.
#
#   tools/run_kernel_timing.sh BASELINE_KERNELS [SEQ ...]      # default SEQ: 32768 131072
#
# BASELINE_KERNELS: an earlier copy of the s2attn package, made here before the call and carried
# with it (the folder is git-ignored), e.g.
#   mkdir -p .bench/base-22c9e0b && git archive 22c9e0b kernels | tar -x -C .bench/base-22c9e0b
#   # device call, carry [".bench"]:  tools/run_kernel_timing.sh .bench/base-22c9e0b/kernels
# Writes bench-*.json/.log and tune-*.log under $OUT (or ./kernel-timing without $OUT) and ends
# with the benchmark tables. About 3 minutes per length on an H100; no FA4 needed (its rows are
# the separate calls of docs/benchmarks.md's "Running the benchmarks").
set -euo pipefail
cd "$(dirname "$0")/.."

base=${1:?usage: tools/run_kernel_timing.sh BASELINE_KERNELS [SEQ ...]}
shift
seqs=("$@")
[ ${#seqs[@]} -gt 0 ] || seqs=(32768 131072)
[ -f "$base/__init__.py" ] || { echo "no s2attn package at $base" >&2; exit 2; }
out=${OUT:-kernel-timing}
mkdir -p "$out"
py=${PYTHON:-python3}
export PYTHONUNBUFFERED=1

# s2attn from this checkout (its folder is kernels/), without installing anything.
mkdir -p /tmp/s2src && ln -sfn "$PWD/kernels" /tmp/s2src/s2attn
export PYTHONPATH=/tmp/s2src${PYTHONPATH:+:$PYTHONPATH}

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv
for s in "${seqs[@]}"; do
    # Dense baselines that the machine has (no FA4), our dense-pattern row, the old package's
    # rows (--baseline) and the tile/TMA alternatives (--sweep).
    "$py" tools/benchmark.py --seqs "$s" --rows s2dense,flash,cudnn --baseline "$base" --sweep \
        --json "$out/bench-$s.json" 2>&1 | tee "$out/bench-$s.log"
done
for s in "${seqs[@]}"; do
    "$py" tools/tune_kernels.py --seq "$s" 2>&1 | tee "$out/tune-$s.log"
done
for s in "${seqs[@]}"; do
    sed -n '/^| seq x batch/,$p' "$out/bench-$s.log"
done
