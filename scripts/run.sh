#!/usr/bin/env bash
# The README's main command: installs the dependencies, builds perigee, and generates text with the
# embedded default model (models/default).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DPERIGEE_TESTS=OFF >/dev/null
ninja -C build perigee
./build/tools/perigee generate "$@"
