#!/bin/bash
# session 8, call E: fuse_norm_route restricted to norms folded into LINEARs (the 48B router-alone form was neutral in
# call D): test-fuse-cuda (norm_into_router with the corrected expectations), memcheck on it, compare-backends on the
# tiny / default models, decode B=1 on both presets with the rule on / off (two rounds), B 1/8/64 defaults, engine path.
set -u
source tools/gpu/calls/common.sh   # unpack, paths, run()
san() { local tool=$1 t=$2 f=$3 to=$4; local s=$(date +%s); timeout $to /usr/local/cuda/bin/compute-sanitizer --tool $tool --error-exitcode 9 $B/$t --gtest_filter="$f" > $L/$tool-$t.log 2>&1
  echo "[$(( $(date +%s) - T0 ))s] $tool $t ($f) rc=$? $(( $(date +%s) - s ))s $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|SYNCCHECK SUMMARY' $L/$tool-$t.log | tail -1)" >> $S; }
( run test-fuse-cuda 240 "" ) &
( san memcheck test-fuse-cuda 'cuda_fuse.norm_into_router' 200 ) &
( IDS=$(python3 -c 'print(",".join(str((i*37+11)%250) for i in range(70)))')
  mkdir -p /tmp/pg-models; for p in k3-tiny kimi-linear-tiny; do $B/perigee synth --preset $p --out /tmp/pg-models/$p > /dev/null 2>&1; done
  for m in tests/golden/kimi_linear/basic/ /tmp/pg-models/*/ models/default models/k31-default; do
    timeout 60 $B/perigee compare-backends --model "$m" --ids "$IDS" --decode 6 >> $L/compare.log 2>&1; rc=$?
    echo "[$(( $(date +%s) - T0 ))s] compare $m (70 ids) rc=$rc: $(grep -E '^compare-backends: (PASS|FAIL)|^error' $L/compare.log | tail -1)" >> $S
  done ) &
wait
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
tar czf $OUT/logsE.tgz -C $OUT logs && rm -rf $L
cat $S
