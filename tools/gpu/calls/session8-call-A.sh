#!/bin/bash
# (gemv_prefetch_mib, tried here, was removed after this call: see bench/session8-h200-2026-11-30-callA.log)
# session 8, call A: weights asked into L2 before the PDL wait (cuda_options::gemv_prefetch_mib for the GEMV v2 / v3
# launches, moe_shared_prefetch for the 48B shared expert): the tests (bitwise the runs without), then decode B=1 on both
# presets with each switch (same binary, two rounds interleaved), the unrun session-7 mma_v4_prefill assertion, and an
# Nsight Compute kernel list of one eager 48B step (--layers 4) for the per-kernel picture.
set -u
source tools/gpu/calls/common.sh   # unpack, paths, run()
( run test-ops-cuda 300 "-gemv" --gtest_filter='cuda_ops.linear_gemv_kernels_all_variants' ) &
( run test-moe-cuda 300 "-sh" --gtest_filter='cuda_moe.decode_bf16_shared_direct:cuda_moe.mma_v4_prefill:cuda_moe.small_v4_batch' ) &
wait
grep -E "prefetch|NOT bitwise" $L/test-ops-cuda-gemv.log | grep -v "^\[gemv/.*/prefetch" | tail -5 >> $S
grep -E "prefetch|v4.*launch|FAIL" $L/test-moe-cuda-sh.log | grep -v "must FAIL" | head -12 >> $S
D="timeout 100 $B/bench-cuda-decode --batch 1 --steps 30 --no-compare --no-profile"
for round in 1 2; do
  for cfg in "gemv_prefetch_mib=0" "gemv_prefetch_mib=8" "gemv_prefetch_mib=24" "gemv_prefetch_mib=64" "moe_shared_prefetch=1" "gemv_prefetch_mib=24,moe_shared_prefetch=1"; do
    $D --set $cfg > $L/dec-$cfg-$round.log 2>&1
    echo "[$(( $(date +%s) - T0 ))s] $cfg r$round rc=$? | $(grep -E '^(k3-layers-4|kimi-linear-48b) +new' $L/dec-$cfg-$round.log | awk '{print $1, $5, $8}' | tr '\n' ' ')" >> $S
  done
done
nvidia-smi --query-gpu=name,driver_version --format=csv > $L/gpu.txt 2>&1
timeout 200 /usr/local/cuda/bin/ncu --clock-control none --metrics gpu__time_duration.sum,launch__grid_size,launch__block_size,dram__bytes.sum \
  --kernel-name regex:'^k_(?!fill)' --launch-skip 0 --launch-count 200 \
  $B/bench-cuda-decode --preset kimi-linear-48b --layers 4 --batch 1 --steps 1 --no-compare --no-profile > $L/ncu-48b-step.txt 2>&1
echo "[$(( $(date +%s) - T0 ))s] ncu 48b step rc=$?" >> $S
cp $L/ncu-48b-step.txt $OUT/ 2>/dev/null
cat $L/gpu.txt >> $S
tar czf $OUT/logsA.tgz -C $OUT logs && rm -rf $L
cat $S
