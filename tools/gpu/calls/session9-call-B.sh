#!/bin/bash
# session 9, call B (exploration, no new kernel code): (1) the kernel timeline with the GEMV v3 kernels (first weight
# loads before the PDL wait) on wider rows: gemv_v3_max_in 4096 (o_proj of the 48B, behind the KDA tail / MLA output),
# and every width 1024..16384; (2) Nsight Compute with the warp-state and memory sections on the serial kernels of a
# 48B step (the MLA attention is 19 us exposed for 2.5 MB; the KDA tail, the selection, the norm) and on K3's MLA.
set -u
source tools/gpu/calls/common.sh   # unpack, paths, run()
D="timeout 150 $B/bench-cuda-decode --steps 30 --no-compare --no-profile --batch 1 --timeline 6"
for v in "gemv_v3_max_in=2304" "gemv_v3_max_in=4096" "gemv_v3_min_in=1024,gemv_v3_max_in=16384" "gemv_v3_max_in=2304"; do
  $D --set $v > $L/tl-$v.log 2>&1
  echo "[$(( $(date +%s) - T0 ))s] timeline $v rc=$? | $(grep -E '^(k3-layers-4|kimi-linear-48b) +new|^kernel timeline' $L/tl-$v.log | sed 's/6 replays.*span (first start .. last end) median/span/; s/, gap to.*untraced graph step/ untraced/' | tr '\n' ' ')" >> $S
done
NCU="timeout 240 /usr/local/cuda/bin/ncu --clock-control none --section SpeedOfLight --section WarpStateStats --section LaunchStats --section Occupancy --section MemoryWorkloadAnalysis --section SchedulerStats --section SourceCounters"
$NCU --kernel-name regex:'k_mla_attn_v3|k_kda_decode_fused|k_moe_select_radix|k_norm_reg|k_mla_out_v3' --launch-skip 5 --launch-count 10 \
  $B/bench-cuda-decode --preset kimi-linear-48b --layers 4 --batch 1 --steps 1 --no-compare --no-profile > $L/ncu-48b-serial.txt 2>&1
echo "[$(( $(date +%s) - T0 ))s] ncu 48b serial kernels rc=$?" >> $S
$NCU --kernel-name regex:'k_mla_attn_v3' --launch-count 2 \
  $B/bench-cuda-decode --preset k3-layers-4 --batch 1 --steps 1 --no-compare --no-profile > $L/ncu-k3-mla.txt 2>&1
echo "[$(( $(date +%s) - T0 ))s] ncu k3 mla rc=$?" >> $S
for f in $L/tl-*.log; do cat $f; done > $OUT/timelines.log
cp $L/ncu-48b-serial.txt $L/ncu-k3-mla.txt $OUT/ 2>/dev/null
tar czf $OUT/logsB.tgz -C $OUT logs && rm -rf $L
cat $S
