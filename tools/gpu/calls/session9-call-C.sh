#!/bin/bash
# session 9, call C: three levers from the call-A timeline, each off by default, each bit for bit or f32-tolerance
# checked first: gemv_v2_early (v2 one-token GEMVs' first weight loads before the PDL wait), moe_bf16_early (the BF16
# expert pair's down loads / shared slot before the wait), mla_attn_v4 (MLA decode attention, 8 warps, dims split).
# Tests, memcheck / racecheck on the changed kernels, then the timeline per lever and untraced A/B rounds.
set -u
source tools/gpu/calls/common.sh   # unpack, paths, run()
san() { local tool=$1 t=$2 f=$3 to=$4; local s=$(date +%s); timeout $to /usr/local/cuda/bin/compute-sanitizer --tool $tool --error-exitcode 9 $B/$t --gtest_filter="$f" > $L/$tool-$t.log 2>&1
  echo "[$(( $(date +%s) - T0 ))s] $tool $t ($f) rc=$? $(( $(date +%s) - s ))s $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' $L/$tool-$t.log | tail -1)" >> $S; }
( run test-ops-cuda 200 "-gemv" --gtest_filter='cuda_ops.linear_gemv_kernels_all_variants'
  run test-moe-cuda 200 "-bf16" --gtest_filter='cuda_moe.decode_bf16*' ) &
( run test-mla-cuda 200 "" ) &
( sleep 5; san memcheck test-moe-cuda 'cuda_moe.decode_bf16_shared_direct' 200; san racecheck test-mla-cuda "${MLA_SAN_FILTER:-cuda_mla.decode_causal*}" 200 ) &
wait
grep -hE "early loads: bit|early\] |early/invalid" $L/test-ops-cuda-gemv.log $L/test-moe-cuda-bf16.log | head -12 >> $S
grep -hE "v4" $L/test-mla-cuda.log | grep -iE "fail|worst|differ|control" | head -12 >> $S
D="timeout 150 $B/bench-cuda-decode --steps 30 --no-compare --no-profile --batch 1"
for v in "gemv_v2_early=0" "gemv_v2_early=1" "moe_bf16_early=1" "mla_attn_v4=1" "gemv_v2_early=1,moe_bf16_early=1,mla_attn_v4=1"; do
  $D --timeline 6 --set $v > $L/tl-$v.log 2>&1
  echo "[$(( $(date +%s) - T0 ))s] timeline $v rc=$? | $(grep -E '^(k3-layers-4|kimi-linear-48b) +new|^kernel timeline' $L/tl-$v.log | sed 's/6 replays.*span (first start .. last end) median/span/; s/, gap to.*untraced graph step/ untraced/' | tr '\n' ' ')" >> $S
done
for round in 1 2; do for v in "gemv_v2_early=0" "gemv_v2_early=1,moe_bf16_early=1,mla_attn_v4=1"; do
  $D --set $v > $L/dec-$round-$v.log 2>&1
  echo "[$(( $(date +%s) - T0 ))s] r$round $v rc=$? | $(grep -E '^(k3-layers-4|kimi-linear-48b) +new' $L/dec-$round-$v.log | awk '{print $1, $5, $8}' | tr '\n' ' ')" >> $S
done; done
for f in $L/tl-*.log; do echo "=== $f"; cat $f; done > $OUT/timelines.log
nvidia-smi --query-gpu=name,driver_version --format=csv >> $S 2>&1
tar czf $OUT/logsC.tgz -C $OUT logs && rm -rf $L
cat $S
