#!/bin/bash
# session 7, call C: v3 and v4 on by default; v4's two-fragment-set form (cuda_options::moe_mma_v4_form 1): parity (all
# of test-moe-cuda), compute-sanitizer over v4's small shapes (both forms), k3-layers-4 prefill T 512 / 2048 with form
# 0 and 1 (same binary), Nsight Compute of form 1's kernels at T 2048.
set -u
source tools/gpu/calls/common.sh   # unpack, paths, run()
CS=/usr/local/cuda/bin/compute-sanitizer
( run test-moe-cuda 400 "" ) &
( MOE_V4_SMALL=1 timeout 300 $CS --tool memcheck --error-exitcode 9 $B/test-moe-cuda --gtest_filter='cuda_moe.mma_v4_prefill' > $L/memcheck-v4.log 2>&1; echo "[$(( $(date +%s) - T0 ))s] memcheck v4 rc=$? $(grep -E 'ERROR SUMMARY' $L/memcheck-v4.log | tail -1)" >> $S
  MOE_V4_SMALL=1 timeout 300 $CS --tool racecheck --error-exitcode 9 $B/test-moe-cuda --gtest_filter='cuda_moe.mma_v4_prefill' > $L/racecheck-v4.log 2>&1; echo "[$(( $(date +%s) - T0 ))s] racecheck v4 rc=$? $(grep -E 'RACECHECK SUMMARY' $L/racecheck-v4.log | tail -1)" >> $S ) &
wait
P="timeout 150 $B/bench-cuda-decode --preset k3-layers-4 --prefill 512,2048"
$P > $L/prefill-f0.log 2>&1; echo "[$(( $(date +%s) - T0 ))s] prefill form 0 rc=$?" >> $S
$P --set moe_mma_v4_form=1 > $L/prefill-f1.log 2>&1; echo "[$(( $(date +%s) - T0 ))s] prefill form 1 rc=$?" >> $S
timeout 150 /usr/local/cuda/bin/ncu --clock-control none --kernel-name regex:'k_moe_mma4' --launch-count 2 \
  --section SpeedOfLight --section Occupancy --section SchedulerStats --section WarpStateStats --section ComputeWorkloadAnalysis \
  --metrics sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active \
  $B/bench-cuda-decode --preset k3-layers-4 --prefill 2048 --no-profile --set moe_mma_v4_form=1 > $L/ncu-v4f1.txt 2>&1; echo "[$(( $(date +%s) - T0 ))s] ncu v4 form 1 rc=$?" >> $S
grep -E "mma-v4.*form1.*(launches|v4-vs-v3|experts\])|NOT caught|FAIL" $L/test-moe-cuda.log | head -30 >> $S
for f in $L/prefill-*.log; do echo "== $(basename $f)"; grep -E "^prefill|GEMM share|MOE_EXPERTS|LINEAR|FAILED|rror" $f; done >> $S
grep -E "k_moe_mma4|Duration|Registers Per|Issue Slots Busy|No Eligible|Warp Cycles Per Issued|pipe_tensor|Achieved Occupancy|highest-utilized" $L/ncu-v4f1.txt >> $S
cp $L/ncu-v4f1.txt $OUT/ 2>/dev/null
tar czf $OUT/logsC.tgz -C $OUT logs && rm -rf $L
cat $S
