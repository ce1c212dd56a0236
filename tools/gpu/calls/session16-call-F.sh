#!/bin/bash
# session 16, call F (no code, binaries of bbd4dc1): the batches the README lists that call C did not run, with the
# stacked LINEAR (the default): k3-layers-4 B=32 / 128, 48B B=32; two rounds.
set -u
source tools/gpu/calls/common.sh
D="timeout 200 $B/bench-cuda-decode --steps 20 --no-compare --no-profile"
for round in 1 2; do
  for p in k3-layers-4 kimi-linear-48b; do
    bs=32; [ $p = k3-layers-4 ] && bs=32,128
    $D --preset $p --batch $bs > $L/d-$p-$round.log 2>&1; rc=$?
    echo "[$(( $(date +%s) - T0 ))s] r$round $p rc=$rc | $(grep -E "^$p +new" $L/d-$p-$round.log | awk '{print $3, $5, $6, $9}' | tr '\n' ' ')" >> $S
  done
done
nvidia-smi --query-gpu=name,driver_version --format=csv >> $S 2>&1
rm -rf $L
cat $S
