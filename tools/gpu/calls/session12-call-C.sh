#!/bin/bash
# session 12, call C: v4 over BF16 experts (moe_mma_v4_bf16). test-moe-cuda whole (the new mma_v4_bf16_prefill with
# the v1 / CPU comparisons and controls), memcheck + racecheck on it, test-prefill-cuda, test-runtime-cuda,
# compare-backends at 70 and 300 tokens (300: prefill-sized steps, where v4 runs); prefill of both presets with the
# switch on (default) and off in the same binary; one decode round (no decode code changed).
set -u
source tools/gpu/calls/common.sh
( run test-moe-cuda 500 "" ) &
( san memcheck test-moe-cuda 'cuda_moe.mma_v4_bf16_prefill' 400; san racecheck test-moe-cuda 'cuda_moe.mma_v4_bf16_prefill' 400 ) &
( run test-prefill-cuda 300 ""; run test-runtime-cuda 300 "" ) &
wait
compare_models
IDS=$(python3 -c 'print(",".join(str((i*37+11)%250) for i in range(300)))')
for m in tests/golden/kimi_linear/*/ /tmp/pg-models/*/ models/default models/k31-default; do
  timeout 120 $B/perigee compare-backends --model "$m" --ids "$IDS" --decode 4 >> $L/compare300.log 2>&1; rc=$?
  echo "[$(( $(date +%s) - T0 ))s] compare $m (300 ids) rc=$rc: $(grep -E '^compare-backends: (PASS|FAIL)|^error' $L/compare300.log | tail -1)" >> $S
done
prefill kimi-linear-48b 512,1024 on
prefill kimi-linear-48b 512,1024 off --set moe_mma_v4_bf16=0
prefill k3-layers-4 512,2048 on
D="timeout 150 $B/bench-cuda-decode --steps 30 --no-compare --no-profile"
decode_rounds 1
cp $L/compare.log $L/compare300.log $OUT/ 2>/dev/null
nvidia-smi --query-gpu=name,driver_version --format=csv >> $S 2>&1
tar czf $OUT/logsC.tgz -C $OUT logs && rm -rf $L
cat $S
