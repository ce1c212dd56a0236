#!/bin/bash
# session 12, call B (profiling, no change): the 48B prefill profile at 512 and 1024 tokens (call A's 2048 ran out of
# memory: every node output of an eager step lives until the step ends, ~20 MB x 900 nodes at T=2048).
set -u
source tools/gpu/calls/common.sh
prefill kimi-linear-48b 512,1024 b
nvidia-smi --query-gpu=name,driver_version --format=csv >> $S 2>&1
cat $S
