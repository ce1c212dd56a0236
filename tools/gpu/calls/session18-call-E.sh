#!/bin/bash
# session 18, call E (measurement only, binaries of 741136e's code): two decode rounds of the final defaults and a 48B
# B=1 kernel timeline for the next session's layer-by-layer budget.
set -u
source tools/gpu/calls/common.sh
D="timeout 200 $B/bench-cuda-decode --steps 20 --no-compare --no-profile"
decode_rounds 2
$D --preset kimi-linear-48b --batch 1 --timeline 10 > $OUT/tl-48b-final.log 2>&1; rc=$?
echo "[$(( $(date +%s) - T0 ))s] timeline 48B rc=$rc | $(grep -E "^kimi-linear-48b +new" $OUT/tl-48b-final.log | awk '{print $3, $5, $9}' | tr '\n' ' ')" >> $S
nvidia-smi --query-gpu=name,driver_version --format=csv >> $S 2>&1
rm -rf $L
cat $S
