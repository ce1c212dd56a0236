#!/bin/bash
# session 10, call F: test-runtime-cuda alone on the final tree (call E ran it beside the CPU-heavy compare-backends and
# test-moe-cuda runs: serve_chat_replay_matches_cpu took 279 s there and the binary hit its 300 s timeout in the last
# test, every earlier test passed).
set -u
source tools/gpu/calls/common.sh
run test-runtime-cuda 400 ""
nvidia-smi --query-gpu=name,driver_version --format=csv >> $S 2>&1
tar czf $OUT/logsF.tgz -C $OUT logs && rm -rf $L
cat $S
