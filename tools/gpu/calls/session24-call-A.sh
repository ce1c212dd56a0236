#!/bin/bash
# session 24, call A: session 23's pending checks first (test-fuse-cuda's replay and side prefetch tests on the review
# commit 8a63a2c's binaries), then session 23's call D (the side-branch L2 prefetch on the target card: 48B and k3 B=1
# at 0 and the default 8 MiB, alternating; decode at the defaults; k3 prefill under the bf16 policy; the 48B prefill at
# 2048 tokens under both policies where it fits). 48B rows cut to 16 layers on an 80 GB card (cut_48b). Summary only.
set -u
source tools/gpu/calls/common.sh
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >> $S 2>&1
run test-fuse-cuda 200 "-replay" --gtest_filter='cuda_fuse.side_prefetch*:cuda_fuse.capture_replay*'
cut_48b
D="timeout 150 $B/bench-cuda-decode --steps 40 --no-compare --no-profile --batch 1"
for r in 1 2; do D1="$D"; D="$D1 $CUT"; b kimi-linear-48b s0-r$r l2_side_prefetch_mib=0; b kimi-linear-48b s8-r$r; D="$D1"
  b k3-layers-4 s0-r$r l2_side_prefetch_mib=0; b k3-layers-4 s8-r$r; done
D="timeout 150 $B/bench-cuda-decode --steps 20 --no-compare --no-profile"
[ -z "$CUT" ] && decode_rounds 1
[ -n "$CUT" ] && decode_rounds 1 --preset k3-layers-4
prefill k3-layers-4 2048 bf16 --bf16-inputs 256
if [ -z "$CUT" ]; then
  prefill kimi-linear-48b 2048 bf16 --bf16-inputs 256 --no-profile
  prefill kimi-linear-48b 2048 split --no-profile
fi
for f in $OUT/prefill-*.log; do echo "== $(basename $f)" >> $S; grep -E ' (MOE_EXPERTS|LINEAR) x|GEMM share|ms/step eager' $f | cut -c1-220 >> $S; done
rm -rf $L $OUT/prefill-*.log
cat $S
