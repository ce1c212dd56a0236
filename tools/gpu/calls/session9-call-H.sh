#!/bin/bash
# session 9, call H: the final tree (h / act of the BF16 pair by __ldca, moe_bf16_early 1, mla_attn_v4): the pair's
# tests repeated 10 times, test-runtime-cuda, then batches 1/8/64 of both presets, two rounds.
set -u
source tools/gpu/calls/common.sh   # unpack, paths, run()
( run test-moe-cuda 300 "-bf16x10" --gtest_filter='cuda_moe.decode_bf16*' --gtest_repeat=10 ) &
( run test-runtime-cuda 240 "" ) &
wait
echo "early lines: $(grep -cE 'early(100|200)\] bitwise the run without it: PASS' $L/test-moe-cuda-bf16x10.log) PASS, $(grep -cE 'early(100|200)\] DIFFERS' $L/test-moe-cuda-bf16x10.log) DIFFERS" >> $S
D="timeout 150 $B/bench-cuda-decode --steps 30 --no-compare --no-profile"
for round in 1 2; do
  $D --batch 1,8,64 > $L/dec-$round.log 2>&1
  echo "[$(( $(date +%s) - T0 ))s] r$round rc=$? | $(grep -E '^(k3-layers-4|kimi-linear-48b) +new' $L/dec-$round.log | awk '{print $1, $3, $5, $6, $9}' | tr '\n' ' ')" >> $S
done
nvidia-smi --query-gpu=name,driver_version --format=csv >> $S 2>&1
tar czf $OUT/logsH.tgz -C $OUT logs && rm -rf $L
cat $S
