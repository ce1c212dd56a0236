#!/bin/bash
# session 16, call G (measurement only; bench-cuda-decode of bbd4dc1 + the --set name gemv_max_tokens, which call B lacked): with the stacked split-bf16 LINEAR, call C/F's k3
# B=16 (7.34 ms) is barely slower than B=8 (7.22 ms, GEMV path). Does cuBLASLt (stacked) now beat the T <= 8 GEMV
# kernels? gemv_max_tokens 8 (default) vs 2 at B = 8, both presets; one round each.
set -u
source tools/gpu/calls/common.sh
D="timeout 200 $B/bench-cuda-decode --steps 20 --no-compare --no-profile"
for p in k3-layers-4 kimi-linear-48b; do
  for v in 8 2; do
    $D --preset $p --batch 8 --set gemv_max_tokens=$v > $L/d-$p-$v.log 2>&1; rc=$?
    echo "[$(( $(date +%s) - T0 ))s] $p gemv_max_tokens=$v rc=$rc | $(grep -E "^$p +new" $L/d-$p-$v.log | awk '{print $3, $5, $6, $9}' | tr '\n' ' ')" >> $S
  done
done
cp $L/*.log $OUT/ 2>/dev/null; rm -rf $L
cat $S
