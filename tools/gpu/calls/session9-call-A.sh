#!/bin/bash
# session 9, call A: the kernel timeline of the graph step (bench-cuda-decode --timeline, CUPTI records: what each kernel
# adds to the step in the graph, PDL overlap included), both presets at B=1; plus the tests of 4b86fa1's review mends
# that were not run on the device (test-fuse-cuda whole, test-moe-cuda decode_bf16*).
set -u
source tools/gpu/calls/common.sh   # unpack, paths, run()
( run test-fuse-cuda 200 "" ; run test-moe-cuda 200 "-bf16" --gtest_filter='cuda_moe.decode_bf16*' ) &
wait
D="timeout 150 $B/bench-cuda-decode --steps 30 --no-compare --no-profile"
$D --batch 1 --timeline 6 > $L/timeline.log 2>&1
echo "[$(( $(date +%s) - T0 ))s] timeline rc=$? | $(grep -E '^(k3-layers-4|kimi-linear-48b) +new|^kernel timeline' $L/timeline.log | tr '\n' ' ')" >> $S
$D --batch 1 > $L/dec.log 2>&1
echo "[$(( $(date +%s) - T0 ))s] untraced rc=$? | $(grep -E '^(k3-layers-4|kimi-linear-48b) +new' $L/dec.log | awk '{print $1, $5, $8}' | tr '\n' ' ')" >> $S
cp $L/timeline.log $OUT/timeline.log
nvidia-smi --query-gpu=name,driver_version --format=csv >> $S 2>&1
tar czf $OUT/logsA.tgz -C $OUT logs && rm -rf $L
cat $S
