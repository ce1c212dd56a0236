#!/bin/bash
# session 16, call D: test-ops-cuda after the fix of its one-bf16-pass options (call C: the positional {true, 8, false}
# set gemv_unroll, so the "bf16-act" rows and linear_split_stacked's control ran the split path; now one_bf16_pass()),
# and memcheck on linear_split_stacked.
set -u
source tools/gpu/calls/common.sh
run test-ops-cuda 300 ""
san memcheck test-ops-cuda 'cuda_ops.linear_split_stacked' 300
grep -hE 'bf16-act|linear_stacked/.*(counter|bitwise|control)' $L/test-ops-cuda.log | head -80 > $OUT/lines.txt
cp $L/test-ops-cuda.log $OUT/
rm -rf $L
cat $S
