#!/bin/bash
# session 15, call A: decode batches (T > 1) on the T == 1 expert kernels, every (token, pick) pair a slot of its own
# (the pair form: cuda_options::moe_decode_pairs_mxfp4 / _bf16; moe.cu launch_v6, moe-bf16-decode.cu). Tests first
# (test-moe-cuda whole: the new decode_pairs_direct / decode_pairs_batch and the T == 1 tests of the kernels that
# changed; test-prefill-cuda's kernel-alone test and test-kda-decode-cuda after their move to dev-buffer.h), the new
# direct test under memcheck and racecheck (no cuBLAS in it); then decode at batches 1..64 with the per-op profile, the
# defaults (pair form off) against the pair form on for both formats, and the BF16 crossover at 16 / 32 tokens.
set -u
source tools/gpu/calls/common.sh
run test-moe-cuda 400 ""
( run test-prefill-cuda 200 "" --gtest_filter='cuda_prefill.mla_attn_kernels_alone'; run test-kda-decode-cuda 200 "" ) &
( sleep 2; san memcheck test-moe-cuda 'cuda_moe.decode_pairs_direct' 300; san racecheck test-moe-cuda 'cuda_moe.decode_pairs_direct' 400 ) &
wait
grep -h 'moe-pairs' $L/test-moe-cuda.log | grep -E 'FAIL|control|launches|bitwise' | head -60 > $OUT/pairs-lines.txt
echo "pairs lines: $(grep -c 'moe-pairs' $L/test-moe-cuda.log); FAIL lines: $(grep 'moe-pairs' $L/test-moe-cuda.log | grep -c 'FAIL')" >> $S
D="timeout 200 $B/bench-cuda-decode --steps 20 --no-compare"
$D --batch 1,8,16,32,64 > $OUT/dec-off.log 2>&1; rc=$?; echo "[$(( $(date +%s) - T0 ))s] pairs off rc=$rc | $(grep -E '^(k3-layers-4|kimi-linear-48b) +new' $OUT/dec-off.log | awk '{print $1, $3, $5, $6, $9}' | tr '\n' ' ')" >> $S
$D --batch 1,8,16,32,64 --set moe_decode_pairs_mxfp4=64,moe_decode_pairs_bf16=64 > $OUT/dec-on.log 2>&1; rc=$?; echo "[$(( $(date +%s) - T0 ))s] pairs on rc=$rc | $(grep -E '^(k3-layers-4|kimi-linear-48b) +new' $OUT/dec-on.log | awk '{print $1, $3, $5, $6, $9}' | tr '\n' ' ')" >> $S
nvidia-smi --query-gpu=name,driver_version --format=csv >> $S 2>&1
cp $L/test-moe-cuda.log $OUT/ 2>/dev/null
tar czf $OUT/logsA.tgz -C $OUT logs && rm -rf $L
cat $S
