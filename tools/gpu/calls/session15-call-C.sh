#!/bin/bash
# session 15, call C: test-moe-cuda whole after its grouped-path tests pin the pair form off (grouped_path(): call B
# showed mma_v2 / v3 / v4 tests' controls catching that the pair form, on by default up to 64 tokens, had taken their
# T <= 64 steps: "v2 bitwise equal to v1", "v3 launches 0").
set -u
source tools/gpu/calls/common.sh
run test-moe-cuda 400 ""
grep -E 'FAIL' $L/test-moe-cuda.log | grep -vE 'must FAIL|FAILED as required|FAILED \(both|FAILED, negative|control' | head -20 >> $S
nvidia-smi --query-gpu=name,driver_version --format=csv >> $S 2>&1
cp $L/test-moe-cuda.log $OUT/ 2>/dev/null
cat $S
