#!/bin/bash
# session 22, call B (an H200: the 48B geometry's 98 GB do not fit an H100): one decode round at the defaults (k3-layers-4
# and the 48B, batches 1, 8, 64), the 48B prefill under the bf16 and split policies, the k3 prefill under both, with the
# binaries of call A (this session's shift form). Summary only.
set -u
source tools/gpu/calls/common.sh
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >> $S 2>&1
D="timeout 200 $B/bench-cuda-decode --steps 20 --no-compare --no-profile"
decode_rounds 1
prefill_48b_if_fits
prefill k3-layers-4 2048 bf16 --bf16-inputs 256
prefill k3-layers-4 2048 split
for f in $OUT/prefill-*.log; do echo "== $(basename $f)" >> $S; grep -E ' (MOE_EXPERTS|LINEAR) x|GEMM share|ms/step eager' $f | cut -c1-220 >> $S; done
rm -rf $L $OUT/prefill-*.log
cat $S
