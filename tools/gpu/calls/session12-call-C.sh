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
compare_models 300 4 120
prefill kimi-linear-48b 512,1024 on
prefill kimi-linear-48b 512,1024 off --set moe_mma_v4_bf16=0
prefill k3-layers-4 512,2048 on
D="timeout 150 $B/bench-cuda-decode --steps 30 --no-compare --no-profile"
decode_rounds 1
cp $L/compare.log $L/compare300.log $OUT/ 2>/dev/null
nvidia-smi --query-gpu=name,driver_version --format=csv >> $S 2>&1
tar czf $OUT/logsC.tgz -C $OUT logs && rm -rf $L
cat $S
