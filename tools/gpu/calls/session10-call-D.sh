#!/bin/bash
# Ran on commit 341e095; moe_select_early_trigger was removed after call D (bench/RESULTS.md, session 10).
# session 10, call D: moe_bf16_evict_first on by default; gemv_evict_first (GEMV v2 / v3 weights evict_first) and
# moe_select_early_trigger (the selection's PDL trigger before its wait) off, switched on here. Tests first: every GEMV
# variant with evict_first bit for bit without; the selection forms (radix-et) bit for bit the block selection; the
# 48B-shaped MoE block (norm -> router -> selection -> BF16 pair with the shared slot) with the early trigger bit for bit
# the run without, 20 repeats. Then the 48B / k3 B=1 steps, two rounds.
set -u
source tools/gpu/calls/common.sh
run test-ops-cuda 400 "" --gtest_filter='cuda_ops.linear_gemv_kernels_all_variants'
grep -E '^\[gemv\]' $L/test-ops-cuda.log >> $S
run test-route-cuda 300 "" --gtest_filter='route_select.fast_equals_block:route_select.fast_equals_cpu_rule:route_select.controls_fail'
run test-fuse-cuda 400 "-msh" --gtest_filter='cuda_fuse.moe_shared_slot' --gtest_repeat=20
echo "early-trigger bitwise: $(grep -c 'bitwise select-early-trigger == fused\] yes' $L/test-fuse-cuda-msh.log) yes, $(grep -c 'bitwise select-early-trigger == fused\] NO' $L/test-fuse-cuda-msh.log) NO" >> $S
run test-moe-cuda 300 "" --gtest_filter='cuda_moe.decode_bf16_direct:cuda_moe.decode_bf16_shared_direct'
D="timeout 150 $B/bench-cuda-decode --steps 30 --no-compare --no-profile --batch 1"
for r in 1 2; do
  b kimi-linear-48b base$r ""
  b kimi-linear-48b noef$r "moe_bf16_evict_first=0"
  b kimi-linear-48b gef$r "gemv_evict_first=1"
  b kimi-linear-48b et$r "moe_select_early_trigger=1"
  b kimi-linear-48b gef-et$r "gemv_evict_first=1,moe_select_early_trigger=1"
done
for r in 1 2; do
  b k3-layers-4 base$r ""
  b k3-layers-4 gef$r "gemv_evict_first=1"
  b k3-layers-4 et$r "moe_select_early_trigger=1"
done
$D --preset kimi-linear-48b --timeline 20 --set gemv_evict_first=1,moe_select_early_trigger=1 > $OUT/timeline-48b-D.log 2>&1
echo "[$(( $(date +%s) - T0 ))s] timeline rc=$?" >> $S
nvidia-smi --query-gpu=name,driver_version --format=csv >> $S 2>&1
tar czf $OUT/logsD.tgz -C $OUT logs && rm -rf $L
cat $S
