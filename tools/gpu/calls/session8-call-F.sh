#!/bin/bash
# NOT in the tree: the switch and its code were dropped after this call (no gain); kept as the record of the measurement.
# session 8, call F: o_proj's weights asked into L2 while the fused KDA tail / MLA attention runs
# (cuda_options::gemv_prefetch_after_latency_mib, off in this tree): the GEMV prefetch bitwise test, test-fuse-cuda,
# compare-backends with the switch on, then decode B=1 on both presets with 0 / 16 / 32 MiB (same binary, two rounds).
set -u
source tools/gpu/calls/common.sh   # unpack, paths, run()
( run test-ops-cuda 300 "-gemv" --gtest_filter='cuda_ops.linear_gemv_kernels_all_variants' ) &
( run test-fuse-cuda 240 "" ) &
wait
grep -hE "prefetch|NOT bitwise" $L/test-ops-cuda-gemv.log | head -5 >> $S
D="timeout 100 $B/bench-cuda-decode --steps 30 --no-compare --no-profile"
for round in 1 2; do
  for cfg in "gemv_prefetch_after_latency_mib=0" "gemv_prefetch_after_latency_mib=16" "gemv_prefetch_after_latency_mib=32"; do
    $D --batch 1 --set $cfg > $L/dec-$cfg-$round.log 2>&1
    echo "[$(( $(date +%s) - T0 ))s] $cfg r$round rc=$? | $(grep -E '^(k3-layers-4|kimi-linear-48b) +new' $L/dec-$cfg-$round.log | awk '{print $1, $5, $8}' | tr '\n' ' ')" >> $S
  done
done
nvidia-smi --query-gpu=name,driver_version --format=csv >> $S 2>&1
tar czf $OUT/logsF.tgz -C $OUT logs && rm -rf $L
cat $S
