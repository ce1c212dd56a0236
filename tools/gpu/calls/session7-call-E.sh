#!/bin/bash
# session 7, call E: compare-backends with the MOE_ROUTE near-tie rule (call D: models/k31-default with a 300-token
# prompt failed on 2 router picks at layer 4, greedy tokens identical) on every model at 300 and 70 tokens; the SASS
# of k_moe_mma4 (the instruction mix of v4's main loop).
set -u
source tools/gpu/calls/common.sh   # unpack, paths, run()
mkdir -p /tmp/pg-models; for p in k3-tiny k31-tiny kimi-linear-tiny; do $B/perigee synth --preset $p --out /tmp/pg-models/$p > /dev/null 2>&1; done
( for n in 300 70; do
    IDS=$(python3 -c "print(','.join(str((i*37+11)%250) for i in range($n)))")
    for m in models/k31-default models/default /tmp/pg-models/k31-tiny /tmp/pg-models/k3-tiny; do
      timeout 90 $B/perigee compare-backends --model "$m" --ids "$IDS" --decode 4 > $L/compare-$(basename $m)-$n.log 2>&1; rc=$?
      echo "[$(( $(date +%s) - T0 ))s] compare $m ($n ids) rc=$rc: $(grep -E '^compare-backends: (PASS|FAIL)|^error' $L/compare-$(basename $m)-$n.log | tail -1)" >> $S
    done
  done ) &
( for m in tests/golden/kimi_linear/*/ /tmp/pg-models/kimi-linear-tiny; do
    IDS=$(python3 -c "print(','.join(str((i*37+11)%250) for i in range(300)))")
    timeout 90 $B/perigee compare-backends --model "$m" --ids "$IDS" --decode 4 > $L/compare-$(basename $m).log 2>&1; rc=$?
    echo "[$(( $(date +%s) - T0 ))s] compare $m (300 ids) rc=$rc: $(grep -E '^compare-backends: (PASS|FAIL)|^error' $L/compare-$(basename $m).log | tail -1)" >> $S
  done ) &
/usr/local/cuda/bin/cuobjdump -sass $B/bench-cuda-decode 2>/dev/null | awk '/Function : .*k_moe_mma4/ {p=1} /Function : / && !/k_moe_mma4/ {p=0} p' > $L/sass-v4.txt
echo "[$(( $(date +%s) - T0 ))s] sass lines $(wc -l < $L/sass-v4.txt)" >> $S
wait
grep -hE "MOE_ROUTE|control:|near tie|DECIDED|near ties" $L/compare-k31-default-300.log | head -20 >> $S
cp $L/sass-v4.txt $OUT/ 2>/dev/null
tar czf $OUT/logsE.tgz -C $OUT logs && rm -rf $L
cat $S
