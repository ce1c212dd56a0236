#!/bin/bash
# session 18, call D: the bound cuda_options::gemv_max_elems = 12288 (this tree's default; was 16384) after call C
# measured 13824 faster at 48B B=7 (9.34 -> 8.47 ms) and k3 B=4 (3.72 -> 3.69). Predicted before this run: 12288 also
# moves the 48B's 6-token 2304-wide rows to cuBLASLt, B=6 8.18 -> ~7.8 ms (session 17's all-cuBLASLt B=6: 7.77-7.82);
# B=3-5 and k3 unchanged against 13824. Sweep B = 3..8 for 16384 / 13824 / 12288 (same binary, two rounds), then the
# suites that run on the default bound (test-ops-cuda, test-runtime-cuda, compare-backends) and one decode round.
set -u
source tools/gpu/calls/common.sh
D="timeout 100 $B/bench-cuda-decode --steps 20 --no-compare --no-profile --batch 3,4,5,6,7,8"
for round in 1 2; do
  for e in 16384 13824 12288; do
    for p in kimi-linear-48b k3-layers-4; do
      $D --preset $p --set gemv_max_elems=$e > $L/s-$p-$e-$round.log 2>&1
      echo "[$(( $(date +%s) - T0 ))s] $p elems $e r$round | $(grep -E "^$p +new" $L/s-$p-$e-$round.log | awk '{print $3, $5}' | tr '\n' ' ')" >> $S
    done
  done
done
( run test-ops-cuda 300 "" ) &
( run test-runtime-cuda 300 "" ) &
wait
compare_models
D="timeout 200 $B/bench-cuda-decode --steps 20 --no-compare --no-profile"
decode_rounds 1
nvidia-smi --query-gpu=name,driver_version --format=csv >> $S 2>&1
tar czf $OUT/logsD.tgz -C $OUT logs && rm -rf $L
cat $S
