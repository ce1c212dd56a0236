#!/bin/bash
# session 8, call H: the fused KDA decode tail reads the state, the conv histories and its rows' dt_bias before the PDL
# wait (into registers; the first form prefetched the state into L2 and read the rest after the wait): the KDA tail
# tests (bitwise the unfused kernels with f and z given, CPU parity, controls), test-kda-decode-cuda, the engine tests
# (state carried over steps, graph replays), compare-backends, memcheck / racecheck on the tail, decode B=1 twice.
set -u
source tools/gpu/calls/common.sh   # unpack, paths, run()
san() { local tool=$1 t=$2 f=$3 to=$4; local s=$(date +%s); timeout $to /usr/local/cuda/bin/compute-sanitizer --tool $tool --error-exitcode 9 $B/$t --gtest_filter="$f" > $L/$tool-$t.log 2>&1
  echo "[$(( $(date +%s) - T0 ))s] $tool $t ($f) rc=$? $(( $(date +%s) - s ))s $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|SYNCCHECK SUMMARY' $L/$tool-$t.log | tail -1)" >> $S; }
( run test-fuse-cuda 200 "-kda" --gtest_filter='*kda_decode*'; run test-kda-decode-cuda 100 "" ) &
( run test-runtime-cuda 240 "" ) &
( IDS=$(python3 -c 'print(",".join(str((i*37+11)%250) for i in range(70)))')
  mkdir -p /tmp/pg-models; for p in k3-tiny kimi-linear-tiny; do $B/perigee synth --preset $p --out /tmp/pg-models/$p > /dev/null 2>&1; done
  for m in tests/golden/kimi_linear/*/ /tmp/pg-models/*/ models/default models/k31-default; do
    timeout 60 $B/perigee compare-backends --model "$m" --ids "$IDS" --decode 6 >> $L/compare.log 2>&1; rc=$?
    echo "[$(( $(date +%s) - T0 ))s] compare $m (70 ids) rc=$rc: $(grep -E '^compare-backends: (PASS|FAIL)|^error' $L/compare.log | tail -1)" >> $S
  done ) &
( sleep 20; san memcheck test-fuse-cuda '*kda_decode_tail*' 150; san racecheck test-fuse-cuda '*kda_decode_tail*' 150 ) &
wait
grep -hE "bitwise fused == unfused|NOT caught" $L/test-fuse-cuda-kda.log | head -6 >> $S
D="timeout 100 $B/bench-cuda-decode --steps 30 --no-compare --no-profile"
for round in 1 2; do
  $D --batch 1 > $L/dec-$round.log 2>&1
  echo "[$(( $(date +%s) - T0 ))s] defaults r$round rc=$? | $(grep -E '^(k3-layers-4|kimi-linear-48b) +new' $L/dec-$round.log | awk '{print $1, $5, $8}' | tr '\n' ' ')" >> $S
done
nvidia-smi --query-gpu=name,driver_version --format=csv >> $S 2>&1
tar czf $OUT/logsH.tgz -C $OUT logs && rm -rf $L
cat $S
