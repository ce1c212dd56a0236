#!/bin/bash
# session 12, call H: test-runtime-cuda after moving the early-release control into a child process (in call G it
# killed the CUDA context, by design, and with it the binary's 10 later tests).
set -u
source tools/gpu/calls/common.sh
run test-runtime-cuda 400 ""
grep -E "\[measure\] free_dead|\[control\] T|DISABLED|OK \]|FAILED" $L/test-runtime-cuda.log >> $S
nvidia-smi --query-gpu=name,driver_version --format=csv >> $S 2>&1
tar czf $OUT/logsH.tgz -C $OUT logs && rm -rf $L
cat $S
