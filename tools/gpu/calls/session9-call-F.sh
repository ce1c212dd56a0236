#!/bin/bash
# session 9, call F: the final tree (a4d5aa3: mla_attn_v4, moe_bf16_early 1 with h / act by __ldcg): compare-backends on
# every model, test-fuse-cuda, test-mla-cuda, then batches 1/8/64 of both presets twice and the default timeline.
set -u
source tools/gpu/calls/common.sh   # unpack, paths, run()
( run test-fuse-cuda 200 ""; run test-mla-cuda 200 "" ) &
( IDS=$(python3 -c 'print(",".join(str((i*37+11)%250) for i in range(70)))')
  mkdir -p /tmp/pg-models; for p in k3-tiny kimi-linear-tiny k31-tiny; do $B/perigee synth --preset $p --out /tmp/pg-models/$p > /dev/null 2>&1; done
  for m in tests/golden/kimi_linear/*/ /tmp/pg-models/*/ models/default models/k31-default; do
    timeout 60 $B/perigee compare-backends --model "$m" --ids "$IDS" --decode 6 >> $L/compare.log 2>&1; rc=$?
    echo "[$(( $(date +%s) - T0 ))s] compare $m (70 ids) rc=$rc: $(grep -E '^compare-backends: (PASS|FAIL)|^error' $L/compare.log | tail -1)" >> $S
  done ) &
wait
D="timeout 150 $B/bench-cuda-decode --steps 30 --no-compare --no-profile"
for round in 1 2; do
  $D --batch 1,8,64 > $L/dec-$round.log 2>&1
  echo "[$(( $(date +%s) - T0 ))s] r$round rc=$? | $(grep -E '^(k3-layers-4|kimi-linear-48b) +new' $L/dec-$round.log | awk '{print $1, $3, $5, $6, $9}' | tr '\n' ' ')" >> $S
done
$D --batch 1 --timeline 6 > $L/tl-default.log 2>&1
echo "[$(( $(date +%s) - T0 ))s] timeline rc=$? | $(grep -E '^kernel timeline' $L/tl-default.log | sed 's/6 replays.*span (first start .. last end) median/span/; s/, gap to.*untraced graph step/ untraced/' | tr '\n' ' ')" >> $S
cp $L/tl-default.log $OUT/ 2>/dev/null
nvidia-smi --query-gpu=name,driver_version --format=csv >> $S 2>&1
tar czf $OUT/logsF.tgz -C $OUT logs && rm -rf $L
cat $S
