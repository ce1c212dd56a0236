#!/usr/bin/env bash
# One call on the GPU machine: (build) -> CUDA op parity -> compute-sanitizer -> compare-backends -> benchmark.
# Logs go under $OUT. Usage (from the repo root, on the GPU machine):
#   tools/gpu/run.sh                 # uses prebuilt binaries in .gpu-carry/ when present (see tools/gpu/README.md)
# Steps can be skipped with SKIP="sanitizer racecheck initcheck synccheck compare bench decode"; CARRY names the prebuilt folder.
# DECODE_ARGS are passed to bench-cuda-decode (the whole-step benchmark). COMPARE_LG=1 runs compare-backends a second
# time with cuda_options::linear_group on. PREFILL_ARGS (e.g. "--preset k3-layers-4 --prefill 512,2048") adds a
# prefill run of bench-cuda-decode; SIDE_LAYERS=N (+ SIDE_CTX) adds Perigee vs HF transformers' KimiLinear on the
# 48B geometry cut to N layers (tools/gpu/hf_side_by_side.py; decode, and a prefill of SIDE_CTX tokens), both in
# side.log; SIDE_HF=0 leaves out the HF half. COMPARE_MMA=N runs compare-backends a second time with --moe-mma N
# (tensor-core experts from N tokens); COMPARE_EXTRA="--fuse 1;--kda-chunk 16" adds one run per flag set; DECODE_ARGS2 runs bench-cuda-decode a second time (decode2.log).
set -uo pipefail
OUT=${OUT:-$PWD/out-gpu}
mkdir -p "$OUT"
SKIP=${SKIP:-}
log() { echo "== $*" | tee -a "$OUT/summary.log"; }
skip() { [[ " $SKIP " == *" $1 "* ]]; }

CARRY=${CARRY:-.gpu-carry}
if [[ -x $CARRY/bin/perigee ]]; then
  BIN=$CARRY/bin
  export LD_LIBRARY_PATH=$PWD/$CARRY/lib:${LD_LIBRARY_PATH:-}
else
  # Build here (needs the Debian deps of scripts/install-deps.sh, which the stock GPU image lacks).
  cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DPERIGEE_CUDA=ON >"$OUT/configure.log" 2>&1 &&
    ninja -C build-gpu perigee test-ops-cuda bench-cuda-kernels >"$OUT/build.log" 2>&1 || { log "build failed"; tail -30 "$OUT/build.log"; exit 1; }
  mkdir -p build-gpu/bin && cp build-gpu/tools/perigee build-gpu/tests/ops/cuda/test-ops-cuda build-gpu/tests/ops/cuda/bench-cuda-kernels build-gpu/bin/
  BIN=build-gpu/bin
fi
# cuBLASLt / cudart: the toolkit's, else the pip wheels' copies next to PyTorch.
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib \
         $(python3 -c 'import nvidia, os; p=os.path.dirname(nvidia.__path__[0]); print(" ".join(os.path.join(r) for r,_,f in os.walk(p) if any(x.startswith(("libcublasLt.so","libcudart.so")) for x in f)))' 2>/dev/null); do
  [[ -d $d ]] && export LD_LIBRARY_PATH=$LD_LIBRARY_PATH:$d
done
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv | tee -a "$OUT/summary.log"
git rev-parse --short HEAD 2>/dev/null | sed 's/^/commit /' | tee -a "$OUT/summary.log"
status=0

log "1. CUDA op parity (test-ops-cuda)"
$BIN/test-ops-cuda >"$OUT/ops.log" 2>&1 || status=1
grep -E "passed, .* failed|FAILED|PASSED" "$OUT/ops.log" | tail -12 | tee -a "$OUT/summary.log"

# The per-family parity executables (test-kda-cuda, test-moe-cuda, test-fuse-cuda, test-prefill-cuda, test-sample-cuda,
# test-pdl-cuda, test-route-cuda, test-mla-cuda, test-kda-decode-cuda,
# test-runtime-cuda), when built.
for t in test-kda-cuda test-moe-cuda test-fuse-cuda test-prefill-cuda test-sample-cuda test-runtime-cuda test-pdl-cuda \
         test-route-cuda test-mla-cuda test-kda-decode-cuda; do
  [[ -x $BIN/$t ]] || { echo "$t: not in $BIN (skipped)" | tee -a "$OUT/summary.log"; continue; }
  log "1b. $t"
  $BIN/$t >"$OUT/$t.log" 2>&1 || status=1
  grep -E "passed, .* failed|FAILED|PASSED|SKIPPED" "$OUT/$t.log" | tail -8 | tee -a "$OUT/summary.log"
