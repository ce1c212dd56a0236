#!/bin/bash
# session 5, call P (binaries of call O): a sweep of existing cuda_options knobs at batch 1 (no new code), defaults twice.
set -u
source tools/gpu/calls/common.sh   # unpack, paths, run()
D="timeout 60 $B/bench-cuda-decode --steps 20 --no-compare --no-profile --batch 1"
for v in "" attn_res_chunk=512 attn_res_chunk=896 attn_res_chunk=2048 gemv_unroll=2 gemv_unroll=8 gemv_v2_min_in=8192 \
         gemv_v2_min_in=2048 "gemv_v3_max_in=4096" "gemv_v3_min_in=1024" ""; do
  if [ -n "$v" ]; then $D --set $v > $OUT/run.log 2>&1; else $D > $OUT/run.log 2>&1; fi
  echo "[$(( $(date +%s) - T0 ))s] ${v:-defaults}: $(grep -E '^(k3-layers-4|kimi-linear-48b) +new' $OUT/run.log | awk '{printf "%s %s ms %s | ", $1, $5, $9}')" >> $S
done
rm -f $OUT/run.log
cat $S
