#!/bin/bash
# session 12, call A (profiling, no kernel change): prefill of both presets at 512 and 2048 tokens with the per-op
# profile and the new GEMM-class roofline (bench-decode.cpp gemm_roofline: per node max(FLOPs x passes / GEMM rate,
# bytes / copy rate)); the 48B's prefill was last profiled in session 1 (4 layers, T=256). One decode round as a check.
set -u
source tools/gpu/calls/common.sh
prefill k3-layers-4 512,2048 a
prefill kimi-linear-48b 512,2048 a
D="timeout 150 $B/bench-cuda-decode --steps 30 --no-compare --no-profile"
decode_rounds 1
nvidia-smi --query-gpu=name,driver_version --format=csv >> $S 2>&1
tar czf $OUT/logsA.tgz -C $OUT logs && rm -rf $L
cat $S
