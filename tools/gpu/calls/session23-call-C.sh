#!/bin/bash
# session 23, call C: the side-branch L2 prefetch now on by default (8 MiB): every CUDA test binary, compare-backends on
# the 9 models and the serve smoke with it; then the sweep with the fork point (l2_side_prefetch_fork_kib 512: the 48B
# router becomes the fork of the MoE gap) and k3 at 8 MiB; a timeline of the fork form. Summary and the timeline.
set -u
source tools/gpu/calls/common.sh
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >> $S 2>&1
cut_48b
D="timeout 150 $B/bench-cuda-decode --steps 40 --no-compare --no-profile --batch 1 $CUT"
for r in 1 2; do
  b kimi-linear-48b s0-r$r l2_side_prefetch_mib=0
  b kimi-linear-48b s8-r$r
  b kimi-linear-48b s8f512-r$r l2_side_prefetch_fork_kib=512
  b kimi-linear-48b s16f512-r$r l2_side_prefetch_mib=16,l2_side_prefetch_fork_kib=512
  b kimi-linear-48b s24span2f512-r$r l2_side_prefetch_mib=24,l2_side_prefetch_span=2,l2_side_prefetch_fork_kib=512
done
D="timeout 150 $B/bench-cuda-decode --steps 40 --no-compare --no-profile --batch 1"
for r in 1 2; do b k3-layers-4 s0-r$r l2_side_prefetch_mib=0; b k3-layers-4 s8-r$r; b k3-layers-4 s8f512-r$r l2_side_prefetch_fork_kib=512; done
timeout 150 $B/bench-cuda-decode --steps 40 --no-compare --no-profile --batch 1 --preset kimi-linear-48b $CUT --set l2_side_prefetch_fork_kib=512 --timeline 10 > $OUT/timeline-48b-s8-f512.log 2>&1
echo "[$(( $(date +%s) - T0 ))s] timeline rc=$?" >> $S
full_suite
rm -rf $OUT/smoke
D="timeout 150 $B/bench-cuda-decode --steps 20 --no-compare --no-profile"
[ -n "$CUT" ] && D="$D --preset k3-layers-4"
decode_rounds 1
rm -rf $L
cat $S
