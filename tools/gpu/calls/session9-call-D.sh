#!/bin/bash
# session 9, call D: the final tree (mla_attn_v4 and moe_bf16_early on by default, gemv_v2_early removed): every test
# that runs the defaults (engine, fusions, MoE BF16 pair with early = 1 and 2 bitwise, MLA incl. v4), compare-backends on
# the models, memcheck on the MLA v4 cases and racecheck on the BF16 pair; then moe_bf16_early 1 vs 2 (two rounds),
# the default timeline, batches 1/8/64, prefill, and Nsight Compute on k_mla_attn_v4 (its next lever).
set -u
source tools/gpu/calls/common.sh   # unpack, paths, run()
san() { local tool=$1 t=$2 f=$3 to=$4; local s=$(date +%s); timeout $to /usr/local/cuda/bin/compute-sanitizer --tool $tool --error-exitcode 9 $B/$t --gtest_filter="$f" > $L/$tool-$t.log 2>&1
  echo "[$(( $(date +%s) - T0 ))s] $tool $t ($f) rc=$? $(( $(date +%s) - s ))s $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' $L/$tool-$t.log | tail -1)" >> $S; }
( run test-moe-cuda 200 "-bf16" --gtest_filter='cuda_moe.decode_bf16*'; run test-mla-cuda 200 ""; run test-route-cuda 150 ""; run test-kda-decode-cuda 100 "" ) &
( run test-runtime-cuda 240 ""; run test-fuse-cuda 200 "" ) &
( IDS=$(python3 -c 'print(",".join(str((i*37+11)%250) for i in range(70)))')
  mkdir -p /tmp/pg-models; for p in k3-tiny kimi-linear-tiny k31-tiny; do $B/perigee synth --preset $p --out /tmp/pg-models/$p > /dev/null 2>&1; done
  for m in tests/golden/kimi_linear/*/ /tmp/pg-models/*/ models/default models/k31-default; do
    timeout 60 $B/perigee compare-backends --model "$m" --ids "$IDS" --decode 6 >> $L/compare.log 2>&1; rc=$?
    echo "[$(( $(date +%s) - T0 ))s] compare $m (70 ids) rc=$rc: $(grep -E '^compare-backends: (PASS|FAIL)|^error' $L/compare.log | tail -1)" >> $S
  done ) &
( sleep 10; san memcheck test-mla-cuda 'cuda_mla.decode_causal*:cuda_mla.selected_given*' 200; san racecheck test-moe-cuda 'cuda_moe.decode_bf16_shared_direct' 200 ) &
wait
grep -hE "early(100|200)?\] |early[0-9]*/invalid|v4.*(FAIL|worst)|defaults\]" $L/test-moe-cuda-bf16.log $L/test-mla-cuda.log | head -16 >> $S
D="timeout 150 $B/bench-cuda-decode --steps 30 --no-compare --no-profile"
for round in 1 2; do for v in 1 2 0; do
  $D --batch 1 --set moe_bf16_early=$v > $L/dec-$round-$v.log 2>&1
  echo "[$(( $(date +%s) - T0 ))s] r$round moe_bf16_early=$v rc=$? | $(grep -E '^(k3-layers-4|kimi-linear-48b) +new' $L/dec-$round-$v.log | awk '{print $1, $5, $8}' | tr '\n' ' ')" >> $S
done; done
$D --batch 1 --timeline 6 > $L/tl-default.log 2>&1
echo "[$(( $(date +%s) - T0 ))s] timeline default rc=$?" >> $S
$D --batch 1,8,64 > $L/dec-batches.log 2>&1
echo "[$(( $(date +%s) - T0 ))s] batches rc=$? | $(grep -E '^(k3-layers-4|kimi-linear-48b) +new' $L/dec-batches.log | awk '{print $1, $3, $5, $6, $9}' | tr '\n' ' ')" >> $S
timeout 200 $B/bench-cuda-decode --preset k3-layers-4 --prefill 512,2048 > $L/prefill.log 2>&1
echo "[$(( $(date +%s) - T0 ))s] prefill rc=$? | $(grep -E 'default +T|GEMM share' $L/prefill.log | tr '\n' ' ')" >> $S
timeout 200 /usr/local/cuda/bin/ncu --clock-control none --section SpeedOfLight --section WarpStateStats --section LaunchStats --section Occupancy --section SchedulerStats --section MemoryWorkloadAnalysis \
  --kernel-name regex:'k_mla_attn_v4' --launch-count 2 $B/bench-cuda-decode --preset kimi-linear-48b --layers 4 --batch 1 --steps 1 --no-compare --no-profile > $L/ncu-mla-v4.txt 2>&1
echo "[$(( $(date +%s) - T0 ))s] ncu mla v4 rc=$?" >> $S
cp $L/tl-default.log $L/ncu-mla-v4.txt $L/compare.log $OUT/ 2>/dev/null
nvidia-smi --query-gpu=name,driver_version --format=csv >> $S 2>&1
tar czf $OUT/logsD.tgz -C $OUT logs && rm -rf $L
cat $S
