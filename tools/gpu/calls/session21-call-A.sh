#!/bin/bash
# session 21, call A: session 20's call B (never run: the per-pick experts' bf16 inputs, compare-backends under the policy
# at --tol 1e-5 on the 9 models, the graph-key change) plus the deep v4 stage layout for hi-only activations
# (cuda_options::moe_mma_v4_deep: no lo planes, 5 MXFP4 stages instead of 3) and the flagged LINEARs' shared bf16 copy
# of x (cuda_options::linear_bf16_share_x): their bitwise tests against the forms they replace, the k3 prefill under
# the bf16 policy with both on, both off (session 20's form) and deep alone, in the same call, the tensor-core expert tests
# (the split kernel and the gate/up epilogue now skip the lo plane when hi-only), memcheck, then every suite; the 48B
# prefill under both policies only where the card holds its 98 GB (an H200).
set -u
source tools/gpu/calls/common.sh
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >> $S 2>&1
run test-moe-cuda 240 "-bf16" --gtest_filter='*bf16_inputs*'
run test-ops-cuda 200 "-bf16" --gtest_filter='*linear_bf16*'
prefill k3-layers-4 2048 bf16-new --bf16-inputs 256
prefill k3-layers-4 2048 bf16-s20 --bf16-inputs 256 --set moe_mma_v4_deep=0,linear_bf16_share_x=0
prefill k3-layers-4 2048 bf16-deep-only --bf16-inputs 256 --set linear_bf16_share_x=0
compare_models 300 4 120 bf16 --bf16-inputs-tokens 2 --tol 1e-5
MOE_V4_SMALL=1 san memcheck test-moe-cuda '*bf16_inputs*' 200
run test-moe-cuda 300 "-mma" --gtest_filter='*mma_v4*:*mma_v3*:*mma_split*:*mma_v2*'
prefill k3-layers-4 512,2048 split
full_suite
prefill_48b_if_fits
rm -rf $L/compare*.log.big
cat $S
