#!/bin/bash
# session 11, call A: the new forms, all off by default in this binary, with their tests first: the register warp
# selection (moe_select_small: test-route-cuda bit for bit the block selection, refusals, [timing]); the MXFP4 v7 weight
# copies with evict_first (moe_mxfp4_evict_first: test-moe-cuda decode_v7_forms_k3 bit for bit v6); the refactors that
# change machine code (mla.cu mla_q_rows: test-mla-cuda; the BF16 pair's gate/up row helper: test-moe-cuda,
# test-fuse-cuda moe_shared_slot); test-ops-cuda's same_bits helper. Then the 48B / k3 B=1 steps, two rounds, each lever
# off and on in the same binary, and the 48B timeline with the small selection.
set -u
source tools/gpu/calls/common.sh
( run test-route-cuda 200 ""; run test-mla-cuda 200 ""; run test-ops-cuda 400 "" --gtest_filter='cuda_ops.linear_gemv_kernels_all_variants' ) &
( run test-moe-cuda 400 ""; run test-fuse-cuda 300 "" --gtest_filter='cuda_fuse.moe_shared_slot*' ) &
( sleep 10; san memcheck test-route-cuda 'route_select.fast_equals_block:route_select.small_refuses_other_shapes' 300;
  san racecheck test-route-cuda 'route_select.controls_fail' 200 ) &
wait
grep -E '^\[route_select\]|^\[timing\] 48B route T=1' $L/test-route-cuda.log >> $S
grep -E '^\[gemv\]' $L/test-ops-cuda.log >> $S
grep -E 'moe-v7/K3' $L/test-moe-cuda.log >> $S
D="timeout 150 $B/bench-cuda-decode --steps 30 --no-compare --no-profile --batch 1"
for r in 1 2; do
  b kimi-linear-48b base$r ""
  b kimi-linear-48b small$r "moe_select_small=1"
  b kimi-linear-48b warp$r "moe_select_radix=0,moe_select_sort=0,moe_select_warp=1"
  b k3-layers-4 base$r ""
  b k3-layers-4 ef$r "moe_mxfp4_evict_first=1"
done
$D --preset kimi-linear-48b --timeline 10 --set moe_select_small=1 > $OUT/timeline-48b-small.log 2>&1
echo "[$(( $(date +%s) - T0 ))s] timeline rc=$? | $(grep -E '^kernel timeline' $OUT/timeline-48b-small.log | sed 's/, gap to.*untraced graph step/ untraced/' | tr '\n' ' ')" >> $S
nvidia-smi --query-gpu=name,driver_version --format=csv >> $S 2>&1
tar czf $OUT/logsA.tgz -C $OUT logs && rm -rf $L
cat $S
