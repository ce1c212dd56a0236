#!/bin/bash
# session 11, call D: test-ops-cuda after the review's change to same_bits (the control flips the low bit of the LAST
# element of the first output instead of moving the first by nextafter): every GEMV variant, the three bitwise checks
# with their controls.
set -u
source tools/gpu/calls/common.sh
run test-ops-cuda 400 ""
grep -E '^\[gemv\]' $L/test-ops-cuda.log >> $S
nvidia-smi --query-gpu=name,driver_version --format=csv >> $S 2>&1
tar czf $OUT/logsD.tgz -C $OUT logs && rm -rf $L
cat $S
