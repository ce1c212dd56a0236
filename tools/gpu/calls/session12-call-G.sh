#!/bin/bash
# session 12, call G: the final tree. Every CUDA test binary, memcheck on the v4-BF16 and chunked-KDA tests, compare-
# backends at 70 and 300 tokens on the 9 models, decode batches 1/8/64 twice, prefill of both presets. After the review:
# racecheck on v4-BF16 with the cuBLAS kernels excluded; the released-outputs test with poison-on-release and its
# one-position-early control, at 300 tokens and at 1.
set -u
source tools/gpu/calls/common.sh
( run test-ops-cuda 400 ""; run test-moe-cuda 500 ""; run test-route-cuda 150 ""; run test-kda-decode-cuda 100 ""; run test-pdl-cuda 100 "" ) &
( run test-fuse-cuda 300 ""; run test-mla-cuda 200 ""; run test-prefill-cuda 300 ""; run test-sample-cuda 100 ""; run test-kda-cuda 200 "" ) &
( sleep 20; san memcheck test-moe-cuda 'cuda_moe.mma_v4_bf16_prefill' 300; san memcheck test-kda-cuda 'cuda_kda.chunked*' 300
  s=$(date +%s); timeout 400 /usr/local/cuda/bin/compute-sanitizer --tool racecheck --kernel-name-exclude kns=nvjet --error-exitcode 9 $B/test-moe-cuda --gtest_filter='cuda_moe.mma_v4_bf16_prefill' > $L/racecheck-v4bf16.log 2>&1; rc=$?
  echo "[$(( $(date +%s) - T0 ))s] racecheck (cuBLAS nvjet kernels excluded) mma_v4_bf16_prefill rc=$rc $(( $(date +%s) - s ))s $(grep -E 'RACECHECK SUMMARY|Internal' $L/racecheck-v4bf16.log | tail -2 | tr '\n' ' ')" >> $S ) &
wait
run test-runtime-cuda 400 ""
grep -E "\[measure\] free_dead|\[control\] T" $L/test-runtime-cuda.log >> $S
compare_models
compare_models 300 4 120
D="timeout 150 $B/bench-cuda-decode --steps 30 --no-compare --no-profile"
decode_rounds 2
prefill kimi-linear-48b 512,2048 g
prefill k3-layers-4 512,2048 g
cp $L/compare.log $L/compare300.log $OUT/ 2>/dev/null
nvidia-smi --query-gpu=name,driver_version --format=csv >> $S 2>&1
tar czf $OUT/logsG.tgz -C $OUT logs && rm -rf $L
cat $S
