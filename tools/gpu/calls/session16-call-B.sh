#!/bin/bash
# session 16, call B: where a decode batch step goes now (no code change; binaries of call A). Per-op profile of the
# shipped defaults at B = 8 / 16 / 64 on both presets, then the zero-code levers the profile may point at:
# linear_split_bf16=0 at B=16/64 (the cuBLASLt decode LINEARs as one bf16 GEMM instead of hi + lo: how much of the step
# the second pass costs; a precision change, measured only) and gemv_max_tokens=16 at B=16 (the GEMV form past 8 tokens).
set -u
source tools/gpu/calls/common.sh
D="timeout 200 $B/bench-cuda-decode --steps 20 --no-compare"
for p in k3-layers-4 kimi-linear-48b; do
  $D --preset $p --batch 8,16,64 > $OUT/prof-$p.log 2>&1; rc=$?
  echo "[$(( $(date +%s) - T0 ))s] $p profile rc=$rc | $(grep -E "^$p +new" $OUT/prof-$p.log | awk '{print $1, $3, $5, $6, $9}' | tr '\n' ' ')" >> $S
done
D="timeout 200 $B/bench-cuda-decode --steps 20 --no-compare --no-profile"
for p in k3-layers-4 kimi-linear-48b; do
  $D --preset $p --batch 16,64 --set linear_split_bf16=0 > $L/nosplit-$p.log 2>&1; rc=$?
  echo "[$(( $(date +%s) - T0 ))s] $p linear_split_bf16=0 rc=$rc | $(grep -E "^$p +new" $L/nosplit-$p.log | awk '{print $1, $3, $5, $6, $9}' | tr '\n' ' ')" >> $S
  $D --preset $p --batch 16 --set gemv_max_tokens=16 > $L/gemv16-$p.log 2>&1; rc=$?
  echo "[$(( $(date +%s) - T0 ))s] $p gemv_max_tokens=16 rc=$rc | $(grep -E "^$p +new|rror" $L/gemv16-$p.log | awk '{print $1, $3, $5, $6, $9}' | tr '\n' ' ')" >> $S
done
nvidia-smi --query-gpu=name,driver_version --format=csv >> $S 2>&1
tar czf $OUT/logsB.tgz -C $OUT logs && rm -rf $L
cat $S
