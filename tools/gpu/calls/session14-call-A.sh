#!/bin/bash
# session 14, call A: the MLA prefill attention kernels alone (test-prefill-cuda mla_attn_kernels_alone: no cuBLAS in
# the test, so racecheck can run it; session 13 had no racecheck result for the tensor-core form) under racecheck,
# memcheck and synccheck; test-prefill-cuda whole; the serve smoke CPU vs CUDA with the new default per-step budgets
# (cpu 512, cuda 2048) and a ~1 200-token prompt; decode / prefill once as a regression check (no kernel changed).
set -u
source tools/gpu/calls/common.sh
F='cuda_prefill.mla_attn_kernels_alone'
( run test-prefill-cuda 300 ""; run test-mla-cuda 200 "" ) &
( sleep 5; san racecheck test-prefill-cuda $F 400; san memcheck test-prefill-cuda $F 300; san synccheck test-prefill-cuda $F 300 ) &
wait
grep -h 'mla-attn-alone' $L/test-prefill-cuda.log | grep -E 'control|FAIL' | head -40 > $OUT/alone-controls.txt
echo "alone: $(grep -c 'mla-attn-alone' $L/test-prefill-cuda.log) lines; controls: $(grep -h 'mla-attn-alone.*control' $L/test-prefill-cuda.log | grep -oE '(PASSED|FAILED|EQUAL|DIFFERENT) \(must' | sort | uniq -c | tr '\n' ' ')" >> $S
mkdir -p .gpu-carry/bin .gpu-carry/lib && cp $B/perigee .gpu-carry/bin/ && cp .gpu-carry-r1/lib/* .gpu-carry/lib/
OUT=$OUT/smoke timeout 400 bash tools/gpu/serve-smoke.sh > $L/serve-smoke.log 2>&1; rc=$?
echo "[$(( $(date +%s) - T0 ))s] serve-smoke rc=$rc | $(grep -E '^(PASS|FAIL)|serve-smoke:' $L/serve-smoke.log | tr '\n' ' ')" >> $S
D="timeout 150 $B/bench-cuda-decode --steps 30 --no-compare --no-profile"
decode_rounds 1
prefill kimi-linear-48b 512,2048 e --no-profile
nvidia-smi --query-gpu=name,driver_version --format=csv >> $S 2>&1
cp $L/serve-smoke.log $OUT/ 2>/dev/null
tar czf $OUT/logsA.tgz -C $OUT logs && rm -rf $L
cat $S
