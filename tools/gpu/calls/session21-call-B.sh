#!/bin/bash
# session 21, call B: after call A (H100), the deep v4 layout measured slower and removed (the 3-stage form restored;
# the lo plane still skipped when hi-only), the flagged LINEARs' shared bf16 x kept; new: the shift form of v4's MXFP4
# dequant (cuda_options::moe_mma_v4_shift, off until measured) and compare-backends' near-tie rule for grouped routing
# (model/route-ties.h). The two dequant forms against the reference decode, the tensor-core expert and bf16 tests, the
# k3 prefill under the bf16 policy with the table and the shift form (twice each, alternating) and with the shared x
# off, the split policy with both forms, compare-backends under the policy at 1e-5 and 1e-4 on the 9 models, memcheck,
# a kernel-level profile of the bf16 step (nsys, where installed) and the SASS of the gate/up kernel, then
# compare-backends at the defaults and the runtime / prefill suites (every suite ran in call A; cut to fit the device
# time left after three failed machine starts); the 48B prefill only on a card that holds it.
set -u
source tools/gpu/calls/common.sh
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >> $S 2>&1
run test-moe-cuda 300 "-mma" --gtest_filter='*fp4_dequant_forms*:*bf16_inputs*:*mma_v4*:*mma_v3*:*mma_split*'
run test-ops-cuda 200 "-bf16" --gtest_filter='*linear_bf16*'
prefill k3-layers-4 2048 bf16-table --bf16-inputs 256
prefill k3-layers-4 2048 bf16-shift --bf16-inputs 256 --set moe_mma_v4_shift=1
prefill k3-layers-4 2048 bf16-table2 --bf16-inputs 256
prefill k3-layers-4 2048 bf16-shift2 --bf16-inputs 256 --set moe_mma_v4_shift=1
prefill k3-layers-4 2048 bf16-noshare --bf16-inputs 256 --set linear_bf16_share_x=0
prefill k3-layers-4 512,2048 split
prefill k3-layers-4 2048 split-shift --set moe_mma_v4_shift=1
compare_models 300 4 120 bf16 --bf16-inputs-tokens 2 --tol 1e-5
compare_models 300 4 120 bf16e4 --bf16-inputs-tokens 2 --tol 1e-4
MOE_V4_SMALL=1 san memcheck test-moe-cuda '*fp4_dequant_forms*:*mma_v4_prefill*' 150
san memcheck test-ops-cuda '*linear_bf16_shared_x*' 200
NSYS=$(command -v nsys || ls /usr/local/cuda/bin/nsys /opt/nvidia/nsight-systems/*/bin/nsys 2>/dev/null | head -1)
if [ -n "$NSYS" ]; then
  timeout 200 $NSYS profile -o $OUT/k3-bf16 --force-overwrite true -t cuda $B/bench-cuda-decode --preset k3-layers-4 --prefill 2048 --bf16-inputs 256 --no-profile > $L/nsys.log 2>&1
  timeout 100 $NSYS stats --report cuda_gpu_kern_sum --format csv -o $OUT/k3-bf16 $OUT/k3-bf16.nsys-rep >> $L/nsys.log 2>&1
  rm -f $OUT/k3-bf16.nsys-rep $OUT/k3-bf16.sqlite
  echo "[$(( $(date +%s) - T0 ))s] nsys $NSYS: $(ls $OUT/k3-bf16* 2>/dev/null | tr '\n' ' ')" >> $S
else echo "[$(( $(date +%s) - T0 ))s] nsys: not installed" >> $S; fi
CUOBJ=$(command -v cuobjdump || ls /usr/local/cuda/bin/cuobjdump 2>/dev/null | head -1)
if [ -n "$CUOBJ" ]; then   # the SASS of v4's MXFP4 gate/up kernels (table form FMT 2, shift form FMT 3)
  $CUOBJ -sass $B/bench-cuda-decode 2>/dev/null | awk '/Function : /{p=/k_moe_mma4ILi2ELi[23]E/} p' | gzip > $OUT/sass-mma4-gu.txt.gz
  echo "[$(( $(date +%s) - T0 ))s] sass: $(zcat $OUT/sass-mma4-gu.txt.gz | wc -l) lines" >> $S
fi
compare_models
run test-runtime-cuda 120 ""
run test-prefill-cuda 120 ""
prefill_48b_if_fits
rm -rf $L/compare*.log.big
cat $S
