#!/bin/bash
# session 13, call B: the tensor-core MLA prefill attention with the k16 steps outermost in S = Q K^T (call A's form
# chained 36 dependent MMAs per pair of n8 tiles): the MLA test, racecheck on the new kernel alone, the prefill timings
# on / off, and one Nsight Compute profile of the kernel (k3-layers-4 T=2048).
set -u
source tools/gpu/calls/common.sh
run test-prefill-cuda 600 "" --gtest_filter='cuda_prefill.mla_*'
echo "mma-vs-simt controls: $(grep -h 'mma bitwise equal to simt' $L/test-prefill-cuda.log | grep -o '\] [A-Z]* (must' | sort | uniq -c | tr '\n' ' ')" >> $S
timeout 300 /usr/local/cuda/bin/compute-sanitizer --tool racecheck --kernel-name kns=k_mla_prefill_mma --error-exitcode 9 $B/test-prefill-cuda --gtest_filter='cuda_prefill.mla_flash_vs_cpu_and_absorbed' > $L/racecheck-mla.log 2>&1
echo "[$(( $(date +%s) - T0 ))s] racecheck k_mla_prefill_mma rc=$? $(grep -E 'RACECHECK SUMMARY|Internal|rror' $L/racecheck-mla.log | tail -2 | tr '\n' ' ')" >> $S
timeout 300 /usr/local/cuda/bin/compute-sanitizer --tool synccheck --kernel-name kns=k_mla_prefill_mma --error-exitcode 9 $B/test-prefill-cuda --gtest_filter='cuda_prefill.mla_flash_vs_cpu_and_absorbed' > $L/synccheck-mla.log 2>&1
echo "[$(( $(date +%s) - T0 ))s] synccheck k_mla_prefill_mma rc=$? $(grep -E 'SYNCCHECK SUMMARY|Internal|rror' $L/synccheck-mla.log | tail -2 | tr '\n' ' ')" >> $S
prefill kimi-linear-48b 1024,2048,4096 on
prefill kimi-linear-48b 1024,2048,4096 off --set mla_prefill_mma=0
prefill k3-layers-4 2048 on
prefill k3-layers-4 2048 off --set mla_prefill_mma=0
for f in $OUT/prefill-*.log; do echo "== $f"; grep -E "MLA_ATTN|default +T.*ms/step" $f; done >> $S
timeout 240 /usr/local/cuda/bin/ncu --kernel-name regex:k_mla_prefill_mma --launch-count 1 --section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats --section Occupancy --section SchedulerStats --metrics sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active $B/bench-cuda-decode --preset k3-layers-4 --prefill 2048 --no-profile > $OUT/ncu-mla.txt 2>&1
echo "[$(( $(date +%s) - T0 ))s] ncu rc=$? $(grep -E 'Duration|hmma|Memory Throughput|Issue Slots' $OUT/ncu-mla.txt | tr -s ' ' | tr '\n' ' ')" >> $S
nvidia-smi --query-gpu=name,driver_version --format=csv >> $S 2>&1
tar czf $OUT/logsB.tgz -C $OUT logs && rm -rf $L
cat $S
