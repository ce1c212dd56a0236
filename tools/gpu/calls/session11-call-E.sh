#!/bin/bash
# session 11, call E: the grouped expert kernels' lookup preamble as one helper (moe.cu group_of; six kernels: grouped
# v1 gate/up + down, FP4 v2 gate/up + down, small v4 gate/up + down). The whole test-moe-cuda (the grouped paths bit for
# bit / against the CPU, with their controls), test-runtime-cuda, compare-backends on the 9 models, then batches 1 and
# 8 (T > 1 runs the grouped small-v4 kernels) of both presets, two rounds.
set -u
source tools/gpu/calls/common.sh
run test-moe-cuda 400 ""
run test-runtime-cuda 300 ""
compare_models
D="timeout 150 $B/bench-cuda-decode --steps 30 --no-compare --no-profile"
for round in 1 2; do
  $D --batch 1,8 > $L/dec-$round.log 2>&1; rc=$?
  echo "[$(( $(date +%s) - T0 ))s] r$round defaults rc=$rc | $(grep -E '^(k3-layers-4|kimi-linear-48b) +new' $L/dec-$round.log | awk '{print $1, $3, $5, $6, $9}' | tr '\n' ' ')" >> $S
done
nvidia-smi --query-gpu=name,driver_version --format=csv >> $S 2>&1
tar czf $OUT/logsE.tgz -C $OUT logs && rm -rf $L
cat $S
