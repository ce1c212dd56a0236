#!/bin/bash
# session 7, call I: v3/v4 only in prefill-sized steps (T >= moe_mma_large_step): k3-layers-4 B=64 decode default vs
# v3/v4 off (now the same path), the tensor-core and small-batch expert tests, prefill T=2048.
set -u
source tools/gpu/calls/common.sh   # unpack, paths, run()
run test-moe-cuda 200 "-mma" --gtest_filter='cuda_moe.mma_*:cuda_moe.small_v4_batch'
D="timeout 100 $B/bench-cuda-decode --steps 20 --no-compare --no-profile --preset k3-layers-4 --batch 64"
$D > $L/dec-on.log 2>&1; echo "[$(( $(date +%s) - T0 ))s] default rc=$? $(grep -E '^k3-layers-4 +new' $L/dec-on.log)" >> $S
$D --set moe_mma_v4=0,moe_mma_v3=0 > $L/dec-off.log 2>&1; echo "[$(( $(date +%s) - T0 ))s] v3/v4 off rc=$? $(grep -E '^k3-layers-4 +new' $L/dec-off.log)" >> $S
timeout 100 $B/bench-cuda-decode --preset k3-layers-4 --prefill 2048 --no-profile > $L/prefill.log 2>&1; echo "[$(( $(date +%s) - T0 ))s] prefill rc=$?" >> $S
grep -E "^prefill" $L/prefill.log >> $S
tar czf $OUT/logsI.tgz -C $OUT logs && rm -rf $L
cat $S
