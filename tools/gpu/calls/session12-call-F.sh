#!/bin/bash
# session 12, call F: the prefill timing passes with released outputs (call E's read the MoE ids for the FLOP count;
# now counted from the shapes: the GFLOP figures must equal the earlier calls'). 48B at 512 / 1024 / 2048 / 4096 tokens
# (2048 ran out of memory in call A with every output kept), k3-layers-4 at 512 / 2048.
set -u
source tools/gpu/calls/common.sh
prefill kimi-linear-48b 512,1024,2048,4096 f
grep -E "peak" $OUT/prefill-kimi-linear-48b-f.log >> $S
prefill k3-layers-4 512,2048 f
nvidia-smi --query-gpu=name,driver_version --format=csv >> $S 2>&1
cat $S
