#!/bin/bash
# session 6, call F: the final defaults (moe_decode_v7 on without the removed prefetch forms, moe_shared_slot now ON):
# test-fuse-cuda whole, test-moe-cuda v6/v7 + BF16 decode cases, compare-backends on the goldens and shipped models,
# memcheck on the shared-slot test, then B=1 timings of both presets (defaults twice, engine path).
set -u
source tools/gpu/calls/common.sh   # unpack, paths, run()
( run test-fuse-cuda 200 "" ) &
( run test-moe-cuda 200 "-dec" --gtest_filter='cuda_moe.decode_v6*:cuda_moe.decode_bf16*'
  IDS=$(python3 -c 'print(",".join(str((i*37+11)%250) for i in range(70)))')
  for m in tests/golden/kimi_linear/*/ models/default models/k31-default; do
    timeout 60 $B/perigee compare-backends --model "$m" --ids "$IDS" --decode 6 >> $L/compare.log 2>&1; rc=$?
    echo "[$(( $(date +%s) - T0 ))s] compare $m (70 ids) rc=$rc: $(grep -E '^compare-backends: (PASS|FAIL)|^error' $L/compare.log | tail -1)" >> $S
  done
  timeout 200 /usr/local/cuda/bin/compute-sanitizer --tool memcheck --error-exitcode 9 $B/test-fuse-cuda --gtest_filter='*moe_shared*' > $L/memcheck-shared.log 2>&1
  echo "[$(( $(date +%s) - T0 ))s] memcheck shared rc=$? $(grep -E 'ERROR SUMMARY' $L/memcheck-shared.log | tail -1)" >> $S ) &
wait
D="timeout 100 $B/bench-cuda-decode --steps 20 --no-compare --no-profile --batch 1"
$D > $L/dec-final.log 2>&1; echo "[$(( $(date +%s) - T0 ))s] final rc=$?" >> $S
$D --set graph_decode=1 > $L/dec-engine.log 2>&1; echo "[$(( $(date +%s) - T0 ))s] engine rc=$?" >> $S
$D > $L/dec-final2.log 2>&1; echo "[$(( $(date +%s) - T0 ))s] final2 rc=$?" >> $S
for f in $L/dec-*.log; do echo "== $(basename $f)"; grep -E "^(k3-layers-4|kimi-linear-48b) +new|bytes:" $f; grep -E "error|Error" $f | head -3; done >> $S
tar czf $OUT/logsF.tgz -C $OUT logs && rm -rf $L
cat $S
