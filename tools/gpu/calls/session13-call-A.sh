#!/bin/bash
# session 13, call A: the MLA prefill attention on tensor cores (cuda_options::mla_prefill_mma, mla-prefill.cu "The
# tensor-core form"): test-prefill-cuda (both attention forms vs the CPU and each other, the controls), memcheck and
# racecheck on that test, the tensor-core experts' tests (mma_bf16 / split_hi_lo moved to mma-sync.cuh), prefill
# timings with the switch on and off (48B 512..4096, k3-layers-4 512 / 2048), compare-backends at 300 tokens.
set -u
source tools/gpu/calls/common.sh
run test-prefill-cuda 600 ""
grep -E "control\(mma bitwise equal to simt\)" $L/test-prefill-cuda.log | awk '{print $NF, $(NF-1)}' | sort | uniq -c | sed 's/^/mma-vs-simt controls: /' >> $S
grep -E "mla-prefill/.*(NMSE|nmse)" $L/test-prefill-cuda.log | head -40 > $OUT/mla-nmse.txt
san memcheck test-prefill-cuda 'cuda_prefill.mla_flash_vs_cpu_and_absorbed' 300
timeout 300 /usr/local/cuda/bin/compute-sanitizer --tool racecheck --kernel-name regex:k_mla_prefill_mma --error-exitcode 9 $B/test-prefill-cuda --gtest_filter='cuda_prefill.mla_flash_vs_cpu_and_absorbed' > $L/racecheck-mla.log 2>&1
echo "[$(( $(date +%s) - T0 ))s] racecheck k_mla_prefill_mma rc=$? $(grep -E 'RACECHECK SUMMARY|Internal|error' $L/racecheck-mla.log | tail -2 | tr '\n' ' ')" >> $S
run test-moe-cuda 400 "" --gtest_filter='cuda_moe.mma_*'
prefill kimi-linear-48b 512,1024,2048,4096 on
prefill kimi-linear-48b 512,1024,2048,4096 off --set mla_prefill_mma=0
prefill k3-layers-4 512,2048 on
prefill k3-layers-4 512,2048 off --set mla_prefill_mma=0
for f in $OUT/prefill-*.log; do echo "== $f"; grep -E "MLA_ATTN|ms/step" $f; done >> $S
compare_models 300 4 120
nvidia-smi --query-gpu=name,driver_version --format=csv >> $S 2>&1
tar czf $OUT/logsA.tgz -C $OUT logs && rm -rf $L
cat $S
