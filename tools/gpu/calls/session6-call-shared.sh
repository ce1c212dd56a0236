#!/bin/bash
# session 6, call "shared": the shared expert as a ninth slot of the BF16 decode experts (cuda_options::moe_shared_slot,
# off by default): the new tests (graph level in test-fuse-cuda, kernel level in test-moe-cuda, with the BF16 decode cases
# it extends), the engine tests, compare-backends with the switch on (the tiny models and goldens are outside the kernel's
# widths: it must report 0 shared-slot launches there and still PASS), memcheck/racecheck on the new cases, then the 48B
# timings with the switch off and on (same binary) and the engine's graph-replayed step with it on.
# Binaries (pack.sh from the CUDA build): test-fuse-cuda test-moe-cuda test-runtime-cuda bench-cuda-decode perigee
set -u
source tools/gpu/calls/common.sh   # unpack, paths, run()
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > $L/gpu.txt 2>&1
( run test-fuse-cuda 200 "-shared" --gtest_filter='*moe_shared*'; run test-fuse-cuda 200 "" ) &
( run test-moe-cuda 200 "-shared" --gtest_filter='*decode_bf16*' ) &
( run test-runtime-cuda 340 ""
  mkdir -p /tmp/pg-models; $B/perigee synth --preset kimi-linear-tiny --out /tmp/pg-models/kimi-linear-tiny > /dev/null 2>&1
  IDS=$(python3 -c 'print(",".join(str((i*37+11)%250) for i in range(70)))')
  for m in tests/golden/kimi_linear/*/ /tmp/pg-models/kimi-linear-tiny/; do
    for ids in "$IDS" "5,9,200"; do
      timeout 60 $B/perigee compare-backends --model "$m" --ids "$ids" --decode 6 --moe-shared-slot 1 >> $L/compare.log 2>&1; rc=$?
      echo "[$(( $(date +%s) - T0 ))s] compare $m ($(echo $ids | tr ',' '\n' | wc -l) ids, moe_shared_slot 1) rc=$rc: $(grep -E '^compare-backends: (PASS|FAIL)|^error' $L/compare.log | tail -1) | $(grep -E 'MOE_EXPERTS launches with the shared' $L/compare.log | tail -1)" >> $S
    done
  done ) &
wait
echo "[$(( $(date +%s) - T0 ))s] parity done" >> $S
grep -E "bitwise fused == unfused|routed y vs|invalid-ids\]|invalid arguments|refusal|control" $L/test-fuse-cuda-shared.log $L/test-moe-cuda-shared.log | grep -vE "PASSED - BAD|ACCEPTED|NOT caught" | wc -l | sed 's/^/  control\/bitwise lines: /' >> $S
grep -hE "PASSED - BAD|ACCEPTED: FAIL|DIFFERS|NO$|CHANGED: FAIL|FOLDED: FAIL" $L/test-fuse-cuda-shared.log $L/test-moe-cuda-shared.log | head -5 >> $S
CS=/usr/local/cuda/bin/compute-sanitizer
( timeout 300 $CS --tool memcheck --error-exitcode 9 $B/test-fuse-cuda --gtest_filter='*moe_shared_slot*' > $L/memcheck-fuse.log 2>&1; echo "[$(( $(date +%s) - T0 ))s] memcheck fuse rc=$? $(grep -E 'ERROR SUMMARY' $L/memcheck-fuse.log | tail -1)" >> $S ) &
( timeout 300 $CS --tool memcheck --error-exitcode 9 $B/test-moe-cuda --gtest_filter='*decode_bf16_shared_direct*' > $L/memcheck-moe.log 2>&1; echo "[$(( $(date +%s) - T0 ))s] memcheck moe rc=$? $(grep -E 'ERROR SUMMARY' $L/memcheck-moe.log | tail -1)" >> $S ) &
wait
( timeout 300 $CS --tool racecheck --error-exitcode 9 $B/test-moe-cuda --gtest_filter='*decode_bf16_shared_direct*' > $L/racecheck-moe.log 2>&1; echo "[$(( $(date +%s) - T0 ))s] racecheck moe rc=$? $(grep -E 'RACECHECK SUMMARY|ERROR SUMMARY' $L/racecheck-moe.log | tail -1)" >> $S )
D="timeout 100 $B/bench-cuda-decode --steps 20 --no-compare --no-profile --preset kimi-linear-48b"
$D --batch 1 --set moe_shared_slot=0 > $L/dec-off.log 2>&1; echo "[$(( $(date +%s) - T0 ))s] off rc=$?" >> $S
$D --batch 1 --set moe_shared_slot=1 > $L/dec-on.log 2>&1; echo "[$(( $(date +%s) - T0 ))s] on rc=$?" >> $S
$D --batch 1 --set moe_shared_slot=0 > $L/dec-off2.log 2>&1; echo "[$(( $(date +%s) - T0 ))s] off2 rc=$?" >> $S
$D --batch 1 --set moe_shared_slot=1 > $L/dec-on2.log 2>&1; echo "[$(( $(date +%s) - T0 ))s] on2 rc=$?" >> $S
$D --batch 1 --set moe_shared_slot=1,graph_decode=1 > $L/dec-on-engine.log 2>&1; echo "[$(( $(date +%s) - T0 ))s] on+engine rc=$?" >> $S
$D --batch 1 --set moe_shared_slot=0,graph_decode=1 > $L/dec-off-engine.log 2>&1; echo "[$(( $(date +%s) - T0 ))s] off+engine rc=$?" >> $S
for f in $L/dec-*.log; do echo "== $(basename $f)"; grep -E "^kimi-linear-48b +new|bytes:" $f; grep -E "error|Error" $f | head -3; done >> $S
tar czf $OUT/logs-shared.tgz -C $OUT logs && rm -rf $L
cat $S
