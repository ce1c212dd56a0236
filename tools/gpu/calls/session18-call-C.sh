#!/bin/bash
# session 18, call C: the GEMV launchers' shared occupancy helper (linear.cu gemv_occupancy: the staged, v2, v3 and
# tensor-core launchers' one carve-out / occupancy block; grids unchanged by construction) checked on the device: every
# GEMV test (test-ops-cuda, the tensor-core launcher test included), test-fuse-cuda, test-runtime-cuda, compare-backends,
# one decode round. Then session 17's open question, the bound at 7 tokens: gemv_max_elems 13824 (a 48B 7-token LINEAR
# on 2304-wide rows, and K3's 4-token 4096-wide ones, to cuBLASLt) vs the default 16384, same binary, two rounds.
# Predicted before this run: 48B B=7 9.34 -> ~9.2 ms (level with B=8's 9.32 on cuBLASLt), k3 B=4 ~unchanged (3.72).
set -u
source tools/gpu/calls/common.sh
( run test-ops-cuda 300 "" ) &
( run test-fuse-cuda 300 ""; run test-runtime-cuda 300 "" ) &
wait
compare_models
D="timeout 100 $B/bench-cuda-decode --steps 20 --no-compare --no-profile"
for round in 1 2; do
  $D --preset kimi-linear-48b --batch 6,7 --set gemv_max_elems=16384 > $L/b48-16384-$round.log 2>&1
  echo "[$(( $(date +%s) - T0 ))s] 48B elems 16384 r$round | $(grep -E '^kimi-linear-48b +new' $L/b48-16384-$round.log | awk '{print $3, $5}' | tr '\n' ' ')" >> $S
  $D --preset kimi-linear-48b --batch 6,7 --set gemv_max_elems=13824 > $L/b48-13824-$round.log 2>&1
  echo "[$(( $(date +%s) - T0 ))s] 48B elems 13824 r$round | $(grep -E '^kimi-linear-48b +new' $L/b48-13824-$round.log | awk '{print $3, $5}' | tr '\n' ' ')" >> $S
  $D --preset k3-layers-4 --batch 4 --set gemv_max_elems=16384 > $L/bk3-16384-$round.log 2>&1
  echo "[$(( $(date +%s) - T0 ))s] k3 elems 16384 r$round | $(grep -E '^k3-layers-4 +new' $L/bk3-16384-$round.log | awk '{print $3, $5}' | tr '\n' ' ')" >> $S
  $D --preset k3-layers-4 --batch 4 --set gemv_max_elems=13824 > $L/bk3-13824-$round.log 2>&1
  echo "[$(( $(date +%s) - T0 ))s] k3 elems 13824 r$round | $(grep -E '^k3-layers-4 +new' $L/bk3-13824-$round.log | awk '{print $3, $5}' | tr '\n' ' ')" >> $S
done
decode_rounds 1
nvidia-smi --query-gpu=name,driver_version --format=csv >> $S 2>&1
tar czf $OUT/logsC.tgz -C $OUT logs && rm -rf $L
cat $S
