#!/bin/bash
# session 23, call D (an H200; the 48B's 98 GB): the side-branch L2 prefetch on the target card (48B and k3 B=1 at 0 and
# the default 8 MiB, alternating), decode at the defaults, then session 22's never-run prefill figures (k3 under the bf16
# policy, the 48B at 2048 tokens under both policies). Summary only.
set -u
source tools/gpu/calls/common.sh
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >> $S 2>&1
D="timeout 150 $B/bench-cuda-decode --steps 40 --no-compare --no-profile --batch 1"
for r in 1 2; do for p in kimi-linear-48b k3-layers-4; do b $p s0-r$r l2_side_prefetch_mib=0; b $p s8-r$r; done; done
D="timeout 150 $B/bench-cuda-decode --steps 20 --no-compare --no-profile"
decode_rounds 1
prefill k3-layers-4 2048 bf16 --bf16-inputs 256
prefill kimi-linear-48b 2048 bf16 --bf16-inputs 256 --no-profile
prefill kimi-linear-48b 2048 split --no-profile
for f in $OUT/prefill-*.log; do echo "== $(basename $f)" >> $S; grep -E ' (MOE_EXPERTS|LINEAR) x|GEMM share|ms/step eager' $f | cut -c1-220 >> $S; done
rm -rf $L $OUT/prefill-*.log
cat $S
