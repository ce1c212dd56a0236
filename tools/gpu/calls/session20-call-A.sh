#!/bin/bash
# session 20, call A (written in session 19, which was cut off before it ran; trimmed to fit one 600 s call):
# ARCHITECTURE 3.0's bf16 GEMM inputs as a forward option (forward_options::bf16_inputs_min_tokens, op_params::bf16_inputs
# on LINEAR / MOE_EXPERTS, the CPU reference rounding the same values): the new tests, the k3 prefill bench under both
# precision policies, compare-backends with the policy, every suite, memcheck on the new expert path, then the 48B
# prefill under both policies. (No decode code changed: no decode round.)
set -u
source tools/gpu/calls/common.sh
run test-ops-cuda 200 "-bf16" --gtest_filter='*linear_bf16_inputs*:*get_rows_and_linear*:*linear_split_stacked*'
run test-moe-cuda 200 "-bf16" --gtest_filter='*bf16_inputs*'
prefill k3-layers-4 512,2048 split
prefill k3-layers-4 512,2048 bf16 --bf16-inputs 256
compare_models 300 4 120 bf16 --bf16-inputs-tokens 2
full_suite
san memcheck test-moe-cuda '*bf16_inputs*' 200
prefill kimi-linear-48b 512,2048 split --no-profile
prefill kimi-linear-48b 512,2048 bf16 --bf16-inputs 256 --no-profile
nvidia-smi --query-gpu=name,driver_version --format=csv >> $S 2>&1
rm -rf $L/compare*.log.big
cat $S
