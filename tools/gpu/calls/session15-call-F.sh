#!/bin/bash
# session 15, call F: the pair form's slots in expert order (cuda_options::moe_decode_pairs_sorted: one sort launch, then
# the blocks that re-read an expert run back to back so that the re-reads can hit L2). test-moe-cuda's decode tests
# (the sorted runs bitwise the unsorted ones, direct and through the backend with graph replays; the T == 1 kernels
# whose signatures changed), memcheck on the direct test; decode k3-layers-4 at 8 / 64 / 128 and the 48B at 8 / 16 /
# 32 / 64 (BF16 pair form on to 64) with the slots sorted and not.
set -u
source tools/gpu/calls/common.sh
run test-moe-cuda 300 "" --gtest_filter='cuda_moe.decode_*'
san memcheck test-moe-cuda 'cuda_moe.decode_pairs_direct' 200
grep -h 'sorted' $L/test-moe-cuda.log | head -40 > $OUT/sorted-lines.txt
echo "sorted lines: $(grep -c 'sorted' $L/test-moe-cuda.log), PASS $(grep 'sorted' $L/test-moe-cuda.log | grep -c 'PASS')" >> $S
D="timeout 200 $B/bench-cuda-decode --steps 20 --no-compare --no-profile"
for srt in 0 1; do
  $D --preset k3-layers-4 --batch 8,64,128 --set moe_decode_pairs_sorted=$srt > $OUT/k3-sorted$srt.log 2>&1; rc=$?
  echo "[$(( $(date +%s) - T0 ))s] k3 sorted=$srt rc=$rc | $(grep -E '^k3-layers-4 +new' $OUT/k3-sorted$srt.log | awk '{print $1, $3, $5, $6, $9}' | tr '\n' ' ')" >> $S
  $D --preset kimi-linear-48b --batch 8,16,32,64 --set moe_decode_pairs_bf16=64,moe_decode_pairs_sorted=$srt > $OUT/48b-sorted$srt.log 2>&1; rc=$?
  echo "[$(( $(date +%s) - T0 ))s] 48B bf16 pairs<=64 sorted=$srt rc=$rc | $(grep -E '^kimi-linear-48b +new' $OUT/48b-sorted$srt.log | awk '{print $1, $3, $5, $6, $9}' | tr '\n' ' ')" >> $S
done
nvidia-smi --query-gpu=name,driver_version --format=csv >> $S 2>&1
cp $L/test-moe-cuda.log $OUT/ 2>/dev/null
rm -rf $L
cat $S
