#!/bin/bash
# Issue #20's suites on a lent GPU machine, one call each, from the repository root with .whl carried:
#   bash bench/benchmarks/suite_gpu_run.sh build [SECONDS]     # both bundles; exit 3: not complete, call again
#   bash bench/benchmarks/suite_gpu_run.sh conv I/N [ARGS...]  # shard I (0-based) of N of the conv suite
#   bash bench/benchmarks/suite_gpu_run.sh gemm I/N [ARGS...]  # shard I of N of the GEMM suite
# Bundles and the kernel cache live in build/gpu and .cache/tdscons of the checkout (ignored paths, kept between
# calls on a warm machine). Results go to $OUT/suite_<suite> (JSONL as each point finishes, then JSON and PNG);
# ARGS go to bench/benchmarks/suite.py (e.g. --resume DIR with the JSONL of a shard that was cut off). Merge the
# shards afterwards, anywhere: python3 bench/benchmarks/suite.py report DIR [DIR ...] --out DIR.
set -u
cd "$(dirname "$0")/../.." || exit 2
source bench/gpu_env.sh
TD_CACHE=$PWD/.cache/tdscons
TD_BUILD=$PWD/build/gpu
# conv: the essential conv set, and GEMM kernels in every layout for the pointwise layers the runtime lowers to GEMMs
CONV_SETS=conv_fp16_all_essential,fp16_all_layouts
# GEMM: the wide fp16 rcr pool, fp16 in every layout (the backward passes are rrr and crr), bf16
GEMM_SETS=fp16_rcr_full,fp16_all_layouts,bf16_rcr_essential

td_setup > /dev/null || { echo "td_setup failed"; exit 2; }
case "${1:-}" in
  build)
    deadline=$((SECONDS + ${2:-540}))
    for spec in "suite_conv $CONV_SETS" "suite_gemm $GEMM_SETS"; do
      set -- $spec
      left=$((deadline - SECONDS))
      if [ "$left" -lt 20 ]; then echo "out of time before bundle $1: run build again"; exit 3; fi
      td_build "$2" sm90a "$left" "$1" || { echo "bundle $1 is not complete: run build again"; exit 3; }
    done
    echo "both bundles are built"
    ;;
  conv|gemm)
    suite=$1 shard=${2:?shard I/N}
    shift 2
    python3 bench/benchmarks/suite.py "$suite" "$TD_BUILD/suite_$suite" --shard "$shard" \
      --out "${OUT:-/tmp}/suite_$suite" "$@" > "${OUT:-/tmp}/suite_${suite}_${shard/\//of}.log" 2>&1
    rc=$?
    grep -vE "^\[[0-9]+/[0-9]+ " "${OUT:-/tmp}/suite_${suite}_${shard/\//of}.log" | tail -n 60
    echo "suite.py $suite $shard: rc $rc"
    exit $rc
    ;;
  *)
    echo "usage: $0 build [SECONDS] | conv I/N [ARGS...] | gemm I/N [ARGS...]"; exit 2
    ;;
esac
