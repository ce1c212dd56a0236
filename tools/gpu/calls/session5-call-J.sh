#!/bin/bash
# session 5, call J: the fused KDA decode tail (fuse_kda_decode): parity, sanitizers, then timings on/off.
set -u
source tools/gpu/calls/common.sh   # unpack, paths, run()
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > $L/gpu.txt 2>&1
( run test-fuse-cuda 150 "" ) &
( run test-kda-decode-cuda 120 "" ) &
( run test-ops-cuda 120 "" ) &
wait
CS=/usr/local/cuda/bin/compute-sanitizer
( timeout 200 $CS --tool memcheck --error-exitcode 9 $B/test-fuse-cuda --gtest_filter='*kda_decode_tail*' > $L/memcheck-kda.log 2>&1; echo "[$(( $(date +%s) - T0 ))s] memcheck rc=$? $(grep -E 'ERROR SUMMARY' $L/memcheck-kda.log | tail -1)" >> $S ) &
( timeout 200 $CS --tool racecheck --error-exitcode 9 $B/test-fuse-cuda --gtest_filter='*kda_decode_tail*' > $L/racecheck-kda.log 2>&1; echo "[$(( $(date +%s) - T0 ))s] racecheck rc=$? $(grep -E 'RACECHECK SUMMARY|ERROR SUMMARY' $L/racecheck-kda.log | tail -1)" >> $S ) &
wait
D="timeout 100 $B/bench-cuda-decode --steps 20 --no-compare --no-profile"
$D --batch 1 --set fuse_kda_decode=0 > $L/dec-off.log 2>&1; echo "[$(( $(date +%s) - T0 ))s] off rc=$?" >> $S
$D --batch 1 --set fuse_kda_decode=1 > $L/dec-on.log 2>&1; echo "[$(( $(date +%s) - T0 ))s] on rc=$?" >> $S
$D --batch 1,64 --set fuse_kda_decode=1,graph_decode=1 > $L/dec-on-engine.log 2>&1; echo "[$(( $(date +%s) - T0 ))s] on+engine rc=$?" >> $S
for f in $L/dec-*.log; do echo "== $(basename $f)"; grep -E "^(k3-layers-4|kimi-linear-48b) +new|bytes:|fuse_kda" $f; done >> $S
tar czf $OUT/logsJ.tgz -C $OUT logs && rm -rf $L
cat $S
