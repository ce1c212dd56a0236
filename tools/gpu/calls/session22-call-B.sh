#!/bin/bash
# session 22, call B (an H200: the 48B geometry's 98 GB do not fit an H100), with the binaries of call A (this
# session's shift form), most wanted first: the k3 prefill under the bf16 policy (the target on the reference card),
# the 48B prefill at 2048 tokens under both policies, then decode B=1 at the defaults (k3-layers-4 and the 48B). Summary only.
set -u
source tools/gpu/calls/common.sh
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >> $S 2>&1
prefill k3-layers-4 2048 bf16 --bf16-inputs 256
prefill kimi-linear-48b 2048 bf16 --bf16-inputs 256 --no-profile
prefill kimi-linear-48b 2048 split --no-profile
for f in $OUT/prefill-*.log; do echo "== $(basename $f)" >> $S; grep -E ' (MOE_EXPERTS|LINEAR) x|GEMM share|ms/step eager' $f | cut -c1-220 >> $S; done
D="timeout 150 $B/bench-cuda-decode --steps 20 --no-compare --no-profile"
decode_rounds 1 --batch 1
rm -rf $L $OUT/prefill-*.log
cat $S
