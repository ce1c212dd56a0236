#!/bin/bash
# session 11, call G: after the final review, run_fused builds the grouped kernel's arrays inside its plain-group branch
# only (host code). test-fuse-cuda (fused and plain grouped LINEAR launches), test-runtime-cuda, compare-backends on the
# 9 models, batch 1 of both presets.
set -u
source tools/gpu/calls/common.sh
run test-fuse-cuda 300 ""
run test-runtime-cuda 300 ""
compare_models
D="timeout 150 $B/bench-cuda-decode --steps 30 --no-compare --no-profile"
$D --batch 1 > $L/dec.log 2>&1; rc=$?
echo "[$(( $(date +%s) - T0 ))s] defaults rc=$rc | $(grep -E '^(k3-layers-4|kimi-linear-48b) +new' $L/dec.log | awk '{print $1, $3, $5, $6, $9}' | tr '\n' ' ')" >> $S
nvidia-smi --query-gpu=name,driver_version --format=csv >> $S 2>&1
tar czf $OUT/logsG.tgz -C $OUT logs && rm -rf $L
cat $S
