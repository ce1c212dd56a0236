#!/usr/bin/env bash
# Sanitizer suites (issue 9; RELIABILITY.md §A5, §C2). CPU code only (CUDA is never built here).
#   build-asan: -DPERIGEE_SANITIZE=address (ASan + UBSan, no recovery) -> the CPU test suite under ctest
#   build-tsan: -DPERIGEE_SANITIZE=thread  -> the concurrency tests (runtime engine/scheduler, server)
# Zero reports is the bar: a report fails the test that triggered it (halt_on_error / abort_on_error).
# Suppressions live in cmake/sanitizers/{lsan,ubsan,tsan}.supp, each entry with its written reason.
#
# Usage: scripts/test-sanitizers.sh [--asan-only | --tsan-only] [--jobs N]
#   ASAN_EXCLUDE / TSAN_REGEX override the test selections below (ctest -E / -R regexes).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
DO_ASAN=1 DO_TSAN=1 JOBS=$(nproc)
while [ $# -gt 0 ]; do
  case "$1" in
    --asan-only) DO_TSAN=0; shift ;;
    --tsan-only) DO_ASAN=0; shift ;;
    --jobs) JOBS=$2; shift 2 ;;
    *) echo "test-sanitizers.sh: unknown option $1" >&2; exit 2 ;;
  esac
done
SUPP=$ROOT/cmake/sanitizers

# Tests left out of the ASan run, with the reason:
#  (none yet) — every CPU test runs under ASan+UBSan.
ASAN_EXCLUDE=${ASAN_EXCLUDE:-'^$'}
# The concurrency tests TSan runs: test suites that start threads (engine loop, server, mock engine) and the
# scheduler/pool state they share.
TSAN_REGEX=${TSAN_REGEX:-'^([A-Za-z0-9_]+/)?(engine|engine_[a-z_]+|server_[a-z_]+|scheduler|pools|prefix_[a-z_]+|batching|sampler)\.'}

RC=0
t0=$(date +%s)
if [ "$DO_ASAN" = 1 ]; then
  echo "== ASan+UBSan: build-asan =="
  cmake -S . -B build-asan -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DPERIGEE_SANITIZE=address \
        -DPERIGEE_TESTS=ON -DPERIGEE_CUDA=OFF >/dev/null
  ninja -C build-asan -j "$JOBS"
  t1=$(date +%s)
  export ASAN_OPTIONS="abort_on_error=1:halt_on_error=1:detect_leaks=1:detect_stack_use_after_return=1:strict_string_checks=1:check_initialization_order=1"
  export LSAN_OPTIONS="suppressions=$SUPP/lsan.supp:print_suppressions=0"
  export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1:suppressions=$SUPP/ubsan.supp"
  ctest --test-dir build-asan --output-on-failure -j "$JOBS" --timeout 900 -E "$ASAN_EXCLUDE" || RC=1
  # Load fault drills on the instrumented CLI (damaged shards must fail cleanly, with no sanitizer report),
  # unless tests/CMakeLists.txt already registers them with ctest.
  if [ -x build-asan/tools/perigee ] && ! ctest --test-dir build-asan -N -R '^drills\.' | grep -q 'drills\.'; then
    bash tests/fuzz/drills/load_faults.sh build-asan/tools/perigee build-asan/drills/load-faults || RC=1
  fi
  t2=$(date +%s)
  echo "ASan+UBSan: build $((t1 - t0)) s, tests $((t2 - t1)) s"
  unset ASAN_OPTIONS LSAN_OPTIONS UBSAN_OPTIONS
fi

if [ "$DO_TSAN" = 1 ]; then
  t3=$(date +%s)
  echo "== TSan: build-tsan (concurrency tests only) =="
  cmake -S . -B build-tsan -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DPERIGEE_SANITIZE=thread \
        -DPERIGEE_TESTS=ON -DPERIGEE_CUDA=OFF >/dev/null
  # Build only the test executables that hold a selected suite (the gtest binaries are named test_*).
  targets=$(ninja -C build-tsan -t targets all | sed -n 's/^\(test[-_][A-Za-z0-9_-]*\): phony$/\1/p' |
            grep -E '^test[-_](runtime|server)' || true)
  if [ -z "$targets" ]; then echo "TSan: no runtime/server test executables exist yet"; exit 0; fi
  ninja -C build-tsan -j "$JOBS" $targets
  t4=$(date +%s)
  export TSAN_OPTIONS="halt_on_error=1:second_deadlock_stack=1:suppressions=$SUPP/tsan.supp"
  export OMP_NUM_THREADS=1
  ctest --test-dir build-tsan --output-on-failure -j "$JOBS" --timeout 900 -R "$TSAN_REGEX" --no-tests=error || RC=1
  t5=$(date +%s)
  echo "TSan: build $((t4 - t3)) s, tests $((t5 - t4)) s"
fi
echo "sanitizers: total $(( $(date +%s) - t0 )) s"
exit $RC
