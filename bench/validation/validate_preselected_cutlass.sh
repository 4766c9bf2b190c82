#!/bin/bash
# GPU validation of every preselected cutlass kernel (235: the sm90a and sm80 GEMM sets, the conv sets), in three
# bundles, resumable across calls on a lent GPU machine:
#   bash bench/validation/validate_preselected_cutlass.sh build [SECONDS]   # build, or go on building, the bundles
#   bash bench/validation/validate_preselected_cutlass.sh validate          # validate all three; exit 1 on any failure
# Builds and the kernel cache live in build/gpu and .cache/tdscons of the checkout (ignored paths, kept between
# calls on a warm machine): a build that runs out of time goes on from the cache at the next `build` (exit 3 until
# all three bundles are complete). validate writes its JSON to $OUT (or /tmp).
set -u
cd "$(dirname "$0")/../.." || exit 2
source bench/gpu_env.sh
TD_CACHE=$PWD/.cache/tdscons
TD_BUILD=$PWD/build/gpu
GEMM90=fp16_rcr_essential,bf16_rcr_essential,fp32_rcr_essential,int8_rcr_essential,fp16_all_layouts,fp16_rcr_fused,fp16_rcr_full,fp8_rcr_essential
GEMM80=fp16_rcr_essential,bf16_rcr_essential,fp32_rcr_essential,int8_rcr_essential,fp16_all_layouts,fp16_rcr_fused
CONV90=conv_fp16_all_essential,conv_fp16_fwd_essential,conv_fp16_bwd_essential

td_setup > /dev/null || { echo "td_setup failed"; exit 2; }
case "${1:-}" in
  build)
    deadline=$((SECONDS + ${2:-540}))
    for spec in "gemm90 sm90a $GEMM90" "gemm80 sm80 $GEMM80" "conv90 sm90a $CONV90"; do
      set -- $spec
      left=$((deadline - SECONDS))
      if [ "$left" -lt 20 ]; then echo "out of time before bundle $1: run build again"; exit 3; fi
      td_build "$3" "$2" "$left" "$1" || { echo "bundle $1 is not complete: run build again"; exit 3; }
    done
    echo "all three bundles are built"
    ;;
  validate)
    out=${OUT:-/tmp}
    python3 bench/validation/validate_gpu.py "$TD_BUILD/gemm90" "$TD_BUILD/gemm80" --json "$out/validate_gemm.json"; gemm=$?
    python3 bench/validation/validate_conv_gpu.py "$TD_BUILD/conv90" --json "$out/validate_conv.json"; conv=$?
    echo "validate_gpu exit $gemm, validate_conv_gpu exit $conv"
    [ "$gemm" -eq 0 ] && [ "$conv" -eq 0 ]
    ;;
  *)
    echo "usage: $0 build [SECONDS] | validate"; exit 2
    ;;
esac
