#!/bin/bash
# session 15, call E: the pair form on short prefill chunks (one sequence, correlated routing: more tokens per expert
# than a decode batch of the same size), k3-layers-4 at 16 / 64 / 128 tokens and the 48B at 8 tokens, pair form on (the
# defaults) and off. Binaries of call D (tree 4888e37).
set -u
source tools/gpu/calls/common.sh
prefill k3-layers-4 16,64,128 on --no-profile
prefill k3-layers-4 16,64,128 off --no-profile --set moe_decode_pairs_mxfp4=0
prefill kimi-linear-48b 8 on --no-profile
prefill kimi-linear-48b 8 off --no-profile --set moe_decode_pairs_bf16=0
nvidia-smi --query-gpu=name,driver_version --format=csv >> $S 2>&1
rm -rf $L
cat $S
