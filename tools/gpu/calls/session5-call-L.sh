#!/bin/bash
# session 5, call L: the final tree (fuse_kda_decode + attn_res_cluster on, capture_nodes refactor): every CUDA test,
# compare-backends on the goldens, the synth models and the shipped models, then timings (B 1/8/64, engine path, variants).
set -u
source tools/gpu/calls/common.sh   # unpack, paths, run()
( run test-runtime-cuda 340 "" ) &
( run test-ops-cuda 150 ""; run test-moe-cuda 150 ""; run test-kda-decode-cuda 60 ""; run test-route-cuda 40 ""; run test-mla-cuda 90 "" ) &
( run test-fuse-cuda 120 ""; run test-kda-cuda 30 ""; run test-prefill-cuda 90 ""; run test-sample-cuda 30 ""; run test-pdl-cuda 40 ""
  mkdir -p /tmp/pg-models; for p in k3-tiny k31-tiny kimi-linear-tiny; do $B/perigee synth --preset $p --out /tmp/pg-models/$p > /dev/null 2>&1; done
  IDS=$(python3 -c 'print(",".join(str((i*37+11)%250) for i in range(70)))')
  for m in tests/golden/kimi_linear/*/ /tmp/pg-models/*/ models/default models/k31-default; do
    for ids in "$IDS" "5,9,200"; do timeout 60 $B/perigee compare-backends --model "$m" --ids "$ids" --decode 6 >> $L/compare.log 2>&1; rc=$?
    echo "[$(( $(date +%s) - T0 ))s] compare $m ($(echo $ids | tr ',' '\n' | wc -l) ids) rc=$rc: $(grep -E '^compare-backends: (PASS|FAIL)|^error' $L/compare.log | tail -1)" >> $S; done
  done ) &
wait
echo "[$(( $(date +%s) - T0 ))s] parity done" >> $S
nvidia-smi --query-gpu=name,driver_version --format=csv > $L/gpu.txt 2>&1
D="timeout 100 $B/bench-cuda-decode --steps 20 --no-compare --no-profile"
$D --batch 1,8,64 > $L/dec-final.log 2>&1; echo "[$(( $(date +%s) - T0 ))s] final rc=$?" >> $S
$D --batch 1 --set graph_decode=1 > $L/dec-engine.log 2>&1; echo "[$(( $(date +%s) - T0 ))s] engine rc=$?" >> $S
$D --batch 1 --set fuse_kda_decode=0,attn_res_cluster=0 > $L/dec-s4.log 2>&1; echo "[$(( $(date +%s) - T0 ))s] s4 rc=$?" >> $S
$D --batch 1 --set fuse_norm_max_mib=8192 > $L/dec-fnorm.log 2>&1; echo "[$(( $(date +%s) - T0 ))s] fnorm rc=$?" >> $S
$D --batch 1 --set moe_route_fused_radix=1 > $L/dec-froute.log 2>&1; echo "[$(( $(date +%s) - T0 ))s] froute rc=$?" >> $S
$D --batch 1 > $L/dec-final2.log 2>&1; echo "[$(( $(date +%s) - T0 ))s] final2 rc=$?" >> $S
for f in $L/dec-*.log; do echo "== $(basename $f)"; grep -E "^(k3-layers-4|kimi-linear-48b) +new|bytes:" $f; grep -E "error|Error" $f | head -3; done >> $S
tar czf $OUT/logsL.tgz -C $OUT logs && rm -rf $L
cat $S
