#!/bin/bash
# session 8, call D: fuse_norm_route (on by default in this tree): the router's logits as one more segment of the
# norm's staged launch (fuse-plan.h rule 1). test-fuse-cuda (norm_into_router: CPU parity, ids exact, counters, controls;
# the planner), the other CUDA test binaries, compare-backends on the goldens / tiny / default models, then decode B=1
# on both presets with the rule on / off (same binary, two rounds), B 8 / 64 with the defaults.
set -u
source tools/gpu/calls/common.sh   # unpack, paths, run()
( run test-fuse-cuda 240 ""; run test-route-cuda 200 "" ) &
( run test-ops-cuda 300 ""; run test-runtime-cuda 240 "" ) &
( IDS=$(python3 -c 'print(",".join(str((i*37+11)%250) for i in range(70)))')
  mkdir -p /tmp/pg-models; for p in k3-tiny kimi-linear-tiny; do $B/perigee synth --preset $p --out /tmp/pg-models/$p > /dev/null 2>&1; done
  for m in tests/golden/kimi_linear/*/ /tmp/pg-models/*/ models/default models/k31-default; do
    timeout 60 $B/perigee compare-backends --model "$m" --ids "$IDS" --decode 6 >> $L/compare.log 2>&1; rc=$?
    echo "[$(( $(date +%s) - T0 ))s] compare $m (70 ids) rc=$rc: $(grep -E '^compare-backends: (PASS|FAIL)|^error' $L/compare.log | tail -1)" >> $S
  done ) &
wait
echo "[$(( $(date +%s) - T0 ))s] parity done" >> $S
grep -hE "norm_route.*(ids vs CPU|PASS|FAIL)|NOT caught" $L/test-fuse-cuda.log | grep -v "must FAIL" | head -16 >> $S
D="timeout 100 $B/bench-cuda-decode --steps 30 --no-compare --no-profile"
for round in 1 2; do
  for cfg in "fuse_norm_route=0" "fuse_norm_route=1"; do
    $D --batch 1 --set $cfg > $L/dec-$cfg-$round.log 2>&1
    echo "[$(( $(date +%s) - T0 ))s] $cfg r$round rc=$? | $(grep -E '^(k3-layers-4|kimi-linear-48b) +new' $L/dec-$cfg-$round.log | awk '{print $1, $5, $8}' | tr '\n' ' ')" >> $S
  done
done
$D --batch 1,8,64 > $L/dec-final.log 2>&1; echo "[$(( $(date +%s) - T0 ))s] decode rc=$?" >> $S
$D --batch 1 --set graph_decode=1 > $L/dec-engine.log 2>&1; echo "[$(( $(date +%s) - T0 ))s] engine rc=$?" >> $S
for f in $L/dec-final.log $L/dec-engine.log; do echo "== $(basename $f)"; grep -E "^(k3-layers-4|kimi-linear-48b) +new|bytes:" $f; grep -E "error|Error" $f | head -3; done >> $S
nvidia-smi --query-gpu=name,driver_version --format=csv >> $S 2>&1
tar czf $OUT/logsD.tgz -C $OUT logs && rm -rf $L
cat $S
