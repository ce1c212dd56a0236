#!/bin/bash
# session 5, call Q (binaries of a377995, after the kda-step.cuh refactor): compute-sanitizer over the refactored kernels.
set -u
source tools/gpu/calls/common.sh   # unpack, paths, run()
san() { local tool=$1 t=$2 f=$3; timeout 100 /usr/local/cuda/bin/compute-sanitizer --tool $tool --error-exitcode 9 $B/$t --gtest_filter="$f" > $OUT/$tool-$t.log 2>&1
  echo "[$(( $(date +%s) - T0 ))s] $tool $t ($f) rc=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' $OUT/$tool-$t.log | tail -1)" >> $S; rm -f $OUT/$tool-$t.log; }
( san memcheck test-fuse-cuda '*kda_decode_tail*'; san synccheck test-fuse-cuda '*kda_decode_tail*' ) &
( san racecheck test-fuse-cuda '*kda_decode_tail*'; san initcheck test-fuse-cuda '*kda_decode_tail*' ) &
( san memcheck test-kda-decode-cuda '*'; san racecheck test-kda-decode-cuda '*odd_dims*:*backend*'; san memcheck test-ops-cuda '*attn_res*' ) &
wait
cat $S
