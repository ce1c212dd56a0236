#!/bin/bash
# session 17, call E (binaries of the commit that allocates the tensor-core GEMV's scratch only when it is on): the GEMV
# launcher tests and the wide-GEMV backend test (the kernel on, scratch allocated), and decode at B = 1 / 8 with the
# defaults (no scratch) and with gemv_mma_min_tokens=3 (scratch).
set -u
source tools/gpu/calls/common.sh
run test-ops-cuda 200 "" --gtest_filter='cuda_ops.linear_wide_gemv_fusions_off_and_on:cuda_ops.linear_gemv_kernels_all_variants'
grep -E '^\[gemv\] tensor-core|launches [0-9]+$' $L/test-ops-cuda.log | grep -E 'mma|tensor-core' | tail -6 >> $S
D="timeout 100 $B/bench-cuda-decode --steps 20 --no-compare --no-profile --batch 1,8"
b k3-layers-4 default "gemv_mma_min_tokens=0"
b k3-layers-4 mma3 "gemv_mma_min_tokens=3,gemv_max_elems=0"
rm -rf $L
cat $S
