#!/bin/bash
# session 6, call G: the fused KDA decode tail as a cluster of K / 32 blocks per head (kda-fused-decode.cu): its test
# (bitwise the unfused kernels with f and z given, CPU parity, controls), the engine tests (the default model's 64-wide
# heads: clusters of 2), compare-backends, memcheck / racecheck / synccheck, then B=1 timings with the per-op profile
# and fuse_kda_decode off as the same-binary reference.
set -u
source tools/gpu/calls/common.sh   # unpack, paths, run()
san() { local tool=$1 t=$2 f=$3 to=$4; local s=$(date +%s); timeout $to /usr/local/cuda/bin/compute-sanitizer --tool $tool --error-exitcode 9 $B/$t --gtest_filter="$f" > $L/$tool-$t.log 2>&1
  echo "[$(( $(date +%s) - T0 ))s] $tool $t ($f) rc=$? $(( $(date +%s) - s ))s $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|SYNCCHECK SUMMARY' $L/$tool-$t.log | tail -1)" >> $S; }
( run test-runtime-cuda 240 "" ) &
( run test-fuse-cuda 120 "-kda" --gtest_filter='*kda_decode*'; run test-kda-decode-cuda 60 ""
  IDS=$(python3 -c 'print(",".join(str((i*37+11)%250) for i in range(70)))')
  mkdir -p /tmp/pg-models; for p in k3-tiny kimi-linear-tiny; do $B/perigee synth --preset $p --out /tmp/pg-models/$p > /dev/null 2>&1; done
  for m in tests/golden/kimi_linear/*/ /tmp/pg-models/*/ models/default models/k31-default; do
    timeout 60 $B/perigee compare-backends --model "$m" --ids "$IDS" --decode 6 >> $L/compare.log 2>&1; rc=$?
    echo "[$(( $(date +%s) - T0 ))s] compare $m (70 ids) rc=$rc: $(grep -E '^compare-backends: (PASS|FAIL)|^error' $L/compare.log | tail -1)" >> $S
  done ) &
( sleep 20; san memcheck test-fuse-cuda '*kda_decode_tail*' 150; san racecheck test-fuse-cuda '*kda_decode_tail*' 150; san synccheck test-fuse-cuda '*kda_decode_tail*' 150 ) &
wait
echo "[$(( $(date +%s) - T0 ))s] parity done" >> $S
grep -hE "bitwise|NOT caught|DIFFERS|FAIL" $L/test-fuse-cuda-kda.log | head -12 >> $S
D="timeout 100 $B/bench-cuda-decode --steps 20 --no-compare --batch 1"
$D > $L/dec-prof.log 2>&1; echo "[$(( $(date +%s) - T0 ))s] defaults+profile rc=$?" >> $S
$D --no-profile --set fuse_kda_decode=0 > $L/dec-nofuse.log 2>&1; echo "[$(( $(date +%s) - T0 ))s] unfused rc=$?" >> $S
$D --no-profile > $L/dec-final.log 2>&1; echo "[$(( $(date +%s) - T0 ))s] final rc=$?" >> $S
for f in $L/dec-*.log; do echo "== $(basename $f)"; grep -E "^(k3-layers-4|kimi-linear-48b) +new|bytes:" $f; grep -E "error|Error" $f | head -3; done >> $S
grep -E "per-op GPU time|GATED_RMS_NORM|MOE_EXPERTS|KDA" $L/dec-prof.log | head -12 >> $S
tar czf $OUT/logsG.tgz -C $OUT logs && rm -rf $L
cat $S
