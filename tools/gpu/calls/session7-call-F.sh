#!/bin/bash
# session 7, call F: v4 with 128 rows per block (cuda_options::moe_mma_v4_rows 128: 3 blocks = 24 warps per SM, 79
# registers) against 256 (the default): parity (test-moe-cuda mma_*), memcheck over the small shapes, k3-layers-4
# prefill T 512 / 2048 with rows 256 / 128 / 256 (same binary), Nsight Compute of the 128-row kernels at T 2048.
set -u
source tools/gpu/calls/common.sh   # unpack, paths, run()
CS=/usr/local/cuda/bin/compute-sanitizer
( run test-moe-cuda 300 "-mma" --gtest_filter='cuda_moe.mma_*' ) &
( MOE_V4_SMALL=1 timeout 300 $CS --tool memcheck --error-exitcode 9 $B/test-moe-cuda --gtest_filter='cuda_moe.mma_v4_prefill' > $L/memcheck-v4.log 2>&1; echo "[$(( $(date +%s) - T0 ))s] memcheck v4 rc=$? $(grep -E 'ERROR SUMMARY' $L/memcheck-v4.log | tail -1)" >> $S ) &
wait
P="timeout 150 $B/bench-cuda-decode --preset k3-layers-4 --prefill 512,2048"
$P > $L/prefill-r256.log 2>&1; echo "[$(( $(date +%s) - T0 ))s] prefill rows 256 rc=$?" >> $S
$P --set moe_mma_v4_rows=128 > $L/prefill-r128.log 2>&1; echo "[$(( $(date +%s) - T0 ))s] prefill rows 128 rc=$?" >> $S
$P --no-profile > $L/prefill-r256b.log 2>&1; echo "[$(( $(date +%s) - T0 ))s] prefill rows 256 again rc=$?" >> $S
timeout 120 /usr/local/cuda/bin/ncu --clock-control none --kernel-name regex:'k_moe_mma4' --launch-count 2 \
  --section SpeedOfLight --section Occupancy --section SchedulerStats --section WarpStateStats --section ComputeWorkloadAnalysis \
  --metrics sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active \
  $B/bench-cuda-decode --preset k3-layers-4 --prefill 2048 --no-profile --set moe_mma_v4_rows=128 > $L/ncu-v4r128.txt 2>&1; echo "[$(( $(date +%s) - T0 ))s] ncu rows 128 rc=$?" >> $S
grep -E "mma-v4.*rows128.*(launches|v4-vs-v3|experts\])|NOT caught|FAIL" $L/test-moe-cuda-mma.log | grep -v "must FAIL" | head -24 >> $S
for f in $L/prefill-*.log; do echo "== $(basename $f)"; grep -E "^prefill|GEMM share|MOE_EXPERTS|LINEAR|FAILED|rror" $f; done >> $S
grep -E "k_moe_mma4|Duration|Registers Per|Issue Slots Busy|No Eligible|Warp Cycles Per Issued|pipe_tensor|Achieved Occupancy|highest-utilized" $L/ncu-v4r128.txt >> $S
cp $L/ncu-v4r128.txt $OUT/ 2>/dev/null
tar czf $OUT/logsF.tgz -C $OUT logs && rm -rf $L
cat $S
