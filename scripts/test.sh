#!/usr/bin/env bash
# Installs, builds and runs every test Perigee has on this machine (the README's test command; CI
# runs it through .ci/run). CPU build + the whole CPU suite under ctest; with nvcc present, the
# CUDA backend is also compiled (it cannot run without a GPU: GPU tests run on the GPU machine
# through tools/gpu/run.sh and are recorded in bench/RESULTS.md).
set -euo pipefail
cd "$(dirname "$0")/.."
JOBS=${JOBS:-$(nproc)}

bash scripts/install-deps.sh
for s in scripts/install-test-deps.sh scripts/install-server-test-deps.sh; do
  if [ -f "$s" ]; then bash "$s"; fi
done

cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DPERIGEE_TESTS=ON
ninja -C build -j "$JOBS"

if command -v nvcc >/dev/null 2>&1 || [ -x /usr/local/cuda/bin/nvcc ]; then
  echo "== CUDA backend compile check (sm_90a; not run: no GPU here) =="
  cmake -S . -B build-cuda -G Ninja -DCMAKE_BUILD_TYPE=Release -DPERIGEE_CUDA=ON -DPERIGEE_TESTS=OFF \
        -DCMAKE_CUDA_COMPILER=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
  ninja -C build-cuda -j "$JOBS"
fi

# OpenMP threads spin while waiting by default; with ctest -j2 on 2 cores that starves the other
# test (131 s vs 6.6 s measured for the model suites). Passive waiting costs nothing here.
export OMP_WAIT_POLICY=PASSIVE
# The 32-concurrent-stream server test runs for 60 s in CI (issue 5); 4 s by default elsewhere.
export PERIGEE_SERVER_SOAK_S=${PERIGEE_SERVER_SOAK_S:-60}
ctest --test-dir build --output-on-failure -j "$JOBS" --timeout 900

# Reliability (issue 9). ASan+UBSan over the whole CPU suite; TSan over the runtime's and the server's
# concurrency tests (in-process server on the mock engine, and the drills against a TSan `perigee serve`);
# every fuzz corpus and regression input replayed, then
# each libFuzzer target for a bounded 30 s. PERIGEE_CI_SANITIZERS=0 skips this part on a dev machine.
if [ "${PERIGEE_CI_SANITIZERS:-1}" = 1 ]; then
  bash scripts/test-sanitizers.sh --asan-only --jobs "$JOBS"
  # engine.cancel_while_queued_prefilling_decoding_frees_everything is left out under TSan only: it
  # assumes the second request is admitted within two engine steps, which TSan's slowdown breaks
  # (a timing assumption, not a race; it runs in the normal and ASan suites).
  TSAN_REGEX='^([A-Za-z0-9_]+/)?(engine\.(continuous|preemption|concurrent|nan|submit)[a-z_]*|engine_[a-z_]+|scheduler|pools|prefix_[a-z_]+|batching|sampler|server_[a-z_]+)\.?' \
    bash scripts/test-sanitizers.sh --tsan-only --jobs "$JOBS"
  # Replay only: time-bounded fuzzing is not deterministic, so it runs by hand (scripts/fuzz.sh --seconds N),
  # not as a CI gate; each crash it finds becomes a committed regression input replayed here.
  bash scripts/fuzz.sh --seconds 0 --jobs "$JOBS"
fi
