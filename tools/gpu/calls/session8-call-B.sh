#!/bin/bash
# session 8, call B: the register-row norm (cuda_options::norm_reg, on): bitwise the loop kernel (test-ops-cuda
# norm_reg_bitwise) and the norm/fusion regressions; decode B=1 on both presets with norm_reg off / on and with the two
# prefetch switches of call A on top (same binary, two rounds); an Nsight Systems timeline of 48B graph steps (in-graph
# kernel durations and gaps) where nsys exists.
set -u
source tools/gpu/calls/common.sh   # unpack, paths, run()
( run test-ops-cuda 300 "-norm" --gtest_filter='cuda_ops.norm_reg_bitwise:cuda_ops.norms_wide_rows:cuda_ops.elementwise_norms_with_nan_inf_placement:cuda_ops.capture_replay_equals_eager' ) &
( run test-fuse-cuda 300 "" ) &
wait
grep -E "norm_reg\]|NOT bitwise" $L/test-ops-cuda-norm.log | head -8 >> $S
D="timeout 100 $B/bench-cuda-decode --batch 1 --steps 30 --no-compare --no-profile"
for round in 1 2; do
  for cfg in "norm_reg=0" "norm_reg=1" "norm_reg=1,moe_shared_prefetch=1" "norm_reg=1,moe_shared_prefetch=1,gemv_prefetch_mib=8" "norm_reg=1,moe_shared_prefetch=1,gemv_prefetch_mib=4"; do
    $D --set $cfg > $L/dec-$cfg-$round.log 2>&1
    echo "[$(( $(date +%s) - T0 ))s] $cfg r$round rc=$? | $(grep -E '^(k3-layers-4|kimi-linear-48b) +new' $L/dec-$cfg-$round.log | awk '{print $1, $5, $8}' | tr '\n' ' ')" >> $S
  done
done
NSYS=$(command -v nsys || ls /usr/local/cuda/bin/nsys /opt/nvidia/nsight-systems/*/bin/nsys 2>/dev/null | head -1)
echo "nsys: ${NSYS:-none}" >> $S
if [ -n "$NSYS" ]; then
  timeout 150 $NSYS profile --cuda-graph-trace=node --trace=cuda -o $L/tl48 -f true \
    $B/bench-cuda-decode --preset kimi-linear-48b --layers 4 --batch 1 --steps 5 --no-compare --no-profile --set norm_reg=1,moe_shared_prefetch=1 > $L/nsys-run.log 2>&1
  echo "[$(( $(date +%s) - T0 ))s] nsys rc=$?" >> $S
  timeout 100 $NSYS stats --report cuda_gpu_trace --format csv -o $L/tl48 $L/tl48.nsys-rep > $L/nsys-stats.log 2>&1
  echo "[$(( $(date +%s) - T0 ))s] nsys stats rc=$? $(ls $L/ | grep tl48 | tr '\n' ' ')" >> $S
  tail -400 $L/tl48_cuda_gpu_trace.csv > $OUT/tl48-tail.csv 2>/dev/null
fi
tar czf $OUT/logsB.tgz -C $OUT logs && rm -rf $L
cat $S
