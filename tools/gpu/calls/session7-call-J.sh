#!/bin/bash
# session 7, call J: after the FP4 A-fragment dequant was factored into fp4.cuh (fp4_a_pairs, e8m0_bf16x2): v4's machine
# code is byte-identical (cubin .text compared here); v2 (MXFP4) and v3 changed (the E8M0 scale by a max instead of a
# select): their tests again.
set -u
source tools/gpu/calls/common.sh   # unpack, paths, run()
run test-moe-cuda 120 "-mma" --gtest_filter='cuda_moe.mma_v2*:cuda_moe.mma_v3*:cuda_moe.mma_v4*'
grep -E "mma-v3.*bitwise|NOT caught|FAIL" $L/test-moe-cuda-mma.log | grep -v "must FAIL" | head -20 >> $S
tar czf $OUT/logsJ.tgz -C $OUT logs && rm -rf $L
cat $S
