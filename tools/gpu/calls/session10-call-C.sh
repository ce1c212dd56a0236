#!/bin/bash
# Ran on commit cf05ce5; gemv_v2_prefetch / gemv_v3_prefetch were removed after call C (bench/RESULTS.md, session 10).
# session 10, call C: prefetches issued by the streaming kernels' own blocks before their PDL wait (all off by default
# in this binary): gemv_v2_prefetch (each v2 block its first tile), gemv_v3_prefetch N (each v3 block its next N tiles),
# and moe_bf16_evict_first alone. Tests: every GEMV variant against the fp64 references with the prefetches bit for bit
# the runs without; the BF16 pair with evict_first. Then the 48B / k3 B=1 steps (two rounds) and a kernel timeline.
set -u
source tools/gpu/calls/common.sh
run test-ops-cuda 400 "" --gtest_filter='cuda_ops.linear_gemv_kernels_all_variants'
grep -E '^\[gemv\]' $L/test-ops-cuda.log >> $S
run test-moe-cuda 300 "" --gtest_filter='cuda_moe.decode_bf16_direct:cuda_moe.decode_bf16_shared_direct'
san memcheck test-ops-cuda 'cuda_ops.linear_gemv_kernels_all_variants' 500
D="timeout 150 $B/bench-cuda-decode --steps 30 --no-compare --no-profile --batch 1"
for r in 1 2; do
  b kimi-linear-48b base$r ""
  b kimi-linear-48b v2pf$r "gemv_v2_prefetch=1"
  b kimi-linear-48b v3pf1$r "gemv_v3_prefetch=1"
  b kimi-linear-48b v3pf2$r "gemv_v3_prefetch=2"
  b kimi-linear-48b v3pf4$r "gemv_v3_prefetch=4"
  b kimi-linear-48b ef$r "moe_bf16_evict_first=1"
  b kimi-linear-48b v2ef$r "gemv_v2_prefetch=1,moe_bf16_evict_first=1"
  b kimi-linear-48b all$r "gemv_v2_prefetch=1,gemv_v3_prefetch=2,moe_bf16_evict_first=1"
done
for r in 1 2; do
  b k3-layers-4 base$r ""
  b k3-layers-4 v2pf$r "gemv_v2_prefetch=1"
  b k3-layers-4 v3pf2$r "gemv_v3_prefetch=2"
  b k3-layers-4 all$r "gemv_v2_prefetch=1,gemv_v3_prefetch=2,moe_bf16_evict_first=1"
done
$D --preset kimi-linear-48b --timeline 20 --set gemv_v2_prefetch=1,gemv_v3_prefetch=2,moe_bf16_evict_first=1 > $OUT/timeline-48b-C.log 2>&1
echo "[$(( $(date +%s) - T0 ))s] timeline rc=$?" >> $S
nvidia-smi --query-gpu=name,driver_version --format=csv >> $S 2>&1
tar czf $OUT/logsC.tgz -C $OUT logs && rm -rf $L
cat $S
