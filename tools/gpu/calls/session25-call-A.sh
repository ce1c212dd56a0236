#!/bin/bash
# session 25, call A (session 24 call B, plus norm-row.cuh: test-ops-cuda norm_reg_bitwise): the one-launch MoE block (moe-layer-decode.cu, cuda_options::moe_layer_fused) first:
# test-moe-layer-cuda (bit for bit the unfused launches after the router, controls, graph replays, refusals, [timing]
# per layer), test-fuse-cuda's engine-level case and the pending replay tests, memcheck of the kernel's correctness
# case; the refactors' suites (route-pick.cuh: test-route-cuda; moe-bf16-rows.cuh: test-fuse-cuda moe_shared_slot);
# then the 48B step with the switch off / on (alternating, two rounds; cut to 16 layers on an 80 GB card) and its
# timeline with it on. Summary, the moe-layer log and the timeline.
set -u
source tools/gpu/calls/common.sh
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >> $S 2>&1
run test-moe-layer-cuda 300 ""
grep -E '^\[(moe_layer|timing)\]|Failure|rror|Expected|Which is|vs ' $L/test-moe-layer-cuda.log | head -40 >> $S
cp $L/test-moe-layer-cuda.log $OUT/ 2>/dev/null
run test-ops-cuda 200 "-norm" --gtest_filter='cuda_ops.norm*:cuda_ops.elementwise_norms*'
run test-fuse-cuda 300 "-ml" --gtest_filter='cuda_fuse.moe_layer_fused:cuda_fuse.side_prefetch*:cuda_fuse.capture_replay*:cuda_fuse.moe_shared*'
grep -E '^\[moe_layer|Failure|FAIL' $L/test-fuse-cuda-ml.log | head -20 >> $S
cut_48b
D="timeout 120 $B/bench-cuda-decode --steps 40 --no-compare --no-profile --batch 1 $CUT"
for r in 1 2; do b kimi-linear-48b ml0-r$r moe_layer_fused=0; b kimi-linear-48b ml1-r$r moe_layer_fused=1; done
grep -h "MoE blocks as one launch" $L/d-kimi-linear-48b-ml1-r1.log >> $S
timeout 120 $B/bench-cuda-decode --steps 20 --no-compare --no-profile --batch 1 $CUT --preset kimi-linear-48b --set moe_layer_fused=1 --timeline 10 > $OUT/timeline-48b-ml1.log 2>&1
echo "timeline rc=$?" >> $S
run test-route-cuda 150 ""
# last: under the sanitizer the grid's co-residency is not promised (a hang ends at the timeout)
san memcheck test-moe-layer-cuda 'moe_layer.fused_equals_unfused:moe_layer.refuses' 150
rm -rf $L
cat $S
