#!/bin/bash
# session 17, call C: the new default cuda_options::gemv_max_elems = 16384 (a LINEAR of 3+ tokens whose input holds more
# than 16384 elements goes to the stacked split-bf16 cuBLASLt LINEAR; gemv_mma_min_tokens back to 0, off, after calls
# A/B). Predicted before this run (calls A/B's cuBLASLt column): k3-layers-4 B=3 ~3.36-3.40 ms, B=4 ~3.64-3.68, B=8
# ~4.85-4.89; 48B B=3..6 as the GEMV kernels (4.73 / 6.19 / 7.17 / 8.2), B=8 ~9.34-9.38; B=1, 2 unchanged. Sweep at
# B = 2..8, default vs gemv_max_elems=0 (session 16's rule), same binary; then every CUDA test binary on the new
# defaults, compare-backends on the 9 models, the serve smoke CPU vs CUDA, decode rounds at B = 1 / 8 / 64.
set -u
source tools/gpu/calls/common.sh
D="timeout 200 $B/bench-cuda-decode --steps 20 --no-compare --no-profile"
for p in k3-layers-4 kimi-linear-48b; do
  for v in "default:gemv_max_elems=16384" "elems0:gemv_max_elems=0"; do
    tag=${v%%:*}; sets=${v#*:}
    $D --preset $p --batch 2,3,4,5,6,7,8 --set $sets > $L/d-$p-$tag.log 2>&1; rc=$?
    echo "[$(( $(date +%s) - T0 ))s] $p $tag rc=$rc | $(grep -E "^$p +new" $L/d-$p-$tag.log | awk '{print $3, $5, $9}' | tr '\n' ' ')" >> $S
  done
done
( run test-moe-cuda 420 "" ) &
( run test-fuse-cuda 300 ""; run test-runtime-cuda 300 ""; run test-route-cuda 120 ""; run test-sample-cuda 120 ""
  run test-pdl-cuda 120 ""; run test-kda-cuda 120 ""; run test-kda-decode-cuda 120 "" ) &
( run test-ops-cuda 300 ""; run test-mla-cuda 200 ""; run test-prefill-cuda 200 "" ) &
wait
compare_models
mkdir -p .gpu-carry/bin .gpu-carry/lib && cp $B/perigee .gpu-carry/bin/ && cp .gpu-carry-r1/lib/* .gpu-carry/lib/
OUT=$OUT/smoke timeout 300 bash tools/gpu/serve-smoke.sh > $L/serve-smoke.log 2>&1; rc=$?
echo "[$(( $(date +%s) - T0 ))s] serve-smoke rc=$rc | $(grep -E '^(PASS|FAIL)|serve-smoke:' $L/serve-smoke.log | tr '\n' ' ')" >> $S
D="timeout 200 $B/bench-cuda-decode --steps 20 --no-compare --no-profile"
decode_rounds 2
nvidia-smi --query-gpu=name,driver_version --format=csv >> $S 2>&1
cp $L/compare.log $L/serve-smoke.log $OUT/ 2>/dev/null
tar czf $OUT/logsC.tgz -C $OUT logs && rm -rf $L
cat $S
