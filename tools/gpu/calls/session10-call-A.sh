#!/bin/bash
# Ran on commits 038b7b8 (call A) and d158d43 (call B); l2_prefetch_next and l2_prefetch_route_mb were removed after call B (bench/RESULTS.md, session 10), so this script does not run on later trees.
# session 10, call A: the L2 prefetch levers (all off by default in this binary).
#  - tests: the fused KDA tail and the MLA v4 attention with l2_prefetch_next bit for bit the runs without; the radix
#    selection with a prefetch list bit for bit the block selection; the BF16 pair with the evict_first policy (cfg 1000,
#    1100) bit for bit v4 / the run without; memcheck over the first two.
#  - 48B B=1 step: base, l2_prefetch_next, + moe_bf16_evict_first, + l2_prefetch_route_mb 12 / 24 / 36 (two rounds),
#    route 24 without evict_first; k3 base vs l2_prefetch_next; a kernel timeline of the 48B with everything on.
#  - prefill k3-layers-4 T=2048 with one bf16 GEMM per LINEAR and the experts' activations hi only (the GEMM share a
#    bf16-activation policy would reach; no code change).
set -u
source tools/gpu/calls/common.sh
run test-fuse-cuda 300 "" --gtest_filter='cuda_fuse.kda_decode_tail'
echo "kda l2 bitwise: $(grep -c 'bitwise l2_prefetch == fused\] yes' $L/test-fuse-cuda.log) yes, $(grep -c 'bitwise l2_prefetch == fused\] NO' $L/test-fuse-cuda.log) NO" >> $S
run test-mla-cuda 300 "" --gtest_filter='cuda_mla.decode_v4_l2_prefetch_bitwise:cuda_mla.decode_causal_vs_cpu_v1_v2'
grep -E 'l2-prefetch.*(bitwise|l2_prefetches)' $L/test-mla-cuda.log >> $S
run test-route-cuda 300 "" --gtest_filter='route_select.fast_equals_block:route_select.fast_equals_cpu_rule:route_select.controls_fail'
run test-moe-cuda 300 "" --gtest_filter='cuda_moe.decode_bf16_direct:cuda_moe.decode_bf16_shared_direct'
echo "moe cfg1000/1100 lines: $(grep -cE '(cfg1000|cfg1100)\] bitwise' $L/test-moe-cuda.log) direct PASS, $(grep -cE 'early1100\] bitwise the run without it: PASS' $L/test-moe-cuda.log) shared PASS" >> $S
san memcheck test-fuse-cuda 'cuda_fuse.kda_decode_tail' 300
san memcheck test-mla-cuda 'cuda_mla.decode_v4_l2_prefetch_bitwise' 300
D="timeout 150 $B/bench-cuda-decode --steps 30 --no-compare --no-profile --batch 1"
b48() { local tag=$1 sets=$2; $D --preset kimi-linear-48b ${sets:+--set $sets} > $L/d48-$tag.log 2>&1
  echo "[$(( $(date +%s) - T0 ))s] 48b $tag rc=$? | $(grep -E '^kimi-linear-48b +new' $L/d48-$tag.log | awk '{print $1, $5, $6}' | tr '\n' ' ')" >> $S; }
for r in 1 2; do
  b48 base$r ""
  b48 pn$r "l2_prefetch_next=1"
  b48 pnef$r "l2_prefetch_next=1,moe_bf16_evict_first=1"
  b48 r12$r "l2_prefetch_next=1,moe_bf16_evict_first=1,l2_prefetch_route_mb=12"
  b48 r24$r "l2_prefetch_next=1,moe_bf16_evict_first=1,l2_prefetch_route_mb=24"
  b48 r36$r "l2_prefetch_next=1,moe_bf16_evict_first=1,l2_prefetch_route_mb=36"
  b48 r24noef$r "l2_prefetch_next=1,l2_prefetch_route_mb=24"
done
for t in base pn; do
  $D --preset k3-layers-4 $([ $t = pn ] && echo --set l2_prefetch_next=1) > $L/dk3-$t.log 2>&1
  echo "[$(( $(date +%s) - T0 ))s] k3 $t rc=$? | $(grep -E '^k3-layers-4 +new' $L/dk3-$t.log | awk '{print $1, $5, $6, $NF}' | tr '\n' ' ')" >> $S
done
$D --preset kimi-linear-48b --timeline 20 --set l2_prefetch_next=1,moe_bf16_evict_first=1,l2_prefetch_route_mb=24 > $OUT/timeline-48b-all.log 2>&1
echo "[$(( $(date +%s) - T0 ))s] timeline rc=$?" >> $S
timeout 200 $B/bench-cuda-decode --preset k3-layers-4 --prefill 2048 --no-compare --set linear_split_bf16=0,moe_mma_split=0 > $L/prefill-onebf16.log 2>&1
echo "[$(( $(date +%s) - T0 ))s] prefill one-bf16 rc=$? | $(grep -E 'GEMM share|ms/step' $L/prefill-onebf16.log | tr '\n' ' ')" >> $S
nvidia-smi --query-gpu=name,driver_version --format=csv >> $S 2>&1
tar czf $OUT/logsA.tgz -C $OUT logs && rm -rf $L
cat $S
