#!/bin/bash
# session 23, call B: the side-branch L2 prefetch's timelines (kernel-timeline now reports the side kernels apart) and a
# finer sweep, 48B (cut to 16 layers on an 80 GB card) B=1. Summary and timelines.
set -u
source tools/gpu/calls/common.sh
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >> $S 2>&1
cut_48b
D="timeout 150 $B/bench-cuda-decode --steps 40 --no-compare --no-profile --batch 1 $CUT"
for r in 1 2; do
  b kimi-linear-48b s0-r$r l2_side_prefetch_mib=0
  for mb in 4 8 12; do b kimi-linear-48b s$mb-r$r l2_side_prefetch_mib=$mb; done
  for mb in 12 16 24; do b kimi-linear-48b span2-s$mb-r$r l2_side_prefetch_mib=$mb,l2_side_prefetch_span=2; done
  b kimi-linear-48b s8b64-r$r l2_side_prefetch_mib=8,l2_side_prefetch_blocks=64
  b kimi-linear-48b s8b16-r$r l2_side_prefetch_mib=8,l2_side_prefetch_blocks=16
done
for v in "0 1" "8 1" "24 2"; do set -- $v
  timeout 150 $B/bench-cuda-decode --steps 40 --no-compare --no-profile --batch 1 --preset kimi-linear-48b $CUT --set l2_side_prefetch_mib=$1,l2_side_prefetch_span=$2 --timeline 10 > $OUT/timeline-48b-s$1-span$2.log 2>&1
  echo "[$(( $(date +%s) - T0 ))s] timeline s$1 span$2 rc=$?" >> $S; done
rm -rf $L
cat $S
