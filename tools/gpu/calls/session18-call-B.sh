#!/bin/bash
# session 18, call B: the small selection as the MOE_ROUTE selection launch (cuda_options::moe_select_small, 4 warps by
# default in this tree; route-small.cuh), after call A's in-the-experts form was measured slower and removed. Predicted
# before this run: the 48B selection launch ~4.5 -> ~3 us exposed per MoE layer, step 2.29 -> ~2.25 ms; k3 unchanged
# (E 896, top-16: outside the small form's domain). test-route-cuda first (small_equals_radix, the timing lines with
# small4 / small8), then 48B B=1 with moe_select_small 4 / 8 / 0 (same binary, two rounds), a kernel timeline at the
# default, then every CUDA test binary, compare-backends, serve smoke, decode rounds.
set -u
source tools/gpu/calls/common.sh
run test-route-cuda 200 ""
grep -E "^\[timing\]|small" $L/test-route-cuda.log > $OUT/route-timing.txt
D="timeout 100 $B/bench-cuda-decode --steps 30 --no-compare --no-profile --batch 1"
for round in 1 2; do
  b kimi-linear-48b small4-r$round moe_select_small=4
  b kimi-linear-48b small8-r$round moe_select_small=8
  b kimi-linear-48b off-r$round moe_select_small=0
done
$D --preset kimi-linear-48b --timeline 10 > $OUT/tl-48b-small4.log 2>&1; rc=$?
echo "[$(( $(date +%s) - T0 ))s] timeline 48B rc=$rc | $(grep -E "^kimi-linear-48b +new" $OUT/tl-48b-small4.log | awk '{print $3, $5, $9}' | tr '\n' ' ')" >> $S
full_suite
D="timeout 200 $B/bench-cuda-decode --steps 20 --no-compare --no-profile"
decode_rounds 2
nvidia-smi --query-gpu=name,driver_version --format=csv >> $S 2>&1
cp $L/compare.log $OUT/ 2>/dev/null
tar czf $OUT/logsB.tgz -C $OUT logs && rm -rf $L
rm -rf $OUT/smoke
cat $S
