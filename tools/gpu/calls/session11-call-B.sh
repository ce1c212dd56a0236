#!/bin/bash
# session 11, call B: the final tree (call A's two levers removed; the refactors kept: mla_q_rows, the BF16 gate/up row
# helper, run_fused's plain-group arrays, test-ops-cuda's same_bits). Every CUDA test binary, compare-backends on the 9
# models, racecheck on the BF16 pair's shared slot and memcheck on the MLA decode; then batches 1/8/64 of both presets
# twice, a probe of GEMV v3 on the 48B's 4096-wide rows (o_proj; measured slower in session 4, before evict_first and
# the early loads), the default timeline, and prefill.
set -u
source tools/gpu/calls/common.sh
( run test-ops-cuda 400 ""; run test-moe-cuda 400 ""; run test-route-cuda 150 ""; run test-kda-decode-cuda 100 ""; run test-pdl-cuda 100 "" ) &
( run test-fuse-cuda 300 ""; run test-mla-cuda 200 ""; run test-prefill-cuda 300 ""; run test-sample-cuda 100 ""; run test-kda-cuda 200 "" ) &
( sleep 20; san racecheck test-moe-cuda 'cuda_moe.decode_bf16_shared_direct' 300; san memcheck test-mla-cuda '*' 300 ) &
wait
run test-runtime-cuda 300 ""
compare_models
D="timeout 150 $B/bench-cuda-decode --steps 30 --no-compare --no-profile"
for round in 1 2; do
  $D --batch 1,8,64 > $L/dec-$round.log 2>&1
  echo "[$(( $(date +%s) - T0 ))s] r$round defaults rc=$? | $(grep -E '^(k3-layers-4|kimi-linear-48b) +new' $L/dec-$round.log | awk '{print $1, $3, $5, $6, $9}' | tr '\n' ' ')" >> $S
done
D="timeout 150 $B/bench-cuda-decode --steps 30 --no-compare --no-profile --batch 1"
for r in 1 2; do
  b kimi-linear-48b base$r ""
  b kimi-linear-48b v3o$r "gemv_v3_max_in=4096"
done
$D --timeline 10 > $OUT/timeline-default.log 2>&1
echo "[$(( $(date +%s) - T0 ))s] timeline rc=$? | $(grep -E '^kernel timeline' $OUT/timeline-default.log | sed 's/, gap to.*untraced graph step/ untraced/' | tr '\n' ' ')" >> $S
timeout 200 $B/bench-cuda-decode --preset k3-layers-4 --prefill 512,2048 > $L/prefill.log 2>&1
echo "[$(( $(date +%s) - T0 ))s] prefill rc=$? | $(grep -E 'default +T|GEMM share' $L/prefill.log | tr '\n' ' ')" >> $S
cp $L/compare.log $OUT/ 2>/dev/null
nvidia-smi --query-gpu=name,driver_version --format=csv >> $S 2>&1
tar czf $OUT/logsB.tgz -C $OUT logs && rm -rf $L
cat $S
