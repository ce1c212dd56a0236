#!/usr/bin/env bash
# The README's main command: installs the dependencies, builds perigee, and generates text with the
# embedded default model (models/default, a small Kimi K3 trained on Shakespeare). Arguments, if
# any, go to `perigee generate` instead of the default prompt.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
# PERIGEE_CUDA=ON adds the CUDA backend (nvcc 13, an sm_90a GPU: H100/H200); then `--backend cuda` runs on the GPU.
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DPERIGEE_TESTS=OFF -DPERIGEE_CUDA="${PERIGEE_CUDA:-OFF}" >/dev/null
ninja -C build perigee
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}
if [ $# -eq 0 ]; then
  set -- --prompt "ROMEO:" --raw -n 80
fi
./build/tools/perigee generate "$@"
