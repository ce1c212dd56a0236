#!/bin/bash
# session 15, call D: the final tree. test-route-cuda (its buffers moved to dev-buffer.h), the serve smoke CPU vs CUDA
# (serve's default budget now from backend::step_tokens_default; the budget check reads each server's own log), and
# decode at batches 1 / 8 / 64 with the final defaults (pair form: MXFP4 up to 128 tokens, BF16 up to 8).
set -u
source tools/gpu/calls/common.sh
run test-route-cuda 300 ""
mkdir -p .gpu-carry/bin .gpu-carry/lib && cp $B/perigee .gpu-carry/bin/ && cp .gpu-carry-r1/lib/* .gpu-carry/lib/
OUT=$OUT/smoke timeout 400 bash tools/gpu/serve-smoke.sh > $L/serve-smoke.log 2>&1; rc=$?
echo "[$(( $(date +%s) - T0 ))s] serve-smoke rc=$rc | $(grep -E '^(PASS|FAIL)|serve-smoke:' $L/serve-smoke.log | tr '\n' ' ')" >> $S
D="timeout 200 $B/bench-cuda-decode --steps 20 --no-compare --no-profile"
decode_rounds 1
nvidia-smi --query-gpu=name,driver_version --format=csv >> $S 2>&1
cp $L/serve-smoke.log $L/test-route-cuda.log $OUT/ 2>/dev/null
rm -rf $L
cat $S
