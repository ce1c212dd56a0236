#!/bin/bash
# session 13, call E: the final tree (the tensor-core MLA prefill attention in call C's form). Every CUDA test binary,
# memcheck / synccheck on the MLA test, compare-backends at 70 and 300 tokens on the 9 models, decode batches 1/8/64
# once (no decode change: a regression check), prefill of both presets, and the 48B at 8192 tokens with the switch on
# and off (the attention grows with T^2).
set -u
source tools/gpu/calls/common.sh
( run test-ops-cuda 400 ""; run test-moe-cuda 500 ""; run test-route-cuda 150 ""; run test-kda-decode-cuda 100 ""; run test-pdl-cuda 100 "" ) &
( run test-fuse-cuda 300 ""; run test-mla-cuda 200 ""; run test-prefill-cuda 300 ""; run test-sample-cuda 100 ""; run test-kda-cuda 200 "" ) &
( sleep 20; san memcheck test-prefill-cuda 'cuda_prefill.mla_flash_vs_cpu_and_absorbed' 300; san synccheck test-prefill-cuda 'cuda_prefill.mla_flash_vs_cpu_and_absorbed' 300 ) &
wait
echo "mma-vs-simt controls: $(grep -h 'mma bitwise equal to simt' $L/test-prefill-cuda.log | grep -o '\] [A-Z]* (must' | sort | uniq -c | tr '\n' ' ')" >> $S
run test-runtime-cuda 400 ""
compare_models
compare_models 300 4 120
D="timeout 150 $B/bench-cuda-decode --steps 30 --no-compare --no-profile"
decode_rounds 1
prefill kimi-linear-48b 512,1024,2048,4096 e
prefill k3-layers-4 512,2048 e
prefill kimi-linear-48b 8192 on8k --no-profile
prefill kimi-linear-48b 8192 off8k --no-profile --set mla_prefill_mma=0
grep -E "ms/step" $OUT/prefill-kimi-linear-48b-on8k.log $OUT/prefill-kimi-linear-48b-off8k.log >> $S
grep -E "MLA_ATTN|default +T.*ms/step" $OUT/prefill-*-e.log >> $S
nvidia-smi --query-gpu=name,driver_version --format=csv >> $S 2>&1
tar czf $OUT/logsE.tgz -C $OUT logs && rm -rf $L
cat $S
