#!/bin/bash
# session 17, call B (call A again after the kernel took (32-row group, K slice) work items per warp with split-K across
# blocks, session 17 call A having measured the block-local form slower than the FP32 kernels at 3 tokens): the tensor-core GEMV (cuda_options::gemv_mma_min_tokens, linear.cu "GEMV on the tensor cores"),
# default 3. Predicted before this run: k3-layers-4 B=3 ~3.3 ms (call A: 4.10 mma, 3.61 off, 3.40 cuBLASLt), B=8 ~4.5 ms;
# 48B B=3 ~4.6 ms, B=8 ~8.3 ms. (Call A's prediction: k3 B=4 4.40 -> ~3.3 ms, B=8 7.25 -> ~4.5 ms;
# 48B B=8 10.8 -> ~8.5 ms.) First the decode sweep at B = 2..8 (same binary): mma from 3 tokens (the
# default), from 2, off (the FP32 GEMV kernels, session 16's default), and off with the 3..8-token LINEARs on cuBLASLt
# (gemv_max_tokens 2, session 16 calls G/H's alternative); then every CUDA test binary on the new default, memcheck and
# racecheck on the wide-GEMV test (the mma kernel at T = 8; call B: split-K partials in global scratch), compare-backends on the 9
# models, the serve smoke CPU vs CUDA, decode rounds at B = 1 / 8 / 64.
set -u
source tools/gpu/calls/common.sh
D="timeout 200 $B/bench-cuda-decode --steps 20 --no-compare --no-profile"
for p in k3-layers-4 kimi-linear-48b; do
  for v in "mma3:gemv_mma_min_tokens=3" "mma2:gemv_mma_min_tokens=2" "off:gemv_mma_min_tokens=0" "cublas:gemv_mma_min_tokens=0,gemv_max_tokens=2"; do
    tag=${v%%:*}; sets=${v#*:}
    $D --preset $p --batch 2,3,4,5,6,8 --set $sets > $L/d-$p-$tag.log 2>&1; rc=$?
    echo "[$(( $(date +%s) - T0 ))s] $p $tag rc=$rc | $(grep -E "^$p +new" $L/d-$p-$tag.log | awk '{print $3, $5, $9}' | tr '\n' ' ')" >> $S
  done
done
( run test-moe-cuda 420 "" ) &
( run test-fuse-cuda 300 ""; run test-runtime-cuda 300 ""; run test-route-cuda 120 ""; run test-sample-cuda 120 ""
  run test-pdl-cuda 120 ""; run test-kda-cuda 120 ""; run test-kda-decode-cuda 120 "" ) &
( run test-ops-cuda 300 ""; run test-mla-cuda 200 ""; run test-prefill-cuda 200 ""
  san memcheck test-ops-cuda 'cuda_ops.linear_wide_gemv_fusions_off_and_on' 120
  san racecheck test-ops-cuda 'cuda_ops.linear_wide_gemv_fusions_off_and_on' 120 ) &
wait
grep -E '^\[gemv\]|tensor-core|one bf16 part|mma' $L/test-ops-cuda.log | grep -v 'worst NMSE' | head -40 > $OUT/ops-mma-lines.txt
grep -E 'mma.*worst NMSE' $L/test-ops-cuda.log > $OUT/ops-mma-nmse.txt
compare_models
mkdir -p .gpu-carry/bin .gpu-carry/lib && cp $B/perigee .gpu-carry/bin/ && cp .gpu-carry-r1/lib/* .gpu-carry/lib/
OUT=$OUT/smoke timeout 300 bash tools/gpu/serve-smoke.sh > $L/serve-smoke.log 2>&1; rc=$?
echo "[$(( $(date +%s) - T0 ))s] serve-smoke rc=$rc | $(grep -E '^(PASS|FAIL)|serve-smoke:' $L/serve-smoke.log | tr '\n' ' ')" >> $S
D="timeout 200 $B/bench-cuda-decode --steps 20 --no-compare --no-profile"
decode_rounds 2
nvidia-smi --query-gpu=name,driver_version --format=csv >> $S 2>&1
cp $L/compare.log $L/serve-smoke.log $OUT/ 2>/dev/null
tar czf $OUT/logsB.tgz -C $OUT logs && rm -rf $L
cat $S
