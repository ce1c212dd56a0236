#!/bin/bash
# session 12, call E: released outputs (cuda_options::free_dead_outputs; the runner turns it on, the bench's prefill
# timing passes too). test-runtime-cuda whole (the runner with it on vs the CPU; the new released-outputs test with its
# read control), compare-backends at 70 tokens (node callback: release off), prefill of the 48B at 512 / 1024 / 2048
# (2048 ran out of memory in call A) and of k3-layers-4, with the pool high-water per step; one decode round.
set -u
source tools/gpu/calls/common.sh
run test-runtime-cuda 400 ""
grep -E "\[measure\] free_dead|\[control\] read of node" $L/test-runtime-cuda.log >> $S
compare_models
prefill kimi-linear-48b 512,1024,2048 e
grep -E "peak" $OUT/prefill-kimi-linear-48b-e.log >> $S
prefill k3-layers-4 512,2048 e
grep -E "peak" $OUT/prefill-k3-layers-4-e.log >> $S
D="timeout 150 $B/bench-cuda-decode --steps 30 --no-compare --no-profile"
decode_rounds 1
cp $L/compare.log $OUT/ 2>/dev/null
nvidia-smi --query-gpu=name,driver_version --format=csv >> $S 2>&1
tar czf $OUT/logsE.tgz -C $OUT logs && rm -rf $L
cat $S
