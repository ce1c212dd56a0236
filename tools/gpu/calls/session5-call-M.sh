#!/bin/bash
# session 5, call M (same binaries as call L): test-moe-cuda whole (call L cut it at 150 s), synccheck + initcheck on the new kernels.
set -u
source tools/gpu/calls/common.sh   # unpack, paths, run()
san() { local tool=$1 t=$2 f=$3 to=$4; local s=$(date +%s); timeout $to /usr/local/cuda/bin/compute-sanitizer --tool $tool --error-exitcode 9 $B/$t --gtest_filter="$f" > $L/$tool-$t.log 2>&1
  echo "[$(( $(date +%s) - T0 ))s] $tool $t ($f) rc=$? $(( $(date +%s) - s ))s $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|SYNCCHECK SUMMARY' $L/$tool-$t.log | tail -1)" >> $S; }
( run test-moe-cuda 480 "" ) &
( san synccheck test-fuse-cuda '*kda_decode_tail*' 200; san initcheck test-fuse-cuda '*kda_decode_tail*' 200
  san synccheck test-ops-cuda '*attn_res_mix_cluster*' 200; san initcheck test-ops-cuda '*attn_res_mix_cluster*' 200 ) &
wait
tar czf $OUT/logsM.tgz -C $OUT logs && rm -rf $L
cat $S
