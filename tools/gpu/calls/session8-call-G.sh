#!/bin/bash
# session 8, call G: compare-backends after its near-tie bookkeeping was shared between INDEXER_TOPK and MOE_ROUTE (one
# verdict type, one control helper, one settle step): every model at 300 and 70 tokens as in session 7 call E (which
# found the router near tie on models/k31-default at 300 tokens), the controls' lines and the near-tie lines kept.
# (the control count first used bc, absent on the GPU machine; wc -l replaced it after the call)
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
wait
grep -hE "MOE_ROUTE|INDEXER_TOPK|control:|near tie|DECIDED" $L/compare-k31-default-300.log | head -24 >> $S
grep -hE "control: decided, FAILS as it must" $L/compare-*.log | wc -l | sed "s/^/controls decided (all logs): /" >> $S
tar czf $OUT/logsG.tgz -C $OUT logs && rm -rf $L
cat $S
