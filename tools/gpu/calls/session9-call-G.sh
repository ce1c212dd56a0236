#!/bin/bash
# session 9, call G: h / act of the BF16 pair's down stage by __ldcg (L2 only; the default since call E) vs __ldca
# (coherent, L1-cached; moe_bf16_early 3 = 1 with __ldca): the pair's tests repeated 10 times (every early form, 300
# included, bitwise the run without), then the 48B step with early 1 vs 3 vs 0, three rounds.
set -u
source tools/gpu/calls/common.sh   # unpack, paths, run()
run test-moe-cuda 300 "-bf16x10" --gtest_filter='cuda_moe.decode_bf16_direct:cuda_moe.decode_bf16_shared_direct' --gtest_repeat=10
echo "early lines: $(grep -cE 'early(100|200|300)\] bitwise the run without it: PASS' $L/test-moe-cuda-bf16x10.log) PASS, $(grep -cE 'early(100|200|300)\] DIFFERS' $L/test-moe-cuda-bf16x10.log) DIFFERS; cfg300 direct: $(grep -c 'direct/cfg300\] bitwise' $L/test-moe-cuda-bf16x10.log)" >> $S
D="timeout 150 $B/bench-cuda-decode --steps 30 --no-compare --no-profile --batch 1 --preset kimi-linear-48b"
for round in 1 2 3; do for v in 1 3 0; do
  $D --set moe_bf16_early=$v > $L/dec-$round-$v.log 2>&1
  echo "[$(( $(date +%s) - T0 ))s] r$round moe_bf16_early=$v rc=$? | $(grep -E '^kimi-linear-48b +new' $L/dec-$round-$v.log | awk '{print $1, $5, $6}' | tr '\n' ' ')" >> $S
done; done
nvidia-smi --query-gpu=name,driver_version --format=csv >> $S 2>&1
tar czf $OUT/logsG.tgz -C $OUT logs && rm -rf $L
cat $S
