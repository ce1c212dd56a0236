#!/bin/bash
# session 18, call F: the small selection after the review (moved from route-small.cuh into route-select.cu as one
# kernel writing ids / weights itself; launchers moe_select_small4 / 8): test-route-cuda (bit for bit the threshold form,
# refusals, controls, timing), racecheck / memcheck on it, one 48B B=1 run at the defaults.
set -u
source tools/gpu/calls/common.sh
run test-route-cuda 200 ""
grep -E "small|^\[timing\] 48B" $L/test-route-cuda.log >> $S
san racecheck test-route-cuda '*small*' 200
san memcheck test-route-cuda '*small*' 200
D="timeout 100 $B/bench-cuda-decode --steps 30 --no-compare --no-profile --batch 1"
b kimi-linear-48b default
rm -rf $L
cat $S
