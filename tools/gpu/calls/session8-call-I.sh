#!/bin/bash
# session 8, call I: the host side of the tensor-core experts' two stages shared by v3 and v4 (moe-mma-blocks.cuh
# mma_stage / mma_stages over each version's traits; the kernels' machine code byte-identical, cubin .text compared):
# the MoE tensor-core tests (v3 bitwise v2, v4 against v3 / the CPU, launch counters, controls) and prefill T 512 / 2048.
set -u
source tools/gpu/calls/common.sh   # unpack, paths, run()
run test-moe-cuda 150 "-mma" --gtest_filter='cuda_moe.mma_*:cuda_moe.small_v4_batch'
grep -hE "NOT caught|FAIL" $L/test-moe-cuda-mma.log | grep -v "must FAIL\|FAILED as required\|both must FAIL" | head -5 >> $S
timeout 100 $B/bench-cuda-decode --preset k3-layers-4 --prefill 512,2048 > $L/prefill.log 2>&1; echo "[$(( $(date +%s) - T0 ))s] prefill rc=$?" >> $S
grep -E "^prefill|GEMM share" $L/prefill.log >> $S
tar czf $OUT/logsI.tgz -C $OUT logs && rm -rf $L
cat $S
