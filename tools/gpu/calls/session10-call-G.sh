#!/bin/bash
# session 10, call G: attribution of the evict_first policy: kernel timelines of both presets at batch 1 with the two
# switches on (the defaults) and off, same binary (call E's, a2f06b1).
set -u
source tools/gpu/calls/common.sh
D="timeout 150 $B/bench-cuda-decode --steps 30 --no-compare --no-profile --batch 1 --timeline 10"
$D > $OUT/timeline-on.log 2>&1; echo "[$(( $(date +%s) - T0 ))s] on rc=$?" >> $S
$D --set moe_bf16_evict_first=0,gemv_evict_first=0 > $OUT/timeline-off.log 2>&1; echo "[$(( $(date +%s) - T0 ))s] off rc=$?" >> $S
grep -hE '^kernel timeline' $OUT/timeline-on.log $OUT/timeline-off.log | sed 's/, gap to.*untraced graph step/ untraced/' >> $S
nvidia-smi --query-gpu=name,driver_version --format=csv >> $S 2>&1
cat $S
