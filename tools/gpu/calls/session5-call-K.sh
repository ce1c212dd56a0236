#!/bin/bash
# session 5, call K: fuse_kda_decode on (K 32/64/128), the AttnRes cluster (restored, off) with its corrected test,
# engine tests on the default model (64-wide KDA heads: the fused tail in the engine), compare-backends, timings + profile.
set -u
source tools/gpu/calls/common.sh   # unpack, paths, run()
( run test-runtime-cuda 330 "" ) &
( run test-fuse-cuda 150 ""; run test-ops-cuda 150 ""; run test-kda-decode-cuda 100 "" ) &
( IDS=$(python3 -c 'print(",".join(str((i*37+11)%250) for i in range(70)))')
  for m in models/default models/k31-default tests/golden/kimi_linear/published_form; do
    for ids in "$IDS" "5,9,200"; do timeout 90 $B/perigee compare-backends --model $m --ids "$ids" --decode 6 >> $L/compare.log 2>&1
      echo "[$(( $(date +%s) - T0 ))s] compare $m ($(echo $ids | tr ',' '\n' | wc -l) ids) rc=$? $(grep -E '^compare-backends: (PASS|FAIL)|^error' $L/compare.log | tail -1)" >> $S; done; done ) &
wait
CS=/usr/local/cuda/bin/compute-sanitizer
( timeout 200 $CS --tool memcheck --error-exitcode 9 $B/test-fuse-cuda --gtest_filter='*kda_decode_tail*' > $L/memcheck-kda.log 2>&1; echo "[$(( $(date +%s) - T0 ))s] memcheck kda rc=$? $(grep -E 'ERROR SUMMARY' $L/memcheck-kda.log | tail -1)" >> $S ) &
( timeout 200 $CS --tool racecheck --error-exitcode 9 $B/test-fuse-cuda --gtest_filter='*kda_decode_tail*' > $L/racecheck-kda.log 2>&1; echo "[$(( $(date +%s) - T0 ))s] racecheck kda rc=$? $(grep -E 'RACECHECK SUMMARY' $L/racecheck-kda.log | tail -1)" >> $S ) &
( timeout 200 $CS --tool memcheck --error-exitcode 9 $B/test-ops-cuda --gtest_filter='*attn_res_mix_cluster*' > $L/memcheck-ar.log 2>&1; echo "[$(( $(date +%s) - T0 ))s] memcheck ar rc=$? $(grep -E 'ERROR SUMMARY' $L/memcheck-ar.log | tail -1)" >> $S
  timeout 200 $CS --tool racecheck --error-exitcode 9 $B/test-ops-cuda --gtest_filter='*attn_res_mix_cluster*' > $L/racecheck-ar.log 2>&1; echo "[$(( $(date +%s) - T0 ))s] racecheck ar rc=$? $(grep -E 'RACECHECK SUMMARY' $L/racecheck-ar.log | tail -1)" >> $S ) &
wait
D="timeout 100 $B/bench-cuda-decode --steps 20 --no-compare"
$D --batch 1 --no-profile > $L/dec-def.log 2>&1; echo "[$(( $(date +%s) - T0 ))s] defaults rc=$?" >> $S
$D --batch 1 --no-profile --set attn_res_cluster=1 > $L/dec-arc.log 2>&1; echo "[$(( $(date +%s) - T0 ))s] arc rc=$?" >> $S
$D --batch 1 --preset kimi-linear-48b > $L/prof-48b.log 2>&1; echo "[$(( $(date +%s) - T0 ))s] prof48 rc=$?" >> $S
$D --batch 1 --preset k3-layers-4 --set attn_res_cluster=1 > $L/prof-k3.log 2>&1; echo "[$(( $(date +%s) - T0 ))s] profk3 rc=$?" >> $S
timeout 60 $B/bench-cuda-kernels attnres > $L/kern-ar.log 2>&1; echo "[$(( $(date +%s) - T0 ))s] kern-ar rc=$?" >> $S
for f in $L/dec-*.log; do echo "== $(basename $f)"; grep -E "^(k3-layers-4|kimi-linear-48b) +new|bytes:" $f; done >> $S
grep -E "attnres" $L/kern-ar.log | head -8 >> $S
tar czf $OUT/logsK.tgz -C $OUT logs && rm -rf $L
cat $S
