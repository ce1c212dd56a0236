#!/bin/bash
# session 7, call D: the tensor-core stages now run before the GEMV stages (call C: small_v4_batch caught v3 / v4's
# plane scratch clobbering the GEMV experts' rows when both ran in one step); v4 with fewer instructions per scale block
# (descriptor low words per tile, the E8M0 scale by a max). Every MoE / prefill / runtime CUDA test, compare-backends on
# the goldens, the synth models and the shipped models (300-token prompts: prefill-sized steps), compute-sanitizer over
# the mixed shapes, k3-layers-4 prefill, the SASS of k_moe_mma4 (instruction mix of the main loop).
set -u
source tools/gpu/calls/common.sh   # unpack, paths, run()
CS=/usr/local/cuda/bin/compute-sanitizer
( run test-moe-cuda 400 "" ) &
( run test-prefill-cuda 120 ""; run test-runtime-cuda 340 "" ) &
( mkdir -p /tmp/pg-models; for p in k3-tiny k31-tiny kimi-linear-tiny; do $B/perigee synth --preset $p --out /tmp/pg-models/$p > /dev/null 2>&1; done
  IDS=$(python3 -c 'print(",".join(str((i*37+11)%250) for i in range(300)))')
  for m in tests/golden/kimi_linear/*/ /tmp/pg-models/*/ models/default models/k31-default; do
    timeout 90 $B/perigee compare-backends --model "$m" --ids "$IDS" --decode 4 >> $L/compare.log 2>&1; rc=$?
    echo "[$(( $(date +%s) - T0 ))s] compare $m (300 ids) rc=$rc: $(grep -E '^compare-backends: (PASS|FAIL)|^error' $L/compare.log | tail -1)" >> $S
  done
  MOE_V4_SMALL=1 timeout 300 $CS --tool memcheck --error-exitcode 9 $B/test-moe-cuda --gtest_filter='cuda_moe.mma_v4_prefill' > $L/memcheck-v4.log 2>&1; echo "[$(( $(date +%s) - T0 ))s] memcheck v4 rc=$? $(grep -E 'ERROR SUMMARY' $L/memcheck-v4.log | tail -1)" >> $S ) &
wait
P="timeout 150 $B/bench-cuda-decode --preset k3-layers-4 --prefill 512,2048"
$P > $L/prefill.log 2>&1; echo "[$(( $(date +%s) - T0 ))s] prefill rc=$?" >> $S
$P --set moe_mma_v4=0 > $L/prefill-v3.log 2>&1; echo "[$(( $(date +%s) - T0 ))s] prefill v3 rc=$?" >> $S
/usr/local/cuda/bin/cuobjdump -sass -fun k_moe_mma4 $B/bench-cuda-decode > $L/sass-v4.txt 2>&1 || /usr/local/cuda/bin/cuobjdump -sass $B/bench-cuda-decode 2>/dev/null | awk '/Function : .*k_moe_mma4/,/\.L_x_[0-9]+:$/ {print}' > $L/sass-v4.txt
echo "[$(( $(date +%s) - T0 ))s] sass lines $(wc -l < $L/sass-v4.txt)" >> $S
grep -E "mma-v(3|4).*(T24|launches 0)|NOT caught|FAIL" $L/test-moe-cuda.log | grep -v "must FAIL" | head -30 >> $S
for f in $L/prefill*.log; do echo "== $(basename $f)"; grep -E "^prefill|GEMM share|MOE_EXPERTS|LINEAR|FAILED|rror" $f; done >> $S
cp $L/sass-v4.txt $OUT/ 2>/dev/null
tar czf $OUT/logsD.tgz -C $OUT logs && rm -rf $L
cat $S
