#!/usr/bin/env bash
# libFuzzer harness (issue 9; RELIABILITY.md §A5, §C2 "Fuzz smoke", §C3 campaigns).
#
#   scripts/fuzz.sh                      CI mode: install clang-14 if missing, build build-fuzz, replay every
#                                        committed corpus and regression input, then fuzz each target 60 s,
#                                        two at a time (-rss_limit_mb=2048 -timeout=2). Non-zero exit on any
#                                        crash, leak, sanitizer report, timeout or OOM.
#   scripts/fuzz.sh --seconds 3600 --nice --targets fuzz_config,fuzz_safetensors
#                                        a campaign by hand (record it in tests/fuzz/LEDGER.md)
#   scripts/fuzz.sh --seconds 0 --runs 30000 --seed 1
#                                        CI (scripts/test.sh): replay, then a BOUNDED fuzz of every target: exactly N
#                                        executions from a fixed seed into a fresh scratch corpus, so the same commit
#                                        fuzzes the same inputs every time (a time bound would make CI's verdict depend
#                                        on the machine's speed); not counted in the ledger
# Options: --seconds N (per target, default 60; 0 = replay only)  --jobs J (targets at once, default 2)
#          --runs N --seed S (bounded, reproducible fuzz: N executions per target from seed S; with --seconds 0)
#          --targets a,b  --nice (nice -n 19)  --timeout S (per input, wall clock; default 2, 30 with --nice)  --no-install  --no-build  --merge (minimize the campaign's
#          new inputs into tests/fuzz/corpus/<target>/ — review before committing)
# New inputs found during a run go to build-fuzz/campaign/<target>/ (not committed); crash inputs to
# build-fuzz/artifacts/<target>/. Each run appends "date commit target wall cpu execs" to build-fuzz/ledger.log
# (cpu = user+sys seconds of the fuzzing process: the number the ledger counts).
# A crash becomes a regression: copy the artifact to tests/fuzz/regressions/<target>/ with the fix.
set -euo pipefail
cd "$(dirname "$0")/.."

SECONDS_PER=60 JOBS=2 TARGETS="" NICE="" INSTALL=1 BUILD=1 MERGE=0 TIMEOUT="" RUNS=0 SEED=1
while [ $# -gt 0 ]; do
  case "$1" in
    --seconds) SECONDS_PER=$2; shift 2 ;;
    --jobs) JOBS=$2; shift 2 ;;
    --targets) TARGETS=${2//,/ }; shift 2 ;;
    --nice) NICE="nice -n 19"; shift ;;
    --no-install) INSTALL=0; shift ;;
    --no-build) BUILD=0; shift ;;
    --merge) MERGE=1; shift ;;
    --timeout) TIMEOUT=$2; shift 2 ;;
    --runs) RUNS=$2; shift 2 ;;
    --seed) SEED=$2; shift 2 ;;
    *) echo "fuzz.sh: unknown option $1" >&2; exit 2 ;;
  esac
done

