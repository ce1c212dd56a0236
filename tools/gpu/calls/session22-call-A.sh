#!/bin/bash
# session 22, call A: session 21's call C (never run: the expert tests with the shift form as the default and the
# table form pinned where compared, compare-backends at the defaults at 70 and 300 tokens, the serve smoke, the k3
# prefill under both policies, compare-backends under the bf16 policy at 1e-4 with the first node out of tolerance
# named) on this session's code, where the shift form has one multiply and runs only for expert tables whose scale bytes
# are all <= 128 (the table form otherwise: test-moe-cuda mma_v4_shift_large_scales, fp4_dequant_forms_exact's new
# control). The k3 prefill under the bf16 policy alternates session 21's binary (bench-cuda-decode-s21: the predicated
# second multiply) with this one. Then one decode round at the defaults (batches 1, 8, 64), the 48B prefill where the
# card holds it, and the full suite (every CUDA test binary, compare-backends at 70 tokens, the serve smoke). Fewer
# than 8 files under $OUT: the test and smoke logs are summarized and removed.
set -u
source tools/gpu/calls/common.sh
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >> $S 2>&1
run test-moe-cuda 300 "-mma" --gtest_filter='*fp4_dequant_forms*:*bf16_inputs*:*mma_v4*:*mma_v3*:*mma_split*'
grep -E "^\[fp4-forms\]|shift form by default|shift form launches|large-scales" $L/test-moe-cuda-mma.log | head -16 >> $S
# prefill A/B under the bf16 policy: s21 (two multiplies), s22 (one), alternating
pf() { local bin=$1 tag=$2; shift 2; timeout 300 $B/$bin --preset k3-layers-4 --prefill 2048 "$@" > $L/pf-$tag.log 2>&1; local rc=$?
  echo "[$(( $(date +%s) - T0 ))s] prefill k3 $tag rc=$rc | $(grep -E '(default|bf16-in) +T|GEMM share|roofline' $L/pf-$tag.log | tr '\n' ' ') | $(grep -E ' (MOE_EXPERTS|LINEAR) x' $L/pf-$tag.log | tail -2 | awk '{print $NF, $(NF-1), $1}' | tr '\n' ' ')" >> $S; }
pf bench-cuda-decode-s21 bf16-s21a --bf16-inputs 256
pf bench-cuda-decode bf16-s22a --bf16-inputs 256
pf bench-cuda-decode-s21 bf16-s21b --bf16-inputs 256
pf bench-cuda-decode bf16-s22b --bf16-inputs 256
pf bench-cuda-decode-s21 split-s21
pf bench-cuda-decode split-s22
compare_models 300 4 120 def
compare_models 300 4 120 bf16e4 --bf16-inputs-tokens 2 --tol 1e-4
grep -E "^compare-backends: model|first out of tolerance: node|FAILED" $L/compare300-bf16e4.log | head -20 >> $S
# the k3-tiny failure under the policy at 1e-4, whole (its worst nodes per step)
timeout 120 $B/perigee compare-backends --model /tmp/pg-models/k3-tiny --ids "$(python3 -c "print(','.join(str((i*37+11)%250) for i in range(300)))")" \
  --decode 4 --bf16-inputs-tokens 2 --tol 1e-4 > $OUT/k3tiny-bf16e4.log 2>&1
cp $L/pf-bf16-s22a.log $OUT/prefill-k3-bf16.log; cp $L/pf-split-s22.log $OUT/prefill-k3-split.log
D="timeout 240 $B/bench-cuda-decode --steps 20 --no-compare --no-profile"
decode_rounds 1
prefill_48b_if_fits
full_suite   # every CUDA test binary, compare-backends at 70 tokens, the serve smoke
rm -rf $L $OUT/smoke
cat $S
