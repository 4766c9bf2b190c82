#!/usr/bin/env bash
# From bundles to shipped models in one command: sweep GEMM and every conv direction, then train.
#
#   bash bench/sweeps/sweep_and_train.sh GEMM_BUNDLE CONV_BUNDLE [EXTRA SWEEP OPTIONS...]
#   e.g. bash bench/sweeps/sweep_and_train.sh build/fp16_rcr_full build/conv_sweep --random 900 --budget-s 500
#
# CONV_BUNDLE: the conv set's kernels with identity epilogues, so that every tile runs on the suites' plain problems
# (python bench/sweeps/identity_set.py conv_fp16_all_essential -o build/conv_sweep.yaml, then
# scons kernels=build/conv_sweep.yaml backend=cutlass arch=sm90a bundle=conv_sweep).
#
# Each sweep appends to its store under bench/results/sweeps/ and skips the pairs stored for the same kernel binary,
# so the command can be rerun after a time limit cut it short (--budget-s stops collecting after that long), and
# after a kernel changed it retimes that kernel on every problem the store holds; training reads every store
# and writes runtime/tiledispatch/models/<backend>_<arch>_<task>.json with its .md card (which scores the model
# it replaces on the same problems). Suites: bench/suites/
# gemm.json (+ pointwise_gemms.json, the conv suite's 1x1 layers as GEMMs) and conv.json where they exist. Local
# Dask cluster over the visible GPUs; pass --scheduler ADDR for a
# running cluster.
set -euo pipefail
cd "$(dirname "$0")/../.."
GEMM_BUNDLE=$1
CONV_BUNDLE=$2
shift 2
suite() { [ -f "bench/suites/$1.json" ] && echo "--suite bench/suites/$1.json" || true; }
python3 bench/sweeps/sweep.py "$GEMM_BUNDLE" gemm $(suite gemm) $(suite pointwise_gemms) "$@"
for direction in fwd bwd_data bwd_weight; do
  python3 bench/sweeps/sweep.py "$CONV_BUNDLE" conv --direction "$direction" $(suite conv) "$@"
done
# each new model's card also scores the model it replaces on the same problems (train.py --against)
replaced=$(mktemp -d)
trap 'rm -rf "$replaced"' EXIT
against=()
for model in runtime/tiledispatch/models/*.json; do
  [ -f "$model" ] && cp "$model" "$replaced/" && against+=(--against "$replaced/$(basename "$model")")
done
python3 bench/sweeps/train.py bench/results/sweeps/*.jsonl.gz "${against[@]}"
