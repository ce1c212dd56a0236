#!/bin/bash
# session 8, call C: the tree with norm_reg and moe_shared_prefetch on (defaults) and the staged-norm prologue with its
# loads batched (linear.cu stage_norm: x and nw loads issued per batch, nw asked into L2 before the PDL wait): the CUDA
# op / fusion / MoE / runtime tests, compare-backends on the goldens and the tiny / default models, memcheck on the norm
# and shared-slot tests; then decode B 1/8/64 on both presets (defaults; norm_reg=0 as the same-binary reference),
# the engine path, prefill T 512 / 2048.
set -u
source tools/gpu/calls/common.sh   # unpack, paths, run()
san() { local tool=$1 t=$2 f=$3 to=$4; local s=$(date +%s); timeout $to /usr/local/cuda/bin/compute-sanitizer --tool $tool --error-exitcode 9 $B/$t --gtest_filter="$f" > $L/$tool-$t.log 2>&1
  echo "[$(( $(date +%s) - T0 ))s] $tool $t ($f) rc=$? $(( $(date +%s) - s ))s $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|SYNCCHECK SUMMARY' $L/$tool-$t.log | tail -1)" >> $S; }
( run test-ops-cuda 300 ""; run test-moe-cuda 300 "-sh" --gtest_filter='cuda_moe.decode_bf16*' ) &
( run test-fuse-cuda 200 ""; run test-runtime-cuda 240 "" ) &
( IDS=$(python3 -c 'print(",".join(str((i*37+11)%250) for i in range(70)))')
  mkdir -p /tmp/pg-models; for p in k3-tiny kimi-linear-tiny; do $B/perigee synth --preset $p --out /tmp/pg-models/$p > /dev/null 2>&1; done
  for m in tests/golden/kimi_linear/*/ /tmp/pg-models/*/ models/default models/k31-default; do
    timeout 60 $B/perigee compare-backends --model "$m" --ids "$IDS" --decode 6 >> $L/compare.log 2>&1; rc=$?
    echo "[$(( $(date +%s) - T0 ))s] compare $m (70 ids) rc=$rc: $(grep -E '^compare-backends: (PASS|FAIL)|^error' $L/compare.log | tail -1)" >> $S
  done ) &
( sleep 30; san memcheck test-ops-cuda 'cuda_ops.norm_reg_bitwise:cuda_ops.norms_wide_rows' 200; san memcheck test-moe-cuda 'cuda_moe.decode_bf16_shared_direct' 200 ) &
wait
echo "[$(( $(date +%s) - T0 ))s] parity done" >> $S
grep -hE "norm_reg\]|prefetch\]|NOT bitwise" $L/test-ops-cuda.log $L/test-moe-cuda-sh.log | head -8 >> $S
D="timeout 100 $B/bench-cuda-decode --steps 20 --no-compare --no-profile"
$D --batch 1,8,64 > $L/dec-final.log 2>&1; echo "[$(( $(date +%s) - T0 ))s] decode rc=$?" >> $S
$D --batch 1 --set norm_reg=0 > $L/dec-nonormreg.log 2>&1; echo "[$(( $(date +%s) - T0 ))s] norm_reg=0 rc=$?" >> $S
$D --batch 1 > $L/dec-again.log 2>&1; echo "[$(( $(date +%s) - T0 ))s] again rc=$?" >> $S
$D --batch 1 --set graph_decode=1 > $L/dec-engine.log 2>&1; echo "[$(( $(date +%s) - T0 ))s] engine rc=$?" >> $S
timeout 150 $B/bench-cuda-decode --preset k3-layers-4 --prefill 512,2048 > $L/prefill.log 2>&1; echo "[$(( $(date +%s) - T0 ))s] prefill rc=$?" >> $S
for f in $L/dec-*.log; do echo "== $(basename $f)"; grep -E "^(k3-layers-4|kimi-linear-48b) +new|bytes:" $f; grep -E "error|Error" $f | head -3; done >> $S
grep -E "^prefill|GEMM share" $L/prefill.log >> $S
nvidia-smi --query-gpu=name,driver_version --format=csv >> $S 2>&1
tar czf $OUT/logsC.tgz -C $OUT logs && rm -rf $L
cat $S
