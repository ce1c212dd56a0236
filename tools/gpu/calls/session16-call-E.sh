#!/bin/bash
# session 16, call E (no code; binaries of bbd4dc1): where the stacked split-bf16 LINEAR's token bound should sit for
# prefill chunks. The default (256) keeps the two GEMMs at 512 / 2048 tokens on the argument that those GEMMs are
# compute-bound; the 48B's LINEARs (2304-wide) may still be weight-bound at 512. Prefill at 512 / 2048 with the bound
# at 0 (two GEMMs everywhere), 256 (the default) and 4096 (stacked at every size run here), both presets.
set -u
source tools/gpu/calls/common.sh
for p in kimi-linear-48b k3-layers-4; do
  for v in 256 4096 0; do
    prefill $p 512,2048 s$v --no-profile --set linear_split_stacked=$v
  done
done
nvidia-smi --query-gpu=name,driver_version --format=csv >> $S 2>&1
rm -rf $L
cat $S
