#!/bin/bash
# session 11, call F: test-ops-cuda with the group_of helper (its MOE_EXPERTS cases run the grouped v1 kernels at T > 1
# and with moe_fp4_v2 off; call E ran test-moe-cuda, whose mxfp4_decode_v3 / small_v4_batch cover FP4 v2 and small v4).
set -u
source tools/gpu/calls/common.sh
run test-ops-cuda 400 ""
grep -E 'moe|MOE' $L/test-ops-cuda.log | grep -E '^\[' | tail -12 >> $S
nvidia-smi --query-gpu=name,driver_version --format=csv >> $S 2>&1
tar czf $OUT/logsF.tgz -C $OUT logs && rm -rf $L
cat $S
