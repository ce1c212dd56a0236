#!/bin/bash
# session 6, call E: the final tree (moe_decode_v7 on, moe_shared_slot off with its fixed test): every CUDA test,
# compare-backends on the goldens, the synth models and the shipped models, sanitizers on the new kernels, then timings
# (B 1/8/64, engine path, moe_shared_slot on, v7 off, v7 prefetch forms, the expert microbenchmark, prefill).
set -u
source tools/gpu/calls/common.sh   # unpack, paths, run()
san() { local tool=$1 t=$2 f=$3 to=$4; local s=$(date +%s); timeout $to /usr/local/cuda/bin/compute-sanitizer --tool $tool --error-exitcode 9 $B/$t --gtest_filter="$f" > $L/$tool-$t.log 2>&1
  echo "[$(( $(date +%s) - T0 ))s] $tool $t ($f) rc=$? $(( $(date +%s) - s ))s $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|SYNCCHECK SUMMARY' $L/$tool-$t.log | tail -1)" >> $S; }
( run test-runtime-cuda 340 "" ) &
( run test-ops-cuda 150 ""; run test-moe-cuda 300 ""; run test-kda-decode-cuda 60 ""; run test-route-cuda 40 ""; run test-mla-cuda 90 "" ) &
( run test-fuse-cuda 150 ""; run test-kda-cuda 30 ""; run test-prefill-cuda 90 ""; run test-sample-cuda 30 ""; run test-pdl-cuda 40 ""
  mkdir -p /tmp/pg-models; for p in k3-tiny k31-tiny kimi-linear-tiny; do $B/perigee synth --preset $p --out /tmp/pg-models/$p > /dev/null 2>&1; done
  IDS=$(python3 -c 'print(",".join(str((i*37+11)%250) for i in range(70)))')
  for m in tests/golden/kimi_linear/*/ /tmp/pg-models/*/ models/default models/k31-default; do
    for ids in "$IDS" "5,9,200"; do timeout 60 $B/perigee compare-backends --model "$m" --ids "$ids" --decode 6 >> $L/compare.log 2>&1; rc=$?
    echo "[$(( $(date +%s) - T0 ))s] compare $m ($(echo $ids | tr ',' '\n' | wc -l) ids) rc=$rc: $(grep -E '^compare-backends: (PASS|FAIL)|^error' $L/compare.log | tail -1)" >> $S; done
  done
  san memcheck test-fuse-cuda '*moe_shared_slot*' 200
  san memcheck test-moe-cuda 'cuda_moe.decode_v6_invalid_ids' 100; san racecheck test-moe-cuda 'cuda_moe.decode_v6_invalid_ids' 100 ) &
wait
echo "[$(( $(date +%s) - T0 ))s] parity done" >> $S
grep -hE "moe_shared.*(bitwise|control)|NOT caught|DIFFERS" $L/test-fuse-cuda.log | head -12 >> $S
nvidia-smi --query-gpu=name,driver_version --format=csv > $L/gpu.txt 2>&1
D="timeout 100 $B/bench-cuda-decode --steps 20 --no-compare --no-profile"
$D --batch 1,8,64 > $L/dec-final.log 2>&1; echo "[$(( $(date +%s) - T0 ))s] final rc=$?" >> $S
$D --batch 1 --set graph_decode=1 > $L/dec-engine.log 2>&1; echo "[$(( $(date +%s) - T0 ))s] engine rc=$?" >> $S
$D --batch 1 --set moe_shared_slot=1 > $L/dec-shared.log 2>&1; echo "[$(( $(date +%s) - T0 ))s] shared rc=$?" >> $S
$D --batch 1 --set moe_shared_slot=1,graph_decode=1 > $L/dec-shared-engine.log 2>&1; echo "[$(( $(date +%s) - T0 ))s] shared+engine rc=$?" >> $S
$D --batch 1 --preset k3-layers-4 --set moe_decode_v7=0 > $L/dec-v6.log 2>&1; echo "[$(( $(date +%s) - T0 ))s] v6 rc=$?" >> $S
$D --batch 1 --preset k3-layers-4 --set moe_decode_v7_form=550 > $L/dec-pf2.log 2>&1; echo "[$(( $(date +%s) - T0 ))s] pf2 rc=$?" >> $S
$D --batch 1 --preset k3-layers-4 --set moe_decode_v7_form=660 > $L/dec-pf4.log 2>&1; echo "[$(( $(date +%s) - T0 ))s] pf4 rc=$?" >> $S
$D --batch 1 > $L/dec-final2.log 2>&1; echo "[$(( $(date +%s) - T0 ))s] final2 rc=$?" >> $S
MOE_BENCH_ITERS=200 timeout 200 $B/test-moe-cuda --gtest_filter='cuda_moe.bench_decode_k3_experts' > $L/bench-experts.log 2>&1; echo "[$(( $(date +%s) - T0 ))s] bench experts rc=$?" >> $S
timeout 120 $B/bench-cuda-decode --preset k3-layers-4 --prefill 512,2048 > $L/prefill.log 2>&1; echo "[$(( $(date +%s) - T0 ))s] prefill rc=$?" >> $S
for f in $L/dec-*.log; do echo "== $(basename $f)"; grep -E "^(k3-layers-4|kimi-linear-48b) +new|bytes:" $f; grep -E "error|Error" $f | head -3; done >> $S
grep -E "^\[bench-k3-experts\] (v6|v7)" $L/bench-experts.log >> $S
grep -E "^prefill|GEMM share" $L/prefill.log >> $S
tar czf $OUT/logsE.tgz -C $OUT logs && rm -rf $L
cat $S
