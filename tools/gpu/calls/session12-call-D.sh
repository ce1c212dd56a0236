#!/bin/bash
# session 12, call D: the chunked KDA state pass with cp.async tiles one chunk ahead (and the prep kernel's batched
# loads). test-kda-cuda of this tree and of the previous kernel (test-kda-cuda-old: the same test source, kda-chunked.cu
# of f16be8d+v4) whose per-case output hashes must be equal (same arithmetic); memcheck / racecheck / synccheck on the
# chunked tests; racecheck on v4-bf16 limited to our kernel (call C's 12 hazards were all in cuBLASLt's nvjet kernels);
# test-prefill-cuda, test-runtime-cuda, compare-backends at 70 and 300 tokens; prefill of both presets.
set -u
source tools/gpu/calls/common.sh
( run test-kda-cuda 300 ""; run test-kda-cuda-old 300 "" ) &
( san memcheck test-kda-cuda 'cuda_kda.chunked*' 300; san racecheck test-kda-cuda 'cuda_kda.chunked*' 400; san synccheck test-kda-cuda 'cuda_kda.chunked_ragged*' 300 ) &
( run test-prefill-cuda 300 ""; run test-runtime-cuda 300 "" ) &
wait
grep "chunked-cuda bits" $L/test-kda-cuda.log > $OUT/bits-new.txt; grep "chunked-cuda bits" $L/test-kda-cuda-old.log > $OUT/bits-old.txt
echo "[$(( $(date +%s) - T0 ))s] bits: $(wc -l < $OUT/bits-new.txt) cases new, $(wc -l < $OUT/bits-old.txt) old; diff lines $(diff $OUT/bits-new.txt $OUT/bits-old.txt | wc -l)" >> $S
s=$(date +%s); timeout 400 /usr/local/cuda/bin/compute-sanitizer --tool racecheck --kernel-name kns=k_moe_mma4 --error-exitcode 9 $B/test-moe-cuda --gtest_filter='cuda_moe.mma_v4_bf16_prefill' > $L/racecheck-v4bf16.log 2>&1; rc=$?
echo "[$(( $(date +%s) - T0 ))s] racecheck (kns=k_moe_mma4) mma_v4_bf16_prefill rc=$rc $(( $(date +%s) - s ))s $(grep -E 'RACECHECK SUMMARY' $L/racecheck-v4bf16.log | tail -1)" >> $S
compare_models
compare_models 300 4 120
prefill kimi-linear-48b 512,1024 d
prefill k3-layers-4 512,2048 d
grep -E "bench|timing|us|ms" $L/test-kda-cuda.log | grep -iE "chunked|recurrent" | tail -8 >> $S
nvidia-smi --query-gpu=name,driver_version --format=csv >> $S 2>&1
tar czf $OUT/logsD.tgz -C $OUT logs && rm -rf $L
cat $S
