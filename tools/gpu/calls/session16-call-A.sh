#!/bin/bash
# session 16, call A: the tree of 4ccef17 (CUDA code = 1e4e631's, session 15's final defaults: the pair form with
# the slots sorted by expert, MXFP4 up to 128 tokens, BF16 up to 32). Session 15 measured those defaults through --set
# only and ran no whole suite on them; this call runs every CUDA test binary with them, the pair tests under memcheck
# and racecheck, compare-backends on the 9 models, the serve smoke CPU vs CUDA, decode at batches 1 / 8 / 64 (two
# rounds) and k3-layers-4 prefill at 512 / 2048 tokens.
set -u
source tools/gpu/calls/common.sh
( run test-moe-cuda 420 ""; san memcheck test-moe-cuda 'cuda_moe.decode_pairs_*' 200 ) &
( run test-fuse-cuda 300 ""; run test-runtime-cuda 300 ""; run test-route-cuda 120 ""; run test-sample-cuda 120 ""
  run test-pdl-cuda 120 ""; run test-kda-cuda 120 ""; run test-kda-decode-cuda 120 "" ) &
( run test-ops-cuda 300 ""; run test-mla-cuda 200 ""; run test-prefill-cuda 200 ""
  san racecheck test-moe-cuda 'cuda_moe.decode_pairs_direct' 200 ) &
wait
echo "pairs lines: $(grep -c 'moe-pairs' $L/test-moe-cuda.log); ': FAIL' lines: $(grep 'moe-pairs' $L/test-moe-cuda.log | grep -c ': FAIL\|] FAIL')" >> $S
compare_models
mkdir -p .gpu-carry/bin .gpu-carry/lib && cp $B/perigee .gpu-carry/bin/ && cp .gpu-carry-r1/lib/* .gpu-carry/lib/
OUT=$OUT/smoke timeout 300 bash tools/gpu/serve-smoke.sh > $L/serve-smoke.log 2>&1; rc=$?
echo "[$(( $(date +%s) - T0 ))s] serve-smoke rc=$rc | $(grep -E '^(PASS|FAIL)|serve-smoke:' $L/serve-smoke.log | tr '\n' ' ')" >> $S
D="timeout 200 $B/bench-cuda-decode --steps 20 --no-compare --no-profile"
decode_rounds 2
prefill k3-layers-4 512,2048 defaults
nvidia-smi --query-gpu=name,driver_version --format=csv >> $S 2>&1
cp $L/compare.log $L/serve-smoke.log $OUT/ 2>/dev/null
tar czf $OUT/logsA.tgz -C $OUT logs && rm -rf $L
cat $S
