#!/bin/bash
# session 15, call B: the final tree with the pair form on by default (cuda_options::moe_decode_pairs_mxfp4 = 64,
# moe_decode_pairs_bf16 = 8) and moe_group_ints sized for its combine counters (call A: the top-1 case at T 5 fell back
# to the grouped kernels, 5 x 8 counters > 22 ints). test-moe-cuda whole, test-fuse-cuda (the BF16 pair's shared slot),
# test-runtime-cuda (the engine, batched decode), compare-backends on the 9 models; the pair direct test under memcheck
# again; decode with the new defaults at batches 1 / 8 / 64, and k3-layers-4 at 64 / 128 with the pair form on and off
# (the default's upper bound, 64, is call A's measured range).
set -u
source tools/gpu/calls/common.sh
( run test-moe-cuda 400 "" ) &
( run test-fuse-cuda 300 ""; run test-runtime-cuda 300 ""; san memcheck test-moe-cuda 'cuda_moe.decode_pairs_*' 400 ) &
wait
grep -h 'moe-pairs' $L/test-moe-cuda.log | grep -E 'launches|bitwise|FAIL:' | head -80 > $OUT/pairs-lines.txt
echo "pairs lines: $(grep -c 'moe-pairs' $L/test-moe-cuda.log); ': FAIL' lines: $(grep 'moe-pairs' $L/test-moe-cuda.log | grep -c ': FAIL\|] FAIL')" >> $S
compare_models
D="timeout 200 $B/bench-cuda-decode --steps 20 --no-compare --no-profile"
decode_rounds 2
$D --preset k3-layers-4 --batch 64,128 --set moe_decode_pairs_mxfp4=128 > $OUT/k3-128-on.log 2>&1; rc=$?
echo "[$(( $(date +%s) - T0 ))s] k3 pairs<=128 rc=$rc | $(grep -E '^k3-layers-4 +new' $OUT/k3-128-on.log | awk '{print $1, $3, $5, $6, $9}' | tr '\n' ' ')" >> $S
$D --preset k3-layers-4 --batch 64,128 --set moe_decode_pairs_mxfp4=0 > $OUT/k3-128-off.log 2>&1; rc=$?
echo "[$(( $(date +%s) - T0 ))s] k3 pairs off rc=$rc | $(grep -E '^k3-layers-4 +new' $OUT/k3-128-off.log | awk '{print $1, $3, $5, $6, $9}' | tr '\n' ' ')" >> $S
nvidia-smi --query-gpu=name,driver_version --format=csv >> $S 2>&1
cp $L/compare.log $L/test-moe-cuda.log $OUT/ 2>/dev/null
tar czf $OUT/logsB.tgz -C $OUT logs && rm -rf $L
cat $S
