#!/bin/bash
# session 24, call B: the fused MoE layer kernel (moe-layer-decode.cu) first: test-moe-layer-cuda (bit for bit the
# unfused launches after the router, controls, graph replays, refusals, the [timing] lines per layer), memcheck of its
# correctness case; then the refactors' own suites (route-pick.cuh: test-route-cuda; moe-bf16-rows.cuh: test-moe-cuda's
# BF16 decode cases) and session 23's pending replay tests. Summary plus the moe-layer log.
set -u
source tools/gpu/calls/common.sh
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >> $S 2>&1
run test-moe-layer-cuda 300 ""
grep -E '^\[(moe_layer|timing)\]|Failure|error|expected|Which is|vs ' $L/test-moe-layer-cuda.log | head -60 >> $S
san memcheck test-moe-layer-cuda 'moe_layer.fused_equals_unfused:moe_layer.refuses' 240
run test-route-cuda 200 ""
run test-moe-cuda 300 "-bf16" --gtest_filter='*bf16*'
run test-fuse-cuda 200 "-replay" --gtest_filter='cuda_fuse.side_prefetch*:cuda_fuse.capture_replay*:cuda_fuse.moe_shared*'
cp $L/test-moe-layer-cuda.log $OUT/ 2>/dev/null
rm -rf $L
cat $S
