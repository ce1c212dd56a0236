#!/bin/bash
# session 6, call C: MXFP4 decode v7 with the U steps of a batch as interleaved mma chains (IL forms, the new defaults), blocks
# of W warps): every form bitwise v5/v6 (invalid-ids test), v7 vs v6 bitwise eager + replays on the K3 shape, sanitizers,
# the node microbenchmark over the forms, k3-layers-4 B=1 v7 off/on alternating; Nsight of v7's two kernels.
set -u
source tools/gpu/calls/common.sh   # unpack, paths, run()
run test-moe-cuda 200 "-v6v7" --gtest_filter='cuda_moe.decode_v6*'
CS=/usr/local/cuda/bin/compute-sanitizer
( timeout 200 $CS --tool memcheck --error-exitcode 9 $B/test-moe-cuda --gtest_filter='cuda_moe.decode_v6_invalid_ids' > $L/memcheck-v7.log 2>&1; echo "[$(( $(date +%s) - T0 ))s] memcheck v7 rc=$? $(grep -E 'ERROR SUMMARY' $L/memcheck-v7.log | tail -1)" >> $S ) &
( timeout 200 $CS --tool racecheck --error-exitcode 9 $B/test-moe-cuda --gtest_filter='cuda_moe.decode_v6_invalid_ids' > $L/racecheck-v7.log 2>&1; echo "[$(( $(date +%s) - T0 ))s] racecheck v7 rc=$? $(grep -E 'RACECHECK SUMMARY' $L/racecheck-v7.log | tail -1)" >> $S ) &
( timeout 200 $CS --tool synccheck --error-exitcode 9 $B/test-moe-cuda --gtest_filter='cuda_moe.decode_v6_invalid_ids' > $L/synccheck-v7.log 2>&1; echo "[$(( $(date +%s) - T0 ))s] synccheck v7 rc=$? $(grep -E 'ERROR SUMMARY' $L/synccheck-v7.log | tail -1)" >> $S ) &
wait
MOE_BENCH_ITERS=200 timeout 200 $B/test-moe-cuda --gtest_filter='cuda_moe.bench_decode_k3_experts' > $L/bench-experts.log 2>&1; echo "[$(( $(date +%s) - T0 ))s] bench experts rc=$?" >> $S
D="timeout 100 $B/bench-cuda-decode --steps 20 --no-compare --no-profile --preset k3-layers-4 --batch 1"
for r in 1 2; do
  $D > $L/dec-v6-$r.log 2>&1; echo "[$(( $(date +%s) - T0 ))s] v6 $r rc=$?" >> $S
  $D --set moe_decode_v7=1 > $L/dec-v7-$r.log 2>&1; echo "[$(( $(date +%s) - T0 ))s] v7 $r rc=$?" >> $S
done
for only in "v7 gate/up only" "v7 down+combine only"; do
  timeout 100 /usr/local/cuda/bin/ncu --clock-control none --kernel-name regex:"k_moe_(gate_up|down_comb)_v6" --launch-skip 8 --launch-count 1 \
    --section SpeedOfLight --section Occupancy --section MemoryWorkloadAnalysis --section SchedulerStats --section WarpStateStats \
    env MOE_BENCH_ITERS=4 MOE_BENCH_ONLY="$only" $B/test-moe-cuda --gtest_filter='cuda_moe.bench_decode_k3_experts' > "$L/ncu-$(echo $only | tr -c a-z0-9 _).txt" 2>&1
  echo "[$(( $(date +%s) - T0 ))s] ncu $only rc=$?" >> $S
done
grep -E "^\[bench-k3-experts\]" $L/bench-experts.log >> $S
for f in $L/dec-*.log; do echo "== $(basename $f)"; grep -E "^k3-layers-4 +new|bytes:|rror" $f; done >> $S
grep -E "v7|FAIL" $L/test-moe-cuda-v6v7.log | head -30 >> $S
for f in $L/ncu-*.txt; do echo "== $f"; grep -E "Duration|DRAM Throughput|Memory Throughput|Compute \(SM\) Throughput|Achieved Occupancy|Issued Warp Per|No Eligible|Warp Cycles Per Issued|L2 Hit|Block Limit Shared|Block Limit Reg" "$f"; done >> $S
tar czf $OUT/logsC.tgz -C $OUT logs && rm -rf $L
cat $S
