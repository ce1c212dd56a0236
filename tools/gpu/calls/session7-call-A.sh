#!/bin/bash
# session 7, call A: tensor-core prefill experts v3 (cuda_options::moe_mma_v3, off): parity (v3 bitwise v2, CPU at the
# f32 tolerance, the launch counter, controls), compute-sanitizer over the small shapes, k3-layers-4 prefill T 512 / 2048
# with v3 off / on (same binary, per-op profile), Nsight Compute of one layer's v2 and v3 expert kernels at T 2048.
set -u
source tools/gpu/calls/common.sh   # unpack, paths, run()
CS=/usr/local/cuda/bin/compute-sanitizer
run test-moe-cuda 300 "-mma" --gtest_filter='cuda_moe.mma_*'
( MOE_V3_SMALL=1 timeout 300 $CS --tool memcheck --error-exitcode 9 $B/test-moe-cuda --gtest_filter='cuda_moe.mma_v3_prefill' > $L/memcheck-v3.log 2>&1; echo "[$(( $(date +%s) - T0 ))s] memcheck v3 rc=$? $(grep -E 'ERROR SUMMARY' $L/memcheck-v3.log | tail -1)" >> $S ) &
( MOE_V3_SMALL=1 timeout 300 $CS --tool racecheck --error-exitcode 9 $B/test-moe-cuda --gtest_filter='cuda_moe.mma_v3_prefill' > $L/racecheck-v3.log 2>&1; echo "[$(( $(date +%s) - T0 ))s] racecheck v3 rc=$? $(grep -E 'RACECHECK SUMMARY' $L/racecheck-v3.log | tail -1)" >> $S ) &
wait
P="timeout 150 $B/bench-cuda-decode --preset k3-layers-4 --prefill 512,2048"
$P --set moe_mma_v3=0 > $L/prefill-v2.log 2>&1; echo "[$(( $(date +%s) - T0 ))s] prefill v2 rc=$?" >> $S
$P --set moe_mma_v3=1 > $L/prefill-v3.log 2>&1; echo "[$(( $(date +%s) - T0 ))s] prefill v3 rc=$?" >> $S
for v in 0 1; do
  timeout 150 /usr/local/cuda/bin/ncu --clock-control none --kernel-name regex:'k_moe_mma' --launch-count 2 \
    --section SpeedOfLight --section Occupancy --section SchedulerStats --section WarpStateStats --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
    $B/bench-cuda-decode --preset k3-layers-4 --prefill 2048 --no-profile --set moe_mma_v3=$v > $L/ncu-v3-$v.txt 2>&1; echo "[$(( $(date +%s) - T0 ))s] ncu v3=$v rc=$?" >> $S
done
grep -E "mma-v3.*(launches|bitwise|control|SKIPPED)|NOT caught|FAIL" $L/test-moe-cuda-mma.log | head -40 >> $S
for f in $L/prefill-*.log; do echo "== $(basename $f)"; grep -E "^prefill|GEMM share|MOE_EXPERTS|FAILED|rror" $f; done >> $S
cp $L/ncu-v3-*.txt $OUT/ 2>/dev/null
tar czf $OUT/logsA.tgz -C $OUT logs && rm -rf $L
cat $S
