#!/bin/bash
# session 13, call D: the tensor-core MLA prefill attention with the three products as three passes over the key /
# value groups (8 and 16 independent MMAs in a row; call C's profile: 55% of the issue gaps were fixed-latency
# dependencies): MLA_ATTN per-op and step times, two rounds (against call C's figures: the working tree with call C's
# binary beside this one was over the carry limit); the MLA test and memcheck.
set -u
source tools/gpu/calls/common.sh
run test-prefill-cuda 600 "" --gtest_filter='cuda_prefill.mla_*'
echo "mma-vs-simt controls: $(grep -h 'mma bitwise equal to simt' $L/test-prefill-cuda.log | grep -o '\] [A-Z]* (must' | sort | uniq -c | tr '\n' ' ')" >> $S
grep -hE "mla-prefill/.*(mla_attn|mma-vs-simt)\] NMSE" $L/test-prefill-cuda.log | awk '{print $3}' | sort -g | tail -1 | sed 's/^/largest mla NMSE: /' >> $S
san memcheck test-prefill-cuda 'cuda_prefill.mla_flash_vs_cpu_and_absorbed' 300
for r in 1 2; do
  for bin in bench-cuda-decode; do
    for p in k3-layers-4 kimi-linear-48b; do
      timeout 200 $B/$bin --preset $p --prefill 1024,2048 > $L/$bin-$p-$r.log 2>&1
      echo "[$(( $(date +%s) - T0 ))s] r$r $bin $p | $(grep -E 'default +T.*ms/step|MLA_ATTN' $L/$bin-$p-$r.log | sed -E 's/ +/ /g; s/GEMM .*//' | tr '\n' ' ')" >> $S
    done
  done
done
timeout 240 /usr/local/cuda/bin/ncu --kernel-name regex:k_mla_prefill_mma --launch-count 1 --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section InstructionStats --metrics sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active $B/bench-cuda-decode --preset k3-layers-4 --prefill 2048 --no-profile > $OUT/ncu-mla.txt 2>&1
echo "[$(( $(date +%s) - T0 ))s] ncu $(grep -E 'Duration|hmma|Memory Throughput|Issue Slots|Executed Instructions  |Warp Cycles Per Issued' $OUT/ncu-mla.txt | tr -s ' ' | tr '\n' ' ')" >> $S
nvidia-smi --query-gpu=name,driver_version --format=csv >> $S 2>&1
tar czf $OUT/logsD.tgz -C $OUT logs && rm -rf $L
cat $S
