#!/bin/bash
# session 11, call C (binaries of call B, no new code): a re-check of the existing switches at batch 1 after sessions
# 8-10 changed the kernels around them (evict_first, early loads, the shared slot), two rounds, each beside the defaults.
set -u
source tools/gpu/calls/common.sh
D="timeout 150 $B/bench-cuda-decode --steps 30 --no-compare --no-profile --batch 1"
for r in 1 2; do
  b kimi-linear-48b base$r ""
  b kimi-linear-48b u8$r "gemv_unroll=8"
  b kimi-linear-48b u2$r "gemv_unroll=2"
  b kimi-linear-48b early0$r "moe_bf16_early=0"
  b kimi-linear-48b early2$r "moe_bf16_early=2"
  b kimi-linear-48b rv2off$r "moe_route_gemv_v2=0"
  b kimi-linear-48b rfused$r "moe_route_fused_radix=1"
  b kimi-linear-48b shpf$r "moe_shared_prefetch=1"
  b kimi-linear-48b v3min$r "gemv_v3_min_in=1024"
  b k3-layers-4 base$r ""
  b k3-layers-4 u8$r "gemv_unroll=8"
  b k3-layers-4 u2$r "gemv_unroll=2"
  b k3-layers-4 f220$r "moe_decode_v7_form=220"
  b k3-layers-4 rfused$r "moe_route_fused_radix=1"
done
nvidia-smi --query-gpu=name,driver_version --format=csv >> $S 2>&1
tar czf $OUT/logsC.tgz -C $OUT logs && rm -rf $L
cat $S
