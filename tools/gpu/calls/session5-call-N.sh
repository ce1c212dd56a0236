#!/bin/bash
# session 5, call N: after the review fixes — test-fuse-cuda (KDA tail incl. rank != K, guard over the folded nodes),
# test-ops-cuda (attn_res forms with the cluster off, the cluster vs the real chunked form), compare-backends (the folded
# KDA intermediates now compared on decode steps: outputs compared per decode step = per prefill step).
set -u
source tools/gpu/calls/common.sh   # unpack, paths, run()
( run test-fuse-cuda 150 "" ) &
( run test-ops-cuda 150 "" ) &
( IDS=$(python3 -c 'print(",".join(str((i*37+11)%250) for i in range(70)))')
  for m in models/default models/k31-default tests/golden/kimi_linear/published_form; do
    timeout 90 $B/perigee compare-backends --model $m --ids "$IDS" --decode 6 >> $L/compare.log 2>&1; rc=$?
    echo "[$(( $(date +%s) - T0 ))s] compare $m rc=$rc $(grep -E '^compare-backends: (PASS|FAIL)|^error' $L/compare.log | tail -1)" >> $S; done
  grep -E "outputs compared" $L/compare.log | sed 's/, worst.*//' >> $S ) &
wait
grep -E "attn_res_cluster.*(vs-chunked|bitwise)" $L/test-ops-cuda.log | head -12 >> $S
grep -E "kda_tail/.*/R(64|128)/.*fused_kda" $L/test-fuse-cuda.log >> $S
tar czf $OUT/logsN.tgz -C $OUT logs && rm -rf $L
cat $S
