#!/bin/bash
# session 18, call A: the route's selection inside the BF16 decode pair (cuda_options::moe_select_in_experts, on by
# default in this tree; route-small.cuh, dmoe_route). Predicted before this run (session 11's sizing, call B timeline:
# the selection launch 4.2-6.6 us exposed per MoE layer, the pair's blocks paying ~1 us of selection after their wait):
# 48B B=1 2.289 -> ~2.21 ms (~452 tok/s); k3-layers-4 unchanged (MXFP4 experts: no BF16 pair); B=8 / 64 unchanged (one
# token only). First the new tests (test-route-cuda small_*, test-moe-cuda decode_bf16_shared_select, test-fuse-cuda
# moe_shared_* with the selection-launch comparison), memcheck / racecheck on them; then 48B B=1 on vs off (same binary,
# two rounds each) and a kernel timeline with it on; then every CUDA test binary, compare-backends, serve smoke, decode
# rounds.
set -u
source tools/gpu/calls/common.sh
run test-route-cuda 200 "" 
run test-moe-cuda 300 "-sel" --gtest_filter='*shared_select*:*shared_direct*'
run test-fuse-cuda 300 "-msh" --gtest_filter='*moe_shared*'
san memcheck test-moe-cuda '*shared_select*' 300
san racecheck test-route-cuda '*small_controls_fail*' 200
san memcheck test-fuse-cuda '*moe_shared_slot*' 300
D="timeout 100 $B/bench-cuda-decode --steps 30 --no-compare --no-profile --batch 1"
for round in 1 2; do
  b kimi-linear-48b sel-on-r$round moe_select_in_experts=1
  b kimi-linear-48b sel-off-r$round moe_select_in_experts=0
done
$D --preset kimi-linear-48b --timeline 10 > $OUT/tl-48b-sel-on.log 2>&1; rc=$?
echo "[$(( $(date +%s) - T0 ))s] timeline 48B rc=$rc | $(grep -E "^kimi-linear-48b +new" $OUT/tl-48b-sel-on.log | awk '{print $3, $5, $9}' | tr '\n' ' ')" >> $S
full_suite
D="timeout 200 $B/bench-cuda-decode --steps 20 --no-compare --no-profile"
decode_rounds 2
nvidia-smi --query-gpu=name,driver_version --format=csv >> $S 2>&1
cp $L/compare.log $L/serve-smoke.log $OUT/ 2>/dev/null
grep -h -E "^\[|passed|FAIL|PASS" $L/test-route-cuda.log $L/test-moe-cuda-sel.log $L/test-fuse-cuda-msh.log 2>/dev/null | grep -E "small|select|moe_shared|passed|FAIL" | head -80 > $OUT/new-tests.txt
tar czf $OUT/logsA.tgz -C $OUT logs && rm -rf $L
cat $S
