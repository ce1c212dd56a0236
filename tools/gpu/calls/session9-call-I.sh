#!/bin/bash
# session 9, call I: v3 / v4 MLA attention kernels sharing their key-tile helpers (mla_key_rows, mla_tile_copy; the
# machine code of both changed): test-mla-cuda (v1-v4 vs the CPU, controls), decode B=1 once.
set -u
source tools/gpu/calls/common.sh   # unpack, paths, run()
run test-mla-cuda 120 ""
timeout 100 $B/bench-cuda-decode --steps 30 --no-compare --no-profile --batch 1 > $L/dec.log 2>&1
echo "[$(( $(date +%s) - T0 ))s] decode rc=$? | $(grep -E '^(k3-layers-4|kimi-linear-48b) +new' $L/dec.log | awk '{print $1, $5, $6, $9}' | tr '\n' ' ')" >> $S
tar czf $OUT/logsI.tgz -C $OUT logs && rm -rf $L
cat $S
