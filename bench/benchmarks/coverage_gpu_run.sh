#!/bin/bash
# Issue #17 (every shape runs), one call on the GPU machine from the repository root, with .whl carried
# (nvidia-cutlass and scons wheels): build the low-alignment GEMM and generic conv kernels (bench/sets/coverage_gpu.yaml)
# next to fp16_rcr_essential (the 16-byte kernels they rank behind), validate every new kernel against the float64
# reference and time the problems through the public API against cuBLAS / cuDNN (bench/benchmarks/coverage_gpu.py).
# Writes build / validation logs and coverage_gpu.json to $OUT; the last lines printed are the timing table.
#   bash bench/benchmarks/coverage_gpu_run.sh [quick]
set -o pipefail
source bench/gpu_env.sh
td_setup || exit 1
# 19 GEMM + 27 conv kernels of ours and fp16_rcr_essential's 5 TMA kernels, 16 nvcc jobs at a time (~4 min)
td_build fp16_rcr_essential,bench/sets/coverage_gpu.yaml sm90a 330 coverage || td_partial_bundle sm90a coverage
cp /tmp/build_coverage.log "$OUT/build.log" 2>/dev/null
python3 bench/benchmarks/coverage.py --bundle "$TD_BUILD/coverage" --show 20 > "$OUT/coverage_bundle.txt" 2>&1
tail -3 "$OUT/coverage_bundle.txt"
python3 bench/benchmarks/coverage_gpu.py "$TD_BUILD/coverage" --json "$OUT/coverage_gpu.json" ${1:+--quick} \
  > "$OUT/coverage_gpu.log" 2>&1
echo "coverage_gpu rc $?"
grep -v "^validate .*: \([0-9]*\)/\1 passed" "$OUT/coverage_gpu.log" | tail -n 60
