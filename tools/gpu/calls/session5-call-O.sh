#!/bin/bash
# session 5, call O: after the refactors (one KDA token step for v2 and the fused tail, one softmax for the AttnRes mixes,
# bench-kernels graph_us): the tests that cover them, compare-backends, the engine tests, timings (no regression expected).
set -u
source tools/gpu/calls/common.sh   # unpack, paths, run()
( run test-runtime-cuda 300 "" ) &
( run test-fuse-cuda 150 ""; run test-kda-decode-cuda 60 "" ) &
( run test-ops-cuda 150 ""
  IDS=$(python3 -c 'print(",".join(str((i*37+11)%250) for i in range(70)))')
  for m in models/default models/k31-default; do
    timeout 90 $B/perigee compare-backends --model $m --ids "$IDS" --decode 6 >> $L/compare.log 2>&1; rc=$?
    echo "[$(( $(date +%s) - T0 ))s] compare $m rc=$rc $(grep -E '^compare-backends: (PASS|FAIL)|^error' $L/compare.log | tail -1)" >> $S; done ) &
wait
grep -E "bitwise fused" $L/test-fuse-cuda.log >> $S
D="timeout 100 $B/bench-cuda-decode --steps 20 --no-compare --no-profile"
$D --batch 1 > $L/dec-final.log 2>&1; echo "[$(( $(date +%s) - T0 ))s] final rc=$?" >> $S
timeout 60 $B/bench-cuda-kernels attnres > $L/kern-ar.log 2>&1; echo "[$(( $(date +%s) - T0 ))s] kern-ar rc=$?" >> $S
for f in $L/dec-*.log; do echo "== $(basename $f)"; grep -E "^(k3-layers-4|kimi-linear-48b) +new|bytes:" $f; done >> $S
grep attnres $L/kern-ar.log | head -3 >> $S
tar czf $OUT/logsO.tgz -C $OUT logs && rm -rf $L
cat $S
