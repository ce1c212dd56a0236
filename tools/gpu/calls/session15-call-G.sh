#!/bin/bash
# session 15, call G: the 48B's BF16 pair form with sorted slots against the grouped kernels in the same binary at 16 and
# 32 tokens (call F compared them across machines), binaries of call F.
set -u
source tools/gpu/calls/common.sh
D="timeout 200 $B/bench-cuda-decode --steps 20 --no-compare --no-profile --preset kimi-linear-48b --batch 16,32"
for r in 1 2; do
  $D --set moe_decode_pairs_bf16=0 > $OUT/g$r.log 2>&1; rc=$?
  echo "[$(( $(date +%s) - T0 ))s] 48B grouped rc=$rc | $(grep -E '^kimi-linear-48b +new' $OUT/g$r.log | awk '{print $1, $3, $5, $6, $9}' | tr '\n' ' ')" >> $S
  $D --set moe_decode_pairs_bf16=32,moe_decode_pairs_sorted=1 > $OUT/p$r.log 2>&1; rc=$?
  echo "[$(( $(date +%s) - T0 ))s] 48B pairs sorted rc=$rc | $(grep -E '^kimi-linear-48b +new' $OUT/p$r.log | awk '{print $1, $3, $5, $6, $9}' | tr '\n' ' ')" >> $S
done
nvidia-smi --query-gpu=name,driver_version --format=csv >> $S 2>&1
rm -rf $L
cat $S
