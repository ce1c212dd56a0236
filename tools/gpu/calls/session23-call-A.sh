#!/bin/bash
# session 23, call A (an H200): (1) the side-branch L2 prefetch (cuda_options::l2_side_prefetch_mib, new): its test,
# then 48B / k3 decode B=1 with budgets 0 / 8 / 16 / 32 / 64 MiB in alternating rounds, a timeline at 0 and 16; (2)
# session 22's never-run call B (the k3 prefill under the bf16 policy on an H200, the 48B prefill at 2048 tokens under
# both policies); (3) memcheck on the MXFP4 v4 tests (the one-multiply shift form) and the side prefetch test. Summary only.
set -u
source tools/gpu/calls/common.sh
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >> $S 2>&1
cut_48b
run test-fuse-cuda 200 "-side" --gtest_filter='cuda_fuse.side_prefetch*:cuda_fuse.capture_replay*'
D48="timeout 150 $B/bench-cuda-decode --steps 40 --no-compare --no-profile --batch 1 $CUT"
D="timeout 150 $B/bench-cuda-decode --steps 40 --no-compare --no-profile --batch 1"
DK=$D; D=$D48
for r in 1 2; do for mb in 0 8 16 32 64; do b kimi-linear-48b s$mb-r$r l2_side_prefetch_mib=$mb; done; done
b kimi-linear-48b s16b64 l2_side_prefetch_mib=16,l2_side_prefetch_blocks=64
b kimi-linear-48b s16b16 l2_side_prefetch_mib=16,l2_side_prefetch_blocks=16
for r in 1 2; do for mb in 24 40; do b kimi-linear-48b span2-s$mb-r$r l2_side_prefetch_mib=$mb,l2_side_prefetch_span=2; done; done
D=$DK
for r in 1 2; do for mb in 0 16 32; do b k3-layers-4 s$mb-r$r l2_side_prefetch_mib=$mb; done; done
grep -h "side L2" $L/d-kimi-linear-48b-s16-r1.log $L/d-k3-layers-4-s16-r1.log >> $S
for mb in 0 16; do timeout 150 $B/bench-cuda-decode --steps 40 --no-compare --no-profile --batch 1 --preset kimi-linear-48b $CUT --set l2_side_prefetch_mib=$mb --timeline 10 > $OUT/timeline-48b-s$mb.log 2>&1; done
echo "[$(( $(date +%s) - T0 ))s] timelines done" >> $S
prefill k3-layers-4 2048 bf16 --bf16-inputs 256
if [ -z "$CUT" ]; then prefill kimi-linear-48b 2048 bf16 --bf16-inputs 256 --no-profile; prefill kimi-linear-48b 2048 split --no-profile; fi
for f in $OUT/prefill-*.log; do echo "== $(basename $f)" >> $S; grep -E ' (MOE_EXPERTS|LINEAR) x|GEMM share|ms/step eager' $f | cut -c1-220 >> $S; done
san memcheck test-moe-cuda 'cuda_moe.fp4_dequant*:cuda_moe.mma_v4*:cuda_moe.decode_v4*:cuda_moe.small_v4*' 200
san memcheck test-fuse-cuda 'cuda_fuse.side_prefetch*' 100
rm -rf $L $OUT/prefill-*.log
cat $S
