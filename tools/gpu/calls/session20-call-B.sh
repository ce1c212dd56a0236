#!/bin/bash
# session 20, call B (NOT RUN in session 20: no device time left after failed machine starts; run it first next session): after call A (H100), the per-pick expert kernels (F32 experts, grouping off) take bf16 inputs (x
# rounded into a copy, the GLU rows rounded in place) instead of refusing them, so compare-backends runs the 4 HF goldens
# under the policy too; compare-backends under the policy at --tol 1e-5 (call A at 1e-6: 1.7-3.5e-6 before the first
# near tie, the compounding of bf16 rounding flips; see bench/RESULTS.md session 20); memcheck on the new path.
# (Cut to fit the device time left after failed machine starts: no 48B prefill, no 70-token compare, no prefill round.)
set -u
source tools/gpu/calls/common.sh
run test-moe-cuda 200 "-bf16" --gtest_filter='*bf16_inputs*'
compare_models 300 4 120 bf16 --bf16-inputs-tokens 2 --tol 1e-5
san memcheck test-moe-cuda '*bf16_inputs*' 200
nvidia-smi --query-gpu=name,driver_version --format=csv >> $S 2>&1
rm -rf $L/compare*.log.big
cat $S