done

if ! skip sanitizer && command -v compute-sanitizer >/dev/null; then
  log "2. compute-sanitizer memcheck on the op tests"
  timeout 150 compute-sanitizer --tool memcheck --error-exitcode 9 $BIN/test-ops-cuda \
    --gtest_filter='-*get_rows_and_linear*' >"$OUT/memcheck.log" 2>&1; rc=$?
  grep -E "ERROR SUMMARY|passed, .* failed" "$OUT/memcheck.log" | tail -3 | tee -a "$OUT/summary.log"; echo "memcheck rc=$rc" | tee -a "$OUT/summary.log"
  [[ $rc == 0 ]] || status=1
fi
if ! skip racecheck && command -v compute-sanitizer >/dev/null; then
  log "3. compute-sanitizer racecheck (shared-memory kernels: MLA, indexer, attn-res, norms)"
  timeout 90 compute-sanitizer --tool racecheck --error-exitcode 9 $BIN/test-ops-cuda \
    --gtest_filter='*mla*:*attn_res*:*elementwise*' >"$OUT/racecheck.log" 2>&1; rc=$?
  grep -E "RACECHECK SUMMARY|ERROR SUMMARY|passed, .* failed" "$OUT/racecheck.log" | tail -3 | tee -a "$OUT/summary.log"; echo "racecheck rc=$rc" | tee -a "$OUT/summary.log"
  [[ $rc == 0 ]] || status=1
fi

# initcheck (reads of uninitialised device memory) and synccheck (illegal __syncthreads/barrier use): issue 9 item 5.
for tool in initcheck synccheck; do
  if ! skip "$tool" && command -v compute-sanitizer >/dev/null; then
    log "3b. compute-sanitizer $tool on the op tests"
    timeout 150 compute-sanitizer --tool $tool --error-exitcode 9 $BIN/test-ops-cuda \
      --gtest_filter='-*get_rows_and_linear*' >"$OUT/$tool.log" 2>&1; rc=$?
    grep -E "ERROR SUMMARY|passed, .* failed" "$OUT/$tool.log" | tail -3 | tee -a "$OUT/summary.log"; echo "$tool rc=$rc" | tee -a "$OUT/summary.log"
    [[ $rc == 0 ]] || status=1
  fi
done

if ! skip compare; then
  log "4. compare-backends (CPU vs CUDA node by node; greedy tokens)"
  IDS=$(python3 -c 'print(",".join(str((i*37+11)%250) for i in range(70)))')
  # COMPARE_LONG=1: a 300-token prompt too (prefill-sized steps: the large-step expert threshold, the MLA/conv/AttnRes
  # prefill kernels' long paths, several KDA chunks)
  IDS_LONG=$(python3 -c 'print(",".join(str((i*53+7)%250) for i in range(300)))')
  mkdir -p /tmp/pg-models
  for p in k3-tiny k31-tiny kimi-linear-tiny; do
    [[ -d /tmp/pg-models/$p ]] || $BIN/perigee synth --preset $p --out /tmp/pg-models/$p >>"$OUT/synth.log" 2>&1
  done
  for m in tests/golden/kimi_linear/*/ /tmp/pg-models/*/; do
    for ids in "$IDS" "5,9,200" ${COMPARE_LONG:+"$IDS_LONG"}; do
      $BIN/perigee compare-backends --model "$m" --ids "$ids" --decode 6 >>"$OUT/compare.log" 2>&1 || status=1
      echo "$m ($(echo "$ids" | tr ',' '\n' | wc -l) prompt tokens): $(grep -E '^compare-backends: (PASS|FAIL)|^error|Error' "$OUT/compare.log" | tail -1)" | tee -a "$OUT/summary.log"
      if [[ -n ${COMPARE_MMA:-} ]]; then
        timeout 60 $BIN/perigee compare-backends --model "$m" --ids "$ids" --decode 6 --moe-mma "$COMPARE_MMA" >>"$OUT/compare.log" 2>&1 || status=1
        echo "  moe_mma_tokens $COMPARE_MMA: $(grep -E '^compare-backends: (PASS|FAIL)|^error|Error' "$OUT/compare.log" | tail -1)" | tee -a "$OUT/summary.log"
      fi
      # COMPARE_EXTRA="--fuse 1;--kda-chunk 16": one more compare-backends run per ';'-separated flag set.
      IFS=';' read -ra extra <<<"${COMPARE_EXTRA:-}"
      for fl in "${extra[@]}"; do
        [[ -n $fl ]] || continue
        timeout 60 $BIN/perigee compare-backends --model "$m" --ids "$ids" --decode 6 $fl >>"$OUT/compare.log" 2>&1 || status=1
        echo "  $fl: $(grep -E '^compare-backends: (PASS|FAIL)|^error|Error' "$OUT/compare.log" | tail -1)" | tee -a "$OUT/summary.log"
      done
      if [[ ${COMPARE_LG:-0} == 1 ]]; then
        $BIN/perigee compare-backends --model "$m" --ids "$ids" --decode 6 --linear-group 1 >>"$OUT/compare.log" 2>&1 || status=1
        echo "  linear_group on: $(grep -E '^compare-backends: (PASS|FAIL)|^error|Error' "$OUT/compare.log" | tail -1)" | tee -a "$OUT/summary.log"
      fi
    done
  done