# -timeout is wall-clock: at nice 19 on a loaded machine a 1 ms input can wait > 2 s for a core, so campaigns
# run with --nice use 30 s unless --timeout says otherwise (CI keeps the plan's 2 s).
if [ -z "$TIMEOUT" ]; then if [ -n "$NICE" ]; then TIMEOUT=30; else TIMEOUT=2; fi; fi
B=build-fuzz
if [ "$INSTALL" = 1 ] && { ! command -v clang++-14 >/dev/null 2>&1 || ! ls /usr/lib/llvm-14/lib/clang/*/lib/linux/libclang_rt.fuzzer-x86_64.a >/dev/null 2>&1; }; then
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq clang-14 libclang-rt-14-dev >/dev/null
fi

ALL="fuzz_safetensors fuzz_shard_index fuzz_config fuzz_tiktoken_ranks fuzz_tokenizer_roundtrip fuzz_stream_decoder
     fuzz_k3_parser fuzz_k2_parser fuzz_mxfp4_repack fuzz_server_request"
if [ "$BUILD" = 1 ]; then
  CC=clang-14 CXX=clang++-14 cmake -S . -B "$B" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DPERIGEE_FUZZ=ON \
    -DPERIGEE_TESTS=OFF -DPERIGEE_CUDA=OFF >/dev/null
  want=""
  # (the target list is captured first: `ninja ... | grep -q` under pipefail fails at random when grep exits early and
  # ninja dies of SIGPIPE, which once left two targets unbuilt and silently skipped in a clean-clone CI run)
  known=$(ninja -C "$B" -t targets all 2>/dev/null || true)
  for t in ${TARGETS:-$ALL}; do
    if grep -q "^$t:" <<<"$known"; then want="$want $t"; fi
  done
  $NICE ninja -C "$B" -j "${BUILD_JOBS:-$(nproc)}" $want
fi

# Targets that exist (fuzz_server_request only once src/server has api.h).
RUN="" FAIL_BUILD=0
for t in ${TARGETS:-$ALL}; do
  if [ -x "$B/tests/fuzz/$t" ]; then RUN="$RUN $t"
  elif [ "$t" = fuzz_server_request ] && [ ! -f src/server/api.h ]; then echo "fuzz.sh: $t skipped: src/server/api.h does not exist"
  else echo "fuzz.sh: $t was not built — FAIL"; FAIL_BUILD=1; fi
done

export ASAN_OPTIONS=${ASAN_OPTIONS:-abort_on_error=1:detect_leaks=1:allocator_may_return_null=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
COMMIT=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
FAIL=$FAIL_BUILD

dict_of() { [ -f "tests/fuzz/dict/$1.dict" ] && echo "-dict=tests/fuzz/dict/$1.dict" || true; }
inputs_of() {  # committed corpus and regressions that exist
  for d in "tests/fuzz/corpus/$1" "tests/fuzz/regressions/$1"; do if [ -d "$d" ]; then echo "$d"; fi; done
}

echo "== replay: committed corpora and regression inputs =="
for t in $RUN; do
  dirs=$(inputs_of "$t")
  [ -n "$dirs" ] || { echo "$t: no corpus"; FAIL=1; continue; }
  start=$(date +%s%N)
  if $NICE "$B/tests/fuzz/$t" -runs=0 -rss_limit_mb=2048 -timeout=10 $dirs >"$B/replay-$t.log" 2>&1; then
    printf '%-26s ok  %4d inputs  %d ms\n' "$t" "$(find $dirs -type f | wc -l)" $(( ($(date +%s%N) - start) / 1000000 ))
  else
    echo "$t: REPLAY FAILED (log: $B/replay-$t.log)"; tail -30 "$B/replay-$t.log"; FAIL=1
  fi
done

fuzz_one() {
  local t=$1
  mkdir -p "$B/campaign/$t" "$B/artifacts/$t"
  local log="$B/fuzz-$t.log"
  local timer=(); echo "0 0" > "$B/cpu-$t"
  [ -x /usr/bin/time ] && timer=(/usr/bin/time -f '%U %S' -o "$B/cpu-$t")
  if "${timer[@]}" $NICE "$B/tests/fuzz/$t" -max_total_time="$SECONDS_PER" -rss_limit_mb=2048 -timeout="$TIMEOUT" -print_final_stats=1 \
       $(dict_of "$t") -artifact_prefix="$B/artifacts/$t/" "$B/campaign/$t" $(inputs_of "$t") >"$log" 2>&1; then
    local execs; execs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$' || echo 0)
    local cpu; cpu=$(awk '{printf "%.0f", $1 + $2}' "$B/cpu-$t")
    echo "$(date -u +%Y-%m-%dT%H:%MZ) $COMMIT $t wall=${SECONDS_PER}s cpu=${cpu}s execs=${execs:-0}" >> "$B/ledger.log"
    printf '%-26s ok  %ss wall  %ss cpu  %s execs  corpus %s\n' "$t" "$SECONDS_PER" "$cpu" "${execs:-0}" "$(ls "$B/campaign/$t" | wc -l)+$(find $(inputs_of "$t") -type f | wc -l)"
    return 0
  else
    echo "$t: FUZZ FAILURE (log: $log; inputs: $B/artifacts/$t/)"; grep -E 'ERROR|FUZZ_CHECK|SUMMARY|Test unit written' "$log" | head -10
    return 1
  fi
}

# Bounded, reproducible fuzz (CI): N executions from a fixed seed; new inputs go to a scratch corpus that starts empty
# every time, so the committed corpus is all that is read and the run is the same on every machine.
runs_one() {
  local t=$1 scratch="$B/runs-scratch/$t"
  rm -rf "$scratch" && mkdir -p "$scratch" "$B/artifacts/$t"
  local start; start=$(date +%s)
  if $NICE "$B/tests/fuzz/$t" -runs="$RUNS" -seed="$SEED" -rss_limit_mb=2048 -timeout="$TIMEOUT" -print_final_stats=1 \
       $(dict_of "$t") -artifact_prefix="$B/artifacts/$t/" "$scratch" $(inputs_of "$t") >"$B/runs-$t.log" 2>&1; then
    printf '%-26s ok  %s runs (seed %s)  %ss\n' "$t" "$RUNS" "$SEED" $(( $(date +%s) - start ))
    return 0
  else
    echo "$t: FUZZ FAILURE in the bounded run (seed $SEED; log: $B/runs-$t.log; inputs: $B/artifacts/$t/)"
    grep -E 'ERROR|FUZZ_CHECK|SUMMARY|Test unit written' "$B/runs-$t.log" | head -10
    return 1
  fi
}

if [ "$RUNS" -gt 0 ]; then
  echo "== bounded fuzz: $RUNS runs per target from seed $SEED, $JOBS at a time =="
  pids=()
  for t in $RUN; do
    runs_one "$t" & pids+=($!)
    if [ ${#pids[@]} -ge "$JOBS" ]; then wait "${pids[0]}" || FAIL=1; pids=("${pids[@]:1}"); fi
  done
  for p in "${pids[@]}"; do wait "$p" || FAIL=1; done
fi

if [ "$SECONDS_PER" -gt 0 ]; then
  echo "== fuzz: ${SECONDS_PER}s per target, $JOBS at a time =="
  pids=() names=()
  for t in $RUN; do
    fuzz_one "$t" & pids+=($!); names+=("$t")
    if [ ${#pids[@]} -ge "$JOBS" ]; then
      wait "${pids[0]}" || FAIL=1; pids=("${pids[@]:1}"); names=("${names[@]:1}")
    fi
  done
  for p in "${pids[@]}"; do wait "$p" || FAIL=1; done
  if [ "$MERGE" = 1 ]; then
    for t in $RUN; do
      mkdir -p "tests/fuzz/corpus/$t"
      "$B/tests/fuzz/$t" -merge=1 -rss_limit_mb=2048 -timeout=10 "tests/fuzz/corpus/$t" "$B/campaign/$t" >/dev/null 2>&1 || FAIL=1
      echo "$t: corpus now $(ls tests/fuzz/corpus/$t | wc -l) files"
    done
  fi
fi
exit $FAIL
