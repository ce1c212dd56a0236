#!/bin/bash
# session 7, call B: tensor-core prefill experts v4 (cuda_options::moe_mma_v4, off: wgmma with A from registers):
# parity (v4 vs v3 and the CPU at the f32 tolerance, the launch counters, controls), compute-sanitizer over the small
# shapes, k3-layers-4 prefill T 512 / 2048 with v3 and v4 (same binary, per-op profile), Nsight Compute of one layer's
# v4 expert kernels at T 2048.
set -u
source tools/gpu/calls/common.sh   # unpack, paths, run()
CS=/usr/local/cuda/bin/compute-sanitizer
run test-moe-cuda 300 "-mma" --gtest_filter='cuda_moe.mma_*'
( MOE_V4_SMALL=1 timeout 300 $CS --tool memcheck --error-exitcode 9 $B/test-moe-cuda --gtest_filter='cuda_moe.mma_v4_prefill' > $L/memcheck-v4.log 2>&1; echo "[$(( $(date +%s) - T0 ))s] memcheck v4 rc=$? $(grep -E 'ERROR SUMMARY' $L/memcheck-v4.log | tail -1)" >> $S ) &
( MOE_V4_SMALL=1 timeout 300 $CS --tool racecheck --error-exitcode 9 $B/test-moe-cuda --gtest_filter='cuda_moe.mma_v4_prefill' > $L/racecheck-v4.log 2>&1; echo "[$(( $(date +%s) - T0 ))s] racecheck v4 rc=$? $(grep -E 'RACECHECK SUMMARY' $L/racecheck-v4.log | tail -1)" >> $S ) &
wait
P="timeout 150 $B/bench-cuda-decode --preset k3-layers-4 --prefill 512,2048"
$P --set moe_mma_v3=1 > $L/prefill-v3.log 2>&1; echo "[$(( $(date +%s) - T0 ))s] prefill v3 rc=$?" >> $S
$P --set moe_mma_v4=1 > $L/prefill-v4.log 2>&1; echo "[$(( $(date +%s) - T0 ))s] prefill v4 rc=$?" >> $S
timeout 150 /usr/local/cuda/bin/ncu --clock-control none --kernel-name regex:'k_moe_mma4' --launch-count 2 \
  --section SpeedOfLight --section Occupancy --section SchedulerStats --section WarpStateStats --section ComputeWorkloadAnalysis \
  --metrics sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_tensor_op_gmma.avg.pct_of_peak_sustained_active,sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active \
  $B/bench-cuda-decode --preset k3-layers-4 --prefill 2048 --no-profile --set moe_mma_v4=1 > $L/ncu-v4.txt 2>&1; echo "[$(( $(date +%s) - T0 ))s] ncu v4 rc=$?" >> $S
grep -E "mma-v4.*(launches|v4-vs-v3|bitwise|control|SKIPPED|experts\])|NOT caught|FAIL" $L/test-moe-cuda-mma.log | head -60 >> $S
for f in $L/prefill-*.log; do echo "== $(basename $f)"; grep -E "^prefill|GEMM share|MOE_EXPERTS|FAILED|rror" $f; done >> $S
grep -E "k_moe_mma4|Duration|Issue Slots Busy|No Eligible|Warp Cycles Per Issued|pipe_tensor|gmma|Achieved Occupancy|highest-utilized" $L/ncu-v4.txt >> $S
cp $L/ncu-v4.txt $OUT/ 2>/dev/null
tar czf $OUT/logsB.tgz -C $OUT logs && rm -rf $L
cat $S
