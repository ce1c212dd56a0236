#!/bin/bash
# session 16, call C: the split-bf16 cuBLASLt LINEAR as one stacked GEMM of 2T columns + an ADD of the halves
# (cuda_options::linear_split_stacked = 256 tokens; the weights read once instead of twice). Call B: k3-layers-4 B=16
# 9.38 ms with the split, 7.25 ms with one bf16 pass, i.e. the second pass re-read ~2.1 ms of weights.
# Predicted before this call: k3 B=16 9.38 -> ~7.4 ms, B=64 23.6 -> ~21.4; 48B B=16 16.4 -> ~15.0, B=64 37.0 -> ~35.3;
# B=1 / 8 unchanged (GEMV path); prefill at 512 / 2048 tokens unchanged (above the bound).
# Checks: test-ops-cuda (the new linear_split_stacked test and every LINEAR test on the new default), test-fuse-cuda,
# test-prefill-cuda, test-runtime-cuda, test-moe-cuda's routed-graph tests, memcheck on the new test, compare-backends on
# the 9 models at 70 tokens (stacked) and 300 (two GEMMs); then decode stacked (default) vs off, same binary, two rounds.
set -u
source tools/gpu/calls/common.sh
( run test-ops-cuda 300 ""; san memcheck test-ops-cuda 'cuda_ops.linear_split_stacked' 300 ) &
( run test-fuse-cuda 300 ""; run test-prefill-cuda 200 ""; run test-runtime-cuda 300 "" ) &
( compare_models; compare_models 300 4 120 ) &
wait
grep -hE 'linear_stacked/.*(counter|bitwise|control\])' $L/test-ops-cuda.log | head -60 > $OUT/stacked-lines.txt
echo "stacked lines: $(grep -c 'linear_stacked/' $L/test-ops-cuda.log); FAIL lines (controls excluded): $(grep 'linear_stacked/' $L/test-ops-cuda.log | grep -v control | grep -c FAIL)" >> $S
D="timeout 200 $B/bench-cuda-decode --steps 20 --no-compare --no-profile"
for round in 1 2; do
  for p in k3-layers-4 kimi-linear-48b; do
    for v in 256 0; do
      $D --preset $p --batch 1,16,64 --set linear_split_stacked=$v > $L/d-$p-$v-$round.log 2>&1; rc=$?
      echo "[$(( $(date +%s) - T0 ))s] r$round $p stacked=$v rc=$rc | $(grep -E "^$p +new" $L/d-$p-$v-$round.log | awk '{print $3, $5, $6, $9}' | tr '\n' ' ')" >> $S
    done
  done
done
prefill k3-layers-4 256,512,2048 stacked --no-profile
nvidia-smi --query-gpu=name,driver_version --format=csv >> $S 2>&1
cp $L/compare.log $L/compare300.log $OUT/ 2>/dev/null
tar czf $OUT/logsC.tgz -C $OUT logs && rm -rf $L
cat $S
