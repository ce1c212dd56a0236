#!/bin/bash
# session 6, call A: MXFP4 decode v7 (cuda_options::moe_decode_v7, off): the weight stream through a per-lane cp.async
# ring in shared memory. Parity (v7 bitwise v6 eager + graph replays, invalid ids), compute-sanitizer over it, the
# node microbenchmark (forms), k3-layers-4 B=1 with v7 off / on (same binary, alternating), Nsight of the v7 kernels.
set -u
source tools/gpu/calls/common.sh   # unpack, paths, run()
run test-moe-cuda 200 "-v6v7" --gtest_filter='cuda_moe.decode_v6*'
CS=/usr/local/cuda/bin/compute-sanitizer
( timeout 200 $CS --tool memcheck --error-exitcode 9 $B/test-moe-cuda --gtest_filter='cuda_moe.decode_v6_invalid_ids' > $L/memcheck-v7.log 2>&1; echo "[$(( $(date +%s) - T0 ))s] memcheck v7 rc=$? $(grep -E 'ERROR SUMMARY' $L/memcheck-v7.log | tail -1)" >> $S ) &
( timeout 200 $CS --tool racecheck --error-exitcode 9 $B/test-moe-cuda --gtest_filter='cuda_moe.decode_v6_invalid_ids' > $L/racecheck-v7.log 2>&1; echo "[$(( $(date +%s) - T0 ))s] racecheck v7 rc=$? $(grep -E 'RACECHECK SUMMARY' $L/racecheck-v7.log | tail -1)" >> $S ) &
wait
MOE_BENCH_ITERS=200 timeout 200 $B/test-moe-cuda --gtest_filter='cuda_moe.bench_decode_k3_experts' > $L/bench-experts.log 2>&1; echo "[$(( $(date +%s) - T0 ))s] bench experts rc=$?" >> $S
D="timeout 100 $B/bench-cuda-decode --steps 20 --no-compare --no-profile --preset k3-layers-4 --batch 1"
for r in 1 2; do
  $D > $L/dec-v6-$r.log 2>&1; echo "[$(( $(date +%s) - T0 ))s] v6 $r rc=$?" >> $S
  $D --set moe_decode_v7=1 > $L/dec-v7-$r.log 2>&1; echo "[$(( $(date +%s) - T0 ))s] v7 $r rc=$?" >> $S
done
timeout 150 /usr/local/cuda/bin/ncu --clock-control none --kernel-name-base demangled --kernel-name regex:'_v6<1, (3, 3|4, 4)>' --launch-count 4 \
  --section SpeedOfLight --section Occupancy --section MemoryWorkloadAnalysis --section SchedulerStats --section WarpStateStats \
  env MOE_BENCH_ITERS=4 $B/test-moe-cuda --gtest_filter='cuda_moe.bench_decode_k3_experts' > $L/ncu-v7.txt 2>&1; echo "[$(( $(date +%s) - T0 ))s] ncu rc=$?" >> $S
grep -E "^\[bench-k3-experts\]" $L/bench-experts.log >> $S
for f in $L/dec-*.log; do echo "== $(basename $f)"; grep -E "^k3-layers-4 +new|bytes:|rror" $f; done >> $S
grep -E "v7|FAIL" $L/test-moe-cuda-v6v7.log | head -30 >> $S
cp $L/ncu-v7.txt $OUT/ 2>/dev/null
tar czf $OUT/logsA.tgz -C $OUT logs && rm -rf $L
cat $S
