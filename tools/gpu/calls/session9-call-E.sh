#!/bin/bash
# session 9, call E: the BF16 pair's h / act loads by __ldcg (call D: cfg 200 read a stale shared act): the pair's tests
# repeated 20 times (every early form bitwise the run without), racecheck; then the step with moe_bf16_early 0 / 1 / 2,
# moe_shared_prefetch off under early 1, and the selection forms at the 48B geometry (sort, warp), two rounds.
set -u
source tools/gpu/calls/common.sh   # unpack, paths, run()
san() { local tool=$1 t=$2 f=$3 to=$4; local s=$(date +%s); timeout $to /usr/local/cuda/bin/compute-sanitizer --tool $tool --error-exitcode 9 $B/$t --gtest_filter="$f" > $L/$tool-$t.log 2>&1
  echo "[$(( $(date +%s) - T0 ))s] $tool $t ($f) rc=$? $(( $(date +%s) - s ))s $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' $L/$tool-$t.log | tail -1)" >> $S; }
( run test-moe-cuda 300 "-bf16x20" --gtest_filter='cuda_moe.decode_bf16_direct:cuda_moe.decode_bf16_shared_direct:cuda_moe.decode_bf16_t1' --gtest_repeat=20 ) &
( sleep 3; san memcheck test-moe-cuda 'cuda_moe.decode_bf16_shared_direct' 200 ) &
( run test-runtime-cuda 240 "" ) &
wait
echo "early lines: $(grep -cE 'early(100|200)\] bitwise the run without it: PASS' $L/test-moe-cuda-bf16x20.log) PASS, $(grep -cE 'early(100|200)\] DIFFERS' $L/test-moe-cuda-bf16x20.log) DIFFERS" >> $S
D="timeout 150 $B/bench-cuda-decode --steps 30 --no-compare --no-profile --batch 1 --preset kimi-linear-48b"
for round in 1 2; do for v in moe_bf16_early=1 moe_bf16_early=0 moe_bf16_early=2 moe_bf16_early=1,moe_shared_prefetch=0 moe_select_radix=0 moe_select_radix=0,moe_select_sort=0,moe_select_warp=1; do
  $D --set $v > $L/dec-$round-$v.log 2>&1
  echo "[$(( $(date +%s) - T0 ))s] r$round $v rc=$? | $(grep -E '^kimi-linear-48b +new' $L/dec-$round-$v.log | awk '{print $1, $5, $6}' | tr '\n' ' ')" >> $S
done; done
nvidia-smi --query-gpu=name,driver_version --format=csv >> $S 2>&1
tar czf $OUT/logsE.tgz -C $OUT logs && rm -rf $L
cat $S
