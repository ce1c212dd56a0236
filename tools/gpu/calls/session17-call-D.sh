#!/bin/bash
# session 17, call D (measurement only, binaries of a5e9fdb): where the tensor-core GEMV's time goes. CUPTI kernel
# timeline (bench-cuda-decode --timeline 3) of k3-layers-4 and the 48B at B = 8 with every 3-8-token LINEAR on the GEMV
# path (gemv_max_elems=0): the FP32 kernels (gemv_mma_min_tokens=0) vs the tensor-core kernel (=3), for the next attempt.
set -u
source tools/gpu/calls/common.sh
D="timeout 100 $B/bench-cuda-decode --steps 10 --no-compare --no-profile"
for p in k3-layers-4 kimi-linear-48b; do
  for v in "fp32:gemv_max_elems=0,gemv_mma_min_tokens=0" "mma:gemv_max_elems=0,gemv_mma_min_tokens=3"; do
    tag=${v%%:*}; sets=${v#*:}
    $D --preset $p --batch 8 --timeline 3 --set $sets > $OUT/tl-$p-$tag.log 2>&1; rc=$?
    echo "[$(( $(date +%s) - T0 ))s] $p $tag rc=$rc | $(grep -E "^$p +new" $OUT/tl-$p-$tag.log | awk '{print $3, $5, $9}' | tr '\n' ' ')" >> $S
  done
done
rm -rf $L
cat $S
