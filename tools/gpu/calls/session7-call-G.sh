#!/bin/bash
# session 7, call G: the final tree (CUDA sources = call D's): decode B 1/8/64 on both presets (the decode path is
# unchanged; the tensor-core stages now run before the GEMV ones in mixed batch steps), prefill, test-fuse-cuda and
# test-ops-cuda as regressions.
set -u
source tools/gpu/calls/common.sh   # unpack, paths, run()
( run test-fuse-cuda 200 ""; run test-ops-cuda 200 "" ) &
wait
nvidia-smi --query-gpu=name,driver_version --format=csv > $L/gpu.txt 2>&1
D="timeout 100 $B/bench-cuda-decode --steps 20 --no-compare --no-profile"
$D --batch 1,8,64 > $L/dec-final.log 2>&1; echo "[$(( $(date +%s) - T0 ))s] decode rc=$?" >> $S
$D --batch 1 --set graph_decode=1 > $L/dec-engine.log 2>&1; echo "[$(( $(date +%s) - T0 ))s] engine rc=$?" >> $S
timeout 150 $B/bench-cuda-decode --preset k3-layers-4 --prefill 512,2048 > $L/prefill.log 2>&1; echo "[$(( $(date +%s) - T0 ))s] prefill rc=$?" >> $S
for f in $L/dec-*.log; do echo "== $(basename $f)"; grep -E "^(k3-layers-4|kimi-linear-48b) +new|bytes:" $f; grep -E "error|Error" $f | head -3; done >> $S
grep -E "^prefill|GEMM share|MOE_EXPERTS|LINEAR" $L/prefill.log >> $S
cat $L/gpu.txt >> $S
tar czf $OUT/logsG.tgz -C $OUT logs && rm -rf $L
cat $S