fi

if ! skip bench; then
  log "5. benchmark (ceilings and decode kernels)"
  $BIN/bench-cuda-kernels 2>&1 | tee "$OUT/bench.log" | tee -a "$OUT/summary.log" || status=1
fi
if ! skip decode && [[ -x $BIN/bench-cuda-decode ]]; then
  log "6. decode-step benchmark (bench-cuda-decode ${DECODE_ARGS:-})"
  $BIN/bench-cuda-decode ${DECODE_ARGS:-} 2>&1 | tee "$OUT/decode.log" | tee -a "$OUT/summary.log" || status=1
fi
if [[ -n ${DECODE_ARGS2:-} && -x $BIN/bench-cuda-decode ]]; then
  log "6b. decode-step benchmark (bench-cuda-decode $DECODE_ARGS2)"
  $BIN/bench-cuda-decode $DECODE_ARGS2 2>&1 | tee "$OUT/decode2.log" | tee -a "$OUT/summary.log" || status=1
fi
if [[ -n ${PREFILL_ARGS:-} && -x $BIN/bench-cuda-decode ]]; then
  log "7. prefill benchmark (bench-cuda-decode $PREFILL_ARGS)"
  $BIN/bench-cuda-decode $PREFILL_ARGS 2>&1 | tee "$OUT/prefill.log" | tee -a "$OUT/summary.log" || status=1
fi
if [[ -n ${SIDE_LAYERS:-} && -x $BIN/bench-cuda-decode ]]; then
  log "8. side by side: Perigee vs HF transformers KimiLinear, 48B geometry cut to $SIDE_LAYERS layers, ctx ${SIDE_CTX:-256}"
  $BIN/bench-cuda-decode --preset kimi-linear-48b --layers "$SIDE_LAYERS" --batch 1 --ctx "${SIDE_CTX:-256}" --no-compare \
    --no-profile 2>&1 | tee "$OUT/side.log" | tee -a "$OUT/summary.log" || status=1
  $BIN/bench-cuda-decode --preset kimi-linear-48b --layers "$SIDE_LAYERS" --prefill "${SIDE_CTX:-256}" 2>&1 |
    tee -a "$OUT/side.log" | tee -a "$OUT/summary.log" || status=1
  if [[ ${SIDE_HF:-1} == 1 ]]; then
    PYTHONUNBUFFERED=1 timeout 240 python3 tools/gpu/hf_side_by_side.py --layers "$SIDE_LAYERS" --ctx "${SIDE_CTX:-256}" \
      2>&1 | tee -a "$OUT/side.log" | grep -E '^hf:|Error|error' | tee -a "$OUT/summary.log" || status=1
  fi
fi
log "status $status"
exit $status
