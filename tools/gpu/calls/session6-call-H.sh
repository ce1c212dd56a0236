#!/bin/bash
# session 6, call H (run twice: the first run found v7_attr caching per function TYPE, fixed by a per-kernel cache): after the review (helper-49): decode_v6_t1 tests v6 itself again (v7 is the default), the new
# decode_v7_forms_k3 (every v7 form bitwise v6 at K3's shape, eager + graph replays), per-device attribute cache and the
# launchers' own bound checks, alignment checks; shared-slot and KDA-tail tests; B=1 timings.
set -u
source tools/gpu/calls/common.sh   # unpack, paths, run()
( run test-moe-cuda 200 "-dec" --gtest_filter='cuda_moe.decode_v6*:cuda_moe.decode_v7*:cuda_moe.decode_bf16*' ) &
( run test-fuse-cuda 150 "-sel" --gtest_filter='*moe_shared*:*kda_decode*'
  timeout 100 /usr/local/cuda/bin/compute-sanitizer --tool memcheck --error-exitcode 9 $B/test-moe-cuda --gtest_filter='cuda_moe.decode_v6_invalid_ids' > $L/memcheck.log 2>&1
  echo "[$(( $(date +%s) - T0 ))s] memcheck invalid_ids rc=$? $(grep -E 'ERROR SUMMARY' $L/memcheck.log | tail -1)" >> $S ) &
wait
grep -hE "moe-v7/K3|v7-vs-v6|FAIL" $L/test-moe-cuda-dec.log | head -16 >> $S
timeout 100 $B/bench-cuda-decode --steps 20 --no-compare --no-profile --batch 1 > $L/dec-final.log 2>&1; echo "[$(( $(date +%s) - T0 ))s] final rc=$?" >> $S
grep -E "^(k3-layers-4|kimi-linear-48b) +new|bytes:" $L/dec-final.log >> $S
tar czf $OUT/logsH.tgz -C $OUT logs && rm -rf $L
cat $S
