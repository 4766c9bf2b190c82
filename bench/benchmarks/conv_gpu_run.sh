#!/bin/bash
# One call on the GPU machine (from the repository root, with .whl carried): build the cutlass conv bundles,
# validate every kernel against the float64 reference, then benchmark against cuDNN (twice, merged). Logs and JSON/PNG go
# to $OUT; the last lines printed are the validation summary and the benchmark table.
#   bash bench/benchmarks/conv_gpu_run.sh [quick]
set -o pipefail
source bench/gpu_env.sh
td_setup || exit 1
td_build conv_fp16_all_essential sm90a 300 conv_fp16  # 24 CUTLASS SM90 convs: ~1 min each, 16 at a time
td_build bench/sets/conv_cutlass_bf16.yaml sm90a 150 conv_bf16
td_build bench/sets/conv_cutlass_explore.yaml sm90a 150 conv_explore
cat /tmp/build_conv_*.log > "$OUT/build.log" 2>/dev/null
python3 bench/validation/validate_conv_gpu.py "$TD_BUILD/conv_fp16" "$TD_BUILD/conv_bf16" "$TD_BUILD/conv_explore" \
  --json "$OUT/conv_validate.json" > "$OUT/validate.log" 2>&1
echo "validate rc $?"
grep -E "FAIL|Traceback|Error" "$OUT/validate.log" | head -40
tail -3 "$OUT/validate.log"
# the suite twice, in separate processes (cudnn.benchmark re-picks cuDNN's algorithms in each; ours barely
# move), then the merged table: per row the fastest cuDNN and the fastest of ours (bench/reports/conv_report.py)
for run in a b; do
  python3 bench/benchmarks/conv.py "$TD_BUILD/conv_fp16" "$TD_BUILD/conv_explore" --out "$OUT/conv_h100_$run" ${1:+--quick} 2>&1 \
    | tee "$OUT/bench_$run.log"
done
python3 bench/reports/conv_report.py "$OUT/conv_h100_a.json" "$OUT/conv_h100_b.json" | tee "$OUT/conv_h100_merged.md" | tail -9
