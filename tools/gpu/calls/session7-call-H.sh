#!/bin/bash
# session 7, call H: k3-layers-4 B=64 decode with the tensor-core experts v3/v4 on (default) vs off (v2), alternating,
# same binary (call G measured 83.2 ms/step against session 6's 81.5 on another machine).
set -u
source tools/gpu/calls/common.sh   # unpack, paths, run()
D="timeout 100 $B/bench-cuda-decode --steps 20 --no-compare --no-profile --preset k3-layers-4 --batch 64"
for r in 1 2; do
  $D > $L/dec-on-$r.log 2>&1; echo "[$(( $(date +%s) - T0 ))s] v4 on $r rc=$? $(grep -E '^k3-layers-4 +new' $L/dec-on-$r.log)" >> $S
  $D --set moe_mma_v4=0,moe_mma_v3=0 > $L/dec-off-$r.log 2>&1; echo "[$(( $(date +%s) - T0 ))s] v3/v4 off $r rc=$? $(grep -E '^k3-layers-4 +new' $L/dec-off-$r.log)" >> $S
done
tar czf $OUT/logsH.tgz -C $OUT logs && rm -rf $L
cat $S
