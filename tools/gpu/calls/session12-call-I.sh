#!/bin/bash
# session 12, call I: after the final read-through's refactors (no kernel change): test-moe-cuda's tensor-core tests
# (the five hi-only controls now one helper: each must still FAIL as required), the bench's prefill with the FLOPs and
# expert bytes from shared helpers (GFLOP and roofline figures as before), compare_models with its new length argument.
set -u
source tools/gpu/calls/common.sh
run test-moe-cuda 400 "" --gtest_filter='cuda_moe.mma_*'
grep -cE "hi-only vs f32 tolerance\)\] NMSE .* > 1.0e-07" $L/test-moe-cuda.log | sed 's/^/hi-only controls failing as required: /' >> $S
prefill kimi-linear-48b 512 i
compare_models 300 4 120
nvidia-smi --query-gpu=name,driver_version --format=csv >> $S 2>&1
tar czf $OUT/logsI.tgz -C $OUT logs && rm -rf $L
cat $S
