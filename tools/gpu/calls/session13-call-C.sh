#!/bin/bash
# session 13, call C: the tensor-core MLA prefill attention with the staging's copies indexed incrementally (no
# division per copy) and the causal mask only on the tiles that need it (call B's profile: issue-bound, the MMAs ~25% of
# the instructions): test-prefill-cuda whole, memcheck / synccheck on the MLA test, prefill timings on / off,
# compare-backends at 300 tokens, Nsight Compute on the kernel again.
set -u
source tools/gpu/calls/common.sh
run test-prefill-cuda 600 ""
echo "mma-vs-simt controls: $(grep -h 'mma bitwise equal to simt' $L/test-prefill-cuda.log | grep -o '\] [A-Z]* (must' | sort | uniq -c | tr '\n' ' ')" >> $S
grep -hE "mla-prefill/.*(mla_attn|mma-vs-simt)\] NMSE" $L/test-prefill-cuda.log | awk '{print $3}' | sort -g | tail -1 | sed 's/^/largest mla NMSE: /' >> $S
san memcheck test-prefill-cuda 'cuda_prefill.mla_flash_vs_cpu_and_absorbed' 300
san synccheck test-prefill-cuda 'cuda_prefill.mla_flash_vs_cpu_and_absorbed' 300
prefill kimi-linear-48b 1024,2048,4096 on
prefill kimi-linear-48b 1024,2048,4096 off --set mla_prefill_mma=0
prefill k3-layers-4 2048 on
prefill k3-layers-4 2048 off --set mla_prefill_mma=0
for f in $OUT/prefill-*.log; do echo "== $f"; grep -E "MLA_ATTN|default +T.*ms/step" $f; done >> $S
compare_models 300 4 120
timeout 240 /usr/local/cuda/bin/ncu --kernel-name regex:k_mla_prefill_mma --launch-count 1 --section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats --section Occupancy --section SchedulerStats --section InstructionStats --metrics sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active $B/bench-cuda-decode --preset k3-layers-4 --prefill 2048 --no-profile > $OUT/ncu-mla.txt 2>&1
echo "[$(( $(date +%s) - T0 ))s] ncu $(grep -E 'Duration|hmma|Memory Throughput|Issue Slots|Executed Instructions  ' $OUT/ncu-mla.txt | tr -s ' ' | tr '\n' ' ')" >> $S
nvidia-smi --query-gpu=name,driver_version --format=csv >> $S 2>&1
tar czf $OUT/logsC.tgz -C $OUT logs && rm -rf $L
cat $S
