#!/bin/bash
# session 10, call E: the final tree (moe_bf16_evict_first and gemv_evict_first on by default; the prefetch levers and
# the selection's early trigger removed). Every CUDA test binary, compare-backends on the 9 models, racecheck on the
# BF16 pair and memcheck on the GEMV variants (their loads now carry an L2 cache policy); then batches 1/8/64 of both
# presets twice with the evict_first switches off and on in the same binary, the default timeline, and prefill.
set -u
source tools/gpu/calls/common.sh
( run test-ops-cuda 400 ""; run test-moe-cuda 400 ""; run test-route-cuda 150 ""; run test-kda-decode-cuda 100 ""; run test-pdl-cuda 100 "" ) &
( run test-runtime-cuda 300 ""; run test-fuse-cuda 300 ""; run test-mla-cuda 200 ""; run test-prefill-cuda 300 ""; run test-sample-cuda 100 ""; run test-kda-cuda 200 "" ) &
( sleep 5; compare_models ) &
( sleep 20; san racecheck test-moe-cuda 'cuda_moe.decode_bf16_shared_direct' 300; san memcheck test-ops-cuda 'cuda_ops.linear_gemv_kernels_all_variants' 400 ) &
wait
D="timeout 150 $B/bench-cuda-decode --steps 30 --no-compare --no-profile"
for round in 1 2; do
  for sets in "" "moe_bf16_evict_first=0,gemv_evict_first=0"; do
    $D --batch 1,8,64 ${sets:+--set $sets} > $L/dec-$round-${#sets}.log 2>&1
    echo "[$(( $(date +%s) - T0 ))s] r$round ${sets:-defaults} rc=$? | $(grep -E '^(k3-layers-4|kimi-linear-48b) +new' $L/dec-$round-${#sets}.log | awk '{print $1, $3, $5, $6, $9}' | tr '\n' ' ')" >> $S
  done
done
$D --batch 1 --timeline 10 > $OUT/timeline-default.log 2>&1
echo "[$(( $(date +%s) - T0 ))s] timeline rc=$? | $(grep -E '^kernel timeline' $OUT/timeline-default.log | sed 's/, gap to.*untraced graph step/ untraced/' | tr '\n' ' ')" >> $S
timeout 200 $B/bench-cuda-decode --preset k3-layers-4 --prefill 512,2048 > $L/prefill.log 2>&1
echo "[$(( $(date +%s) - T0 ))s] prefill rc=$? | $(grep -E 'default +T|GEMM share' $L/prefill.log | tr '\n' ' ')" >> $S
cp $L/compare.log $OUT/ 2>/dev/null
nvidia-smi --query-gpu=name,driver_version --format=csv >> $S 2>&1
tar czf $OUT/logsE.tgz -C $OUT logs && rm -rf $L
cat $S
