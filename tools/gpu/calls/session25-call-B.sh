#!/bin/bash
# session 25, call B: session 24's call B (the one-launch MoE block: test-moe-layer-cuda, the engine case, the 48B step
# off / on and its timeline, test-route-cuda, memcheck), norm-row.cuh (test-ops-cuda's norm tests), and the KDA tail +
# o_proj launch (kda_oproj_fused: test-fuse-cuda kda_oproj_fused and kda_decode_tail, the 48B step with it off / on
# alternating, with moe_layer_fused off and on; memcheck). 48B rows cut to 16 layers on an 80 GB card.
set -u
source tools/gpu/calls/common.sh
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >> $S 2>&1
if [ -z "${TINY:-}" ]; then   # TINY=1 (with ROUNDS=1 SHORT=1): the engine-level cases and one bench round only
run test-moe-layer-cuda 150 ""
grep -E '^\[(moe_layer|timing)\]|Failure|rror|Expected|Which is|vs ' $L/test-moe-layer-cuda.log | head -40 >> $S
cp $L/test-moe-layer-cuda.log $OUT/ 2>/dev/null
fi
KO='cuda_fuse.kda_oproj_fused:cuda_fuse.moe_layer_fused'; [ -z "${TINY:-}" ] && KO="$KO:cuda_fuse.kda_decode_tail"
run test-fuse-cuda 150 "-ko" --gtest_filter="$KO"
grep -E '^\[(kda_oproj|moe_layer)|Failure|FAIL|rror' $L/test-fuse-cuda-ko.log | head -40 >> $S
cp $L/test-fuse-cuda-ko.log $OUT/ 2>/dev/null
cut_48b
D="timeout 120 $B/bench-cuda-decode --steps 40 --no-compare --no-profile --batch 1 $CUT"
for r in $(seq 1 ${ROUNDS:-2}); do   # ROUNDS=1 SHORT=1: the short form for a small device budget
  b kimi-linear-48b ml0-ko0-r$r moe_layer_fused=0,kda_oproj_fused=0; b kimi-linear-48b ml1-ko0-r$r moe_layer_fused=1,kda_oproj_fused=0
  b kimi-linear-48b ml0-ko1-r$r moe_layer_fused=0,kda_oproj_fused=1; b kimi-linear-48b ml1-ko1-r$r moe_layer_fused=1,kda_oproj_fused=1
done
grep -h "as one launch\|with their o_proj" $L/d-kimi-linear-48b-ml1-ko1-r1.log >> $S
timeout 120 $B/bench-cuda-decode --steps 20 --no-compare --no-profile --batch 1 $CUT --preset kimi-linear-48b --set moe_layer_fused=1,kda_oproj_fused=1 --timeline 10 > $OUT/timeline-48b-ml1-ko1.log 2>&1
echo "timeline rc=$?" >> $S
[ -n "${SHORT:-}" ] && { rm -rf $L; cat $S; exit 0; }
run test-ops-cuda 200 "-norm" --gtest_filter='cuda_ops.norm*:cuda_ops.elementwise_norms*'
run test-fuse-cuda 200 "-rest" --gtest_filter='cuda_fuse.side_prefetch*:cuda_fuse.capture_replay*:cuda_fuse.moe_shared*'
run test-route-cuda 150 ""
# last: under the sanitizer the grid's co-residency is not promised (a hang ends at the timeout)
san memcheck test-moe-layer-cuda 'moe_layer.fused_equals_unfused:moe_layer.refuses' 120
san memcheck test-fuse-cuda 'cuda_fuse.kda_oproj_fused' 120
rm -rf $L
cat $S
